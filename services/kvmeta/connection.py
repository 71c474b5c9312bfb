"""kvmeta's Redis connection: one server at `redis_url`, or the master a set of Sentinels names.

Through Sentinels (`redis_sentinels`), redis-py's SentinelConnectionPool asks them for the master's
address on every new connection, so after a failover the next connection goes to the promoted
replica with no restart; calls that fail during the switch answer 503 (app.py's translations).
The password, if any, and the database come from `redis_url` and apply to the master's connections.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

from kvmesh.libs.controlplane import ConfigError


def connect(redis_url: str, sentinels: list[str], master: str, timeout_s: float) -> tuple[Redis, str]:
    """The client, and where it goes, for messages (never with a password)."""
    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "health_check_interval": 10}
    if not sentinels:
        return Redis.from_url(redis_url, **options), redis_url.rpartition("@")[2]
    url = urlsplit(redis_url)
    database = int(url.path.lstrip("/") or 0)
    addresses = [_address(entry) for entry in sentinels]
    sentinel = Sentinel(addresses, sentinel_kwargs={"socket_timeout": timeout_s,
                                                    "socket_connect_timeout": timeout_s}, **options)
    client = sentinel.master_for(master, password=url.password, db=database)
    return client, f"master {master!r} of Sentinels {', '.join(sentinels)}"


def _address(entry: str) -> tuple[str, int]:
    host, _, port = entry.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"redis_sentinels: {entry!r} is not host:port")
    return host, int(port)
