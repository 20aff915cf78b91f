"""Worker tier: real celery worker and beat processes, the browser, the demo, benchmarks."""
