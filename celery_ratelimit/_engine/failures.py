"""Redis failures sorted into those that pass and those that never end by themselves.

Transient (:class:`LimiterUnavailable`; the task's ``ratelimit_on_redis_error`` policy
applies): a connection refused, reset or timed out, ``LOADING``, ``BUSY``,
``READONLY`` / ``MASTERDOWN`` around a failover, ``TRYAGAIN``, ``CLUSTERDOWN``, ``OOM``,
``MISCONF``.

Permanent (:class:`LimiterMisconfigured`; a task fails at once): Redis answered, and
will answer the same until someone changes its configuration: credentials refused
(``WRONGPASS``, ``NOAUTH``), a TLS certificate not trusted, a missing ACL permission
(``NOPERM``), an unknown command
(a server older than 6.2, a renamed command), a key of another type (``WRONGTYPE``),
a script error, or a server that does not speak Redis at that address. The message
names the cause and the fix.
"""

from __future__ import annotations

import re
import socket
from typing import Any

from redis import exceptions as errors

from .exceptions import LimiterMisconfigured, LimiterUnavailable, RateLimitError

#: Error codes of replies that a later call may not get (a failover, a load, memory).
TRANSIENT_CODES = (
    "BUSY",
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "OOM",
    "MISCONF",
    "NOREPLICAS",
)
#: redis-py's classes for them (the codes it maps are not in the message).
TRANSIENT_ERRORS = (
    errors.ReadOnlyError,
    errors.OutOfMemoryError,
    errors.TryAgainError,
    errors.ClusterError,
    errors.RedisClusterException,
)
#: What redis-py's Cluster client says of a server not in cluster mode.
NOT_A_CLUSTER = "Cluster mode is not enabled"
#: Oldest Redis the scripts run on (they call ZMSCORE).
MIN_REDIS_VERSION = (6, 2)
#: Every command the limiter sends or its scripts call (checked against the ACL).
ACL_COMMANDS = (
    *(
        "evalsha",
        "script|load",
        "time",
        "ping",
        "del",
        "pexpire",
        "persist",
        "hmget",
        "hset",
        "hget",
        "hdel",
        "hincrby",
        "hgetall",
    ),
    *("zadd", "zcard", "zcount", "zmscore", "zrange", "zrangebyscore", "zrem"),
    *("zremrangebyscore", "zrevrangebyscore", "zscore", "pttl"),
    *("rpush", "lpop", "blpop"),  # a concurrency turn handed over
)


#: How a command a script ran reads when the ACL refused it: Redis 6.2 and 7.0 say
#: "The user executing the script can't run this command or subcommand" (no code, no
#: command name), Valkey 8 "ACL failure in script: User u has no permissions to run the
#: 'zadd' command", Redis 7.2+ the latter as a NOPERM error.
SCRIPT_NOPERM = ("The user executing the script can't", "ACL failure in script")
#: The command a NOPERM error names, if it does.
_REFUSED = re.compile(r"permissions to run the '([^']+)' command")


def acl_setuser(user: str, prefix: str, also: tuple[str, ...] = ()) -> str:
    """The ``ACL SETUSER`` line that gives ``user`` exactly what the limiter needs, and
    the commands ``also`` (what an operator's command needs besides: ``scan``)."""
    wanted = [*ACL_COMMANDS, *(c for c in also if c not in ACL_COMMANDS)]
    commands = " ".join(f"+{command}" for command in wanted)
    return f"ACL SETUSER {user} on >PASSWORD resetkeys ~{prefix}:* resetchannels -@all {commands}"


def translate(exc: Exception, doing: str, user: str | None, prefix: str) -> RateLimitError:
    """The library's error for a redis-py error met while ``doing`` something.

    Args:
        exc: what redis-py raised.
        doing: what the limiter was doing ("a rate-limit decision"), for the message.
        user: the Redis user the limiter logs in as (None: the default user).
        prefix: the limiter's key prefix, for the ACL line of the fix.
    """
    text = str(exc)
    if text.startswith("No master found"):
        # redis-py appends every sentinel client's repr, a few kB each
        text = text.split(" : <", 1)[0] + ": no sentinel named a primary"
    return _by_class(exc, text, doing, user, prefix) or _by_text(text, doing, prefix)


