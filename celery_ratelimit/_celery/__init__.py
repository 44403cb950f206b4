"""The Celery integration: the task base, the check-and-defer path, the park,
``install``, the decorator, settings and metrics. It builds on the engine."""
