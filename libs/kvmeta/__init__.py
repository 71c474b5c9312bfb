"""kvmeta: the cluster's metadata (worker registry, CaR cache table, block map) behind one service.

`messages` are the bodies of its API, `client` is how other services use it, `nodeid` names prefix
blocks, and `schema` (with `lua/`) is the Redis layout that only services/kvmeta touches.
"""
