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

import functools
import os
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import AbstractConnection, HiredisRespSerializer
from redis.retry import Retry
from redis.sentinel import Sentinel

from ._exceptions import InvalidLimit


def _hosts(netloc: str, url: str) -> tuple[str | None, str | None, list[tuple[str, int]]]:
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
            raise InvalidLimit(f"bad host:port {part!r} in Redis URL {url!r}")
        hosts.append((host.strip("[]"), int(port)))
    return username, password, hosts


def client_from_url(
    url: str, *, socket_timeout: float, socket_connect_timeout: float, **options: Any
) -> Any:
    """A redis-py client for ``url`` with bounded timeouts.

    Raises:
        InvalidLimit: an unknown scheme or a malformed URL, naming it.
    """
    if not isinstance(url, str) or "://" not in url:
        raise InvalidLimit(f"not a Redis URL: {url!r}")
    scheme = url.split("://", 1)[0].lower()
    timeouts: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_connect_timeout,
    }
    if scheme in ("redis", "rediss", "unix"):
        options.setdefault("retry", Retry(NoBackoff(), 1))
        return redis.Redis.from_url(url, **timeouts, **options)
    if scheme not in ("redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster"):
        raise InvalidLimit(
            f"unknown Redis URL scheme {scheme!r} in {url!r}: expected redis, rediss, unix, "
            "redis+sentinel or redis+cluster"
        )
    parts = urlsplit(url)
    username, password, hosts = _hosts(parts.netloc, url)
    tls = scheme.startswith("rediss")
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise InvalidLimit(f"Sentinel URL {url!r} needs the master name: .../mymaster/0")
        master = path[0]
        db = int(path[1]) if len(path) > 1 else 0
        sentinel = Sentinel(hosts, sentinel_kwargs=dict(timeouts), **timeouts)  # type: ignore[no-untyped-call]
        return sentinel.master_for(  # type: ignore[no-untyped-call]
            master,
            db=db,
            username=username,
            password=password,
            ssl=tls,
            retry=options.pop("retry", Retry(NoBackoff(), 1)),
            **options,
        )
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in hosts],  # type: ignore[no-untyped-call]
        username=username,
        password=password,
        ssl=tls,
        **timeouts,
        **options,
    )


class HeldConnection:
    """One connection of a client's pool, kept by this process for its own commands.

    A command through ``redis.Redis`` takes a connection from the pool and gives it back
    each time: a poll of the socket for stray data, the pool's lock, and the
    observability records of redis-py 8 cost a pool process about 20 us of CPU per
    command, a fifth of a rate-limited task's overhead (measured with Celery's tracer
    and ``return 1``). This keeps one connection and sends on it directly (on its
    socket and parser when it is one of redis-py's plain connections, about 10 us of
    CPU less again), with the connection's own retry policy (the client's ``retry``:
    one retry on a connection that a Redis restart closed). One caller at a time: a
    thread that finds it busy (``-P threads``, gevent) sends through the client as
    usual. Only for a plain ``redis.Redis`` on a non-blocking pool (a ``BlockingConnectionPool`` may
    have no connection to spare); ``None`` from :meth:`for_client` otherwise.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._pool = client.connection_pool
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0
        self._exchange: Callable[[Any, tuple[Any, ...]], Any] = _exchange_through_connection

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
                conn = self._conn = self._pool.get_connection()
                self._pid = os.getpid()
                self._exchange = _exchange_for(conn)
            exchange = self._exchange
            try:
                return exchange(conn, args)
            except redis.ResponseError:
                raise  # a whole reply was read (NOSCRIPT, a script error)
            except Exception as error:
                first: list[Exception] = [error]
            # the retry policy decides, counting this first failure as its own

            def again() -> Any:
                if first:
                    raise first.pop()
                return exchange(conn, args)

            return conn.retry.call_with_retry(again, lambda _error: conn.disconnect())
        finally:
            self._lock.release()


def _exchange_for(conn: Any) -> Callable[[Any, tuple[Any, ...]], Any]:
    """How to send a command on ``conn`` and read its reply: directly on its socket and
    parser if it reads and writes as redis-py's own connections do, else through
    its methods (a Sentinel connection reads differently; a health check interval
    needs them)."""
    cls = type(conn)
    if (
        cls.read_response is not AbstractConnection.read_response
        or cls.send_packed_command is not AbstractConnection.send_packed_command
        or conn.health_check_interval
        or not hasattr(conn, "_parser")
    ):
        return _exchange_through_connection
    if isinstance(getattr(conn, "_command_packer", None), HiredisRespSerializer):
        # what that serializer does for arguments of str, bytes and int, without
        # its per-call checks (2.6 -> 0.6 us for an EVALSHA)
        import hiredis  # there, since that serializer is in use

        return functools.partial(_exchange, pack=hiredis.pack_command)
    return functools.partial(_exchange, pack=lambda args: b"".join(conn.pack_command(*args)))


def _connected(conn: Any) -> Any:
    sock = getattr(conn, "_sock", None)
    if sock is None:
        # connect() as the pool would: a Sentinel connection asks the sentinels for
        # the primary there (send_command alone reconnects to the address it had,
        # the old primary after a failover)
        conn.connect()
        sock = conn._sock
    return sock


def _exchange(conn: Any, args: tuple[Any, ...], pack: Callable[[tuple[Any, ...]], bytes]) -> Any:
    """One command and its reply on ``conn``'s socket and parser, without the layers
    of ``send_command`` and ``read_response`` around them: what those do on this path
    (errors turned into redis-py's, a disconnect on any failure) is done here; their
    health checks, push handling and error formatting are not needed by a plain
    connection. About 10 us of CPU less per command on a 2-vCPU VM."""
    sock = _connected(conn)
    try:
        sock.sendall(pack(args))
        reply = conn._parser.read_response(disable_decoding=False)
    except redis.RedisError:
        conn.disconnect()
        raise
    except TimeoutError as exc:  # socket.timeout
        conn.disconnect()
        raise redis.TimeoutError(f"Timeout on the limiter's connection: {exc}") from exc
    except OSError as exc:
        conn.disconnect()
        raise redis.ConnectionError(f"Error on the limiter's connection: {exc}") from exc
    except BaseException:
        # whatever interrupted (a soft time limit, a signal) may have left a reply
        # unread on the socket; the next caller must not read it
        conn.disconnect()
        raise
    if isinstance(reply, redis.ResponseError):
        raise reply  # whole: the connection stays usable
    return reply


def _exchange_through_connection(conn: Any, args: tuple[Any, ...]) -> Any:
    """:func:`_exchange` through the connection's own ``send_command`` and
    ``read_response`` (a Sentinel connection, a health check interval)."""
    _connected(conn)
    try:
        conn.send_command(*args)
        return conn.read_response()
    except redis.ResponseError:
        raise
    except BaseException:
        conn.disconnect()
        raise
