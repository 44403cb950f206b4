"""Redis clients from URLs: a single server, Sentinel, or Cluster.

- ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS, certificates verified
  by default), ``unix:///path/to/socket?db=0``: one server.
- ``redis+sentinel://[user:password@]host1:port1,host2:port2/master_name[/db]``: the
  current primary of ``master_name`` as told by those sentinels, followed across
  failovers (``rediss+sentinel://`` for TLS to the servers).
- ``redis+cluster://host:port[,host:port]`` (``rediss+cluster://``): a Redis Cluster; all
  limits of one call share a hash tag, so each call lands in one slot, and MOVED / ASK
  redirections after a resharding are followed by the client.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import Encoder  # type: ignore[attr-defined]
from redis.retry import Retry
from redis.sentinel import Sentinel

from .exceptions import InvalidRedisURL


def host_list(netloc: str, url: str) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    userinfo, _, hostlist = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) or None
    hosts = []
    for part in hostlist.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRedisURL(f"bad host:port {part!r} in Redis URL {redacted(url)}")
        hosts.append((host.strip("[]"), int(port)))
    return username, password, hosts


SCHEMES = (
    "redis",
    "rediss",
    "unix",
    *(f"{a}+{b}" for a in ("redis", "rediss") for b in ("sentinel", "cluster")),
)


def redacted(url: object) -> str:
    """``url`` for an error message: its password, if any, replaced by ``***``."""
    if not isinstance(url, str):
        return repr(url)
    head, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return repr(url)
    return repr(f"{head}://{userinfo.split(':', 1)[0]}:***@{hosts}")


def check_url(url: object) -> str:
    """``url`` if it is a Redis URL this library can connect to; its scheme, lowercase.

    Raises:
        InvalidRedisURL: not a string, an unknown scheme, or a malformed host, port or db,
            naming the URL (its password redacted).
    """
    if not isinstance(url, str) or "://" not in url:
        raise InvalidRedisURL(f"not a Redis URL: {redacted(url)}")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise InvalidRedisURL(
            f"unknown Redis URL scheme {scheme!r} in {redacted(url)}: expected redis, rediss, "
            "unix, redis+sentinel or redis+cluster"
        )
    parts = urlsplit(url)
    if scheme == "unix":
        if not parts.path:
            raise InvalidRedisURL(f"Redis URL {redacted(url)} names no socket path")
    elif scheme in ("redis", "rediss"):
        try:
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            raise InvalidRedisURL(f"bad port in Redis URL {redacted(url)}") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise InvalidRedisURL(f"bad database number {db!r} in Redis URL {redacted(url)}")
    else:
        host_list(parts.netloc, url)
    return scheme


def client_from_url(
    url: str, *, socket_timeout: float, socket_connect_timeout: float, **options: Any
) -> Any:
    """A redis-py client for ``url`` with bounded timeouts.

    Raises:
        InvalidRedisURL: an unknown scheme or a malformed URL, naming it.
    """
    scheme = check_url(url)
    timeouts: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_connect_timeout,
    }
    if scheme in ("redis", "rediss", "unix"):
        options.setdefault("retry", Retry(NoBackoff(), 1))
        return redis.Redis.from_url(url, **timeouts, **options)
    parts = urlsplit(url)
    username, password, hosts = host_list(parts.netloc, url)
    tls = scheme.startswith("rediss")
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise InvalidRedisURL(
                f"Sentinel URL {redacted(url)} needs the master name: .../mymaster/0"
            )
        master = path[0]
        db = int(path[1]) if len(path) > 1 else 0
        # one try per sentinel (redis-py 6+ would retry each with a backoff: seconds
        # before a closed port is told)
        asking = {**timeouts, "retry": Retry(NoBackoff(), 0)}
        sentinel = Sentinel(hosts, sentinel_kwargs=asking, **timeouts)  # type: ignore[no-untyped-call]
        return sentinel.master_for(  # type: ignore[no-untyped-call]
            master,
            db=db,
            username=username,
            password=password,
            ssl=tls,
            retry=options.pop("retry", Retry(NoBackoff(), 1)),
            **options,
        )
    return LazyCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in hosts],  # type: ignore[no-untyped-call]
        username=username,
        password=password,
        ssl=tls,
        **timeouts,
        **options,
    )


class LazyCluster:
    """A ``RedisCluster`` made at its first command, used as one.

    ``RedisCluster()`` asks a node for the slot map in its constructor: a cluster that
    is down, or a server that is not one, would fail where the limiter is made, before
    any failure handling sees it. Made here at the first command instead, its errors
    meet the same handling as a command's (``failures``); a failed attempt is made
    again at the next command.
    """

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def cluster(self) -> RedisCluster:
        """The ``RedisCluster``, made now if not yet.

        Raises:
            redis.exceptions.RedisClusterException: no listed node answered as a
                cluster node (down, or not in cluster mode).
        """
        client = self._client
        if client is None:
            with self._lock:
                client = self._client
                if client is None:
                    client = self._client = RedisCluster(**self._options)
        return client

    def get_encoder(self) -> Any:
        """The encoder of the client to be (a script's digest needs it, not a node)."""
        return Encoder(  # type: ignore[no-untyped-call]
            self._options.get("encoding", "utf-8"),
            self._options.get("encoding_errors", "strict"),
            self._options.get("decode_responses", False),
        )

    def register_script(self, script: str) -> Script:
        return Script(self, script)  # type: ignore[arg-type]

    def get_nodes(self) -> Any:
        return self.cluster().get_nodes()  # type: ignore[no-untyped-call]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        return self.cluster().execute_command(*args, **options)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "connection_pool":
            raise AttributeError(name)  # a cluster client has no pool
        return getattr(self.cluster(), name)


class HeldConnection:
    """One connection of a client's pool, kept by this process for the limiter's commands.

    A command through ``redis.Redis`` takes a connection from the pool and gives it back
    each time (a poll of the socket for stray data, the pool's lock, redis-py 8's
    observability records): that costs more CPU than the rest of a decision in Python.
    This keeps one connection and uses only its public methods (``connect``,
    ``send_command``, ``read_response``, ``disconnect``) under the connection's own retry
    policy (the client's ``retry``: one retry on a connection that a Redis restart closed).

    One caller at a time: a thread that finds it busy (``-P threads``, gevent) sends
    through the client as usual. Only for a plain ``redis.Redis`` on a non-blocking pool
    (a ``BlockingConnectionPool`` may have no connection to spare); :meth:`for_client`
    answers ``None`` otherwise.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._pool = client.connection_pool
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0

    @classmethod
    def for_client(cls, client: Any) -> HeldConnection | None:
        pool = getattr(client, "connection_pool", None)
        if (
            type(client) is not redis.Redis
            or getattr(client, "connection", None) is not None  # single_connection_client
            or not isinstance(pool, redis.ConnectionPool)
            or isinstance(pool, redis.BlockingConnectionPool)
        ):
            return None
        return cls(client)

    def call(self, *args: Any) -> Any:
        """The reply of one command, as ``client.execute_command(*args)`` gives it for
        a command with no response callback (``EVALSHA``, ``PING`` as sent here).

        Raises:
            redis.RedisError: as ``execute_command`` would (after the retry policy).
        """
        if not self._lock.acquire(blocking=False):
            return self._client.execute_command(*args)
        try:
            conn = self._conn
            if conn is None or self._pid != os.getpid():
                # first use, or inherited across a fork: the parent's socket is not ours
                conn = self._conn = take_connection(self._pool)
                self._pid = os.getpid()
            return conn.retry.call_with_retry(
                lambda: _exchange(conn, args), lambda _error: conn.disconnect()
            )
        finally:
            self._lock.release()


def take_connection(pool: Any) -> Any:
    """A connection from ``pool``, kept by the caller: redis-py before 5.3 needs a command
    name (``get_connection(command_name)``), later releases deprecate passing one."""
    global _NEEDS_COMMAND_NAME
    if _NEEDS_COMMAND_NAME is None:
        try:
            parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
        except (TypeError, ValueError):
            parameter = None
        _NEEDS_COMMAND_NAME = parameter is not None and parameter.default is inspect.Parameter.empty
    return pool.get_connection("EVALSHA") if _NEEDS_COMMAND_NAME else pool.get_connection()


_NEEDS_COMMAND_NAME: bool | None = None


def _exchange(conn: Any, args: tuple[Any, ...]) -> Any:
    """One command and its reply on ``conn``. ``connect()`` first, as the pool would
    before handing the connection out: a Sentinel connection asks the sentinels for the
    current primary there."""
    try:
        conn.connect()
        conn.send_command(*args)
        return conn.read_response()
    except redis.ResponseError:
        raise  # a whole reply was read (NOSCRIPT, a script error): still in step
    except BaseException:
        # a failure, or whatever interrupted (a soft time limit, a signal), may have
        # left a reply unread on the socket: the next caller must not read it
        conn.disconnect()
        raise


#: Times a script is loaded again when a ``SCRIPT FLUSH`` came between its load and its
#: run (see :func:`run_script`).
RELOADS = 3


def run_script(script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """The reply of a registered ``script`` (redis-py's ``Script``): ``EVALSHA``, and on
    NOSCRIPT the script loaded and sent again, as redis-py does. A ``SCRIPT FLUSH`` that
    comes between that load and that call (NOSCRIPT again) is met the same way, up to
    :data:`RELOADS` times more (``EVAL`` would load and run it at once, but the
    least-privilege ACL grants ``EVALSHA`` and ``SCRIPT LOAD`` only)."""
    for _ in range(RELOADS):
        try:
            return script(keys=keys, args=args)
        except redis.exceptions.NoScriptError:
            continue
    return script(keys=keys, args=args)


async def arun_script(script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """:func:`run_script` for redis.asyncio's scripts."""
    for _ in range(RELOADS):
        try:
            return await script(keys=keys, args=args)
        except redis.exceptions.NoScriptError:
            continue
    return await script(keys=keys, args=args)