def _by_class(
    exc: Exception, text: str, doing: str, user: str | None, prefix: str
) -> RateLimitError | None:
    """The error that redis-py's exception class tells (None: the text must)."""
    if isinstance(exc, (errors.AuthenticationError, errors.AuthorizationError)):
        return LimiterMisconfigured(
            f"Redis refused the limiter's credentials during {doing} ({text}): check the "
            "user and password in ratelimit_redis_url (redis://USER:PASSWORD@host:port/db)"
        )
    if isinstance(exc, errors.ConnectionError) and "certificate verify failed" in text:
        return LimiterMisconfigured(
            f"the Redis server's TLS certificate was not trusted during {doing} ({text}): "
            "name the CA that signed it (rediss://host:port/db?ssl_ca_certs=/path/ca.crt) "
            "and a host name the certificate holds"
        )
    if isinstance(exc, errors.RedisClusterException) and NOT_A_CLUSTER in text:
        return LimiterMisconfigured(
            f"the limiter's redis+cluster:// URL names a Redis server that is not in "
            f"cluster mode ({text}) during {doing}: use redis://host:port/db for a single "
            "server, or name the nodes of a cluster (cluster-enabled yes)"
        )
    if isinstance(exc, (errors.ConnectionError, errors.TimeoutError, *TRANSIENT_ERRORS)):
        return LimiterUnavailable(f"Redis failed during {doing}: {text}")
    if isinstance(exc, errors.NoPermissionError) or any(m in text for m in SCRIPT_NOPERM):
        name = user or "default"
        # a command refused that the limiter's own list lacks (status and reset scan)
        refused = _REFUSED.search(text)
        return LimiterMisconfigured(
            f"the limiter's Redis user {name!r} lacks a permission it needs ({text}) "
            f"during {doing}: give it every command the limiter uses and its key prefix: "
            f"{acl_setuser(name, prefix, (refused[1].lower(),) if refused else ())}"
        )
    if isinstance(exc, errors.InvalidResponse):
        return LimiterMisconfigured(
            f"the limiter's Redis URL does not point at a Redis server ({text}) during "
            f"{doing}: check the host and port of ratelimit_redis_url"
        )
    return None


def _by_text(text: str, doing: str, prefix: str) -> RateLimitError:
    """The error that Redis's reply tells by its words."""
    code = text.split(" ", 1)[0]
    # inside a script, Redis 6.2 quotes the command's error after the script's line:
    # "Error running script (...): @user_script:150: ... -READONLY You can't write ..."
    if code in TRANSIENT_CODES or any(
        f" {c} " in f" {text} " or f" -{c} " in f" {text} " for c in TRANSIENT_CODES
    ):
        return LimiterUnavailable(f"Redis failed during {doing}: {text}")
    if "WRONGTYPE" in text:
        return LimiterMisconfigured(
            f"a key under the limiter's prefix {prefix!r} holds a value of another type "
            f"({text}) during {doing}: something else writes there; give the limiter its "
            "own ratelimit_key_prefix, or delete that key"
        )
    if "unknown command" in text.lower() or "Unknown Redis command" in text:
        return LimiterMisconfigured(
            f"this Redis server lacks a command the limiter needs ({text}) during {doing}: "
            f"celery-ratelimit needs Redis {'.'.join(map(str, MIN_REDIS_VERSION))} or "
            "newer with EVALSHA and SCRIPT LOAD enabled"
        )
    if "script" in text.lower():
        return LimiterMisconfigured(
            f"the limiter's Lua script failed in Redis during {doing} ({text}): please "
            "report it, with the Redis server's version"
        )
    return LimiterMisconfigured(f"Redis rejected the limiter's command during {doing}: {text}")


def never_reached(exc: BaseException) -> bool:
    """Did the limiter's call fail before any server answered (a connection refused or
    timed out, a host name unknown)? ``exc`` is the library's error, chained from
    redis-py's. A server that answered ``LOADING`` was reached."""
    cause = exc.__cause__
    return isinstance(cause, (errors.ConnectionError, errors.TimeoutError)) and not isinstance(
        cause, errors.BusyLoadingError
    )


def version_error(version: str) -> LimiterMisconfigured | None:
    """The error for a server of ``version`` (``INFO``'s ``redis_version``), if too old."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    if found >= MIN_REDIS_VERSION:
        return None
    return LimiterMisconfigured(
        f"Redis {version} is too old for the limiter: it needs "
        f"{'.'.join(map(str, MIN_REDIS_VERSION))} or newer (its scripts call ZMSCORE)"
    )


#: The first byte of every reply a Redis server (RESP2 or RESP3) can send.
RESP_TYPES = b"+-:$*_,#!=(%~>|"


def not_redis_error(connection_kwargs: Any, timeout: float) -> LimiterMisconfigured | None:
    """After a connection failure: the error to raise if the server at the client's
    address answers a PING with something that is not Redis's protocol (another
    service's port). None if it speaks Redis, or cannot be asked."""
    if not isinstance(connection_kwargs, dict) or "host" not in connection_kwargs:
        return None
    address = (connection_kwargs["host"], int(connection_kwargs.get("port") or 6379))
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            first = sock.recv(16)
    except OSError:
        return None
    if not first or first[:1] in RESP_TYPES:
        return None
    return LimiterMisconfigured(
        f"the limiter's Redis URL does not point at a Redis server: {address[0]}:{address[1]} "
        f"answered a PING with {first!r}: check the host and port of ratelimit_redis_url"
    )


def redis_versions(info: Any) -> list[str]:
    """``redis_version`` from ``INFO server``: one server's, or each Cluster node's."""
    if not isinstance(info, dict):
        return []
    if "redis_version" in info:
        return [str(info["redis_version"])]
    return [
        str(v["redis_version"])
        for v in info.values()
        if isinstance(v, dict) and "redis_version" in v
    ]


def check_versions(info: Any) -> None:
    """Raise the error for a server too old, from its ``INFO server`` (each node's).

    Raises:
        LimiterMisconfigured: a server older than the scripts need, naming its version.
    """
    for version in redis_versions(info):
        too_old = version_error(version)
        if too_old is not None:
            raise too_old
