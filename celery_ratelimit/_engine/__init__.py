"""The engine: limits, keys, the storage layout, the Lua scripts and the limiters that
run them on Redis. It imports nothing of Celery."""
