"""The Redis side of kvmeta: the key prefix of a cluster and the Lua scripts that change it.

The key layout is documented in `lua/prelude.lua`, which every script starts with. Each multi-key
change is one script, so it is atomic; redis-py reloads a script by itself after a Redis restart.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

SCRIPTS = ("register", "heartbeat", "deregister", "reap", "workers", "publish", "evict", "scores", "lookup",
           "put_blocks", "delete_blocks", "blocks")

_CLUSTER = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def key_prefix(cluster: str) -> str:
    """`kvmesh:{cluster}:`; the braces make the cluster name a Redis Cluster hash tag."""
    if not _CLUSTER.match(cluster):
        raise ValueError(f"cluster name must be 1-64 of [A-Za-z0-9._-], got {cluster!r}")
    return f"kvmesh:{{{cluster}}}:"


@cache
def script_source(name: str) -> str:
    lua = files(__package__) / "lua"
    return (lua / "prelude.lua").read_text() + (lua / f"{name}.lua").read_text()
