"""Unit tier: pure logic, no server process and no database server (SQLite in tmp is fine)."""
