"""An existing Celery project given shared rate limits without touching its task code.

``tasks.py`` is the project's code; ``celery.py`` is its app, where the rules are set
and ``install(app)`` applied. ``python -m examples.existing_project`` sends a burst and
prints how the executions spread.
"""

from .celery import app

__all__ = ["app"]
