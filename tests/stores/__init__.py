"""Store tier: the store contract on SQLite, PostgreSQL and Redis; no celery worker."""
