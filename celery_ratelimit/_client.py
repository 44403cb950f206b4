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

from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
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
