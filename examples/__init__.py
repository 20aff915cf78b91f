"""Runnable example projects (the Django-free one is example_project, at the root)."""
