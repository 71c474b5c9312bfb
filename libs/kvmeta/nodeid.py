"""NodeIDs: names of full token blocks that are equal exactly when their whole prefixes are (CaR).

NodeID(block i) = H(NodeID(block i-1) || token ids of block i), with the root seeded by the model
name, so equal IDs mean equal prefixes under the same model, and one ID names a whole prefix.
Engines name their cached blocks with these; the scheduler computes them for a prompt to ask the
cache table who holds its prefix. A trailing partial block has no NodeID.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

DIGEST_BYTES = 16


def node_ids(token_ids: Sequence[int], block_size: int, model: str = "", parent: str | None = None) -> list[str]:
    """NodeIDs of every full block of `token_ids`, continuing from `parent` when given."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    previous = bytes.fromhex(parent) if parent else blake2b(model.encode(), digest_size=DIGEST_BYTES).digest()
    ids = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = blake2b(previous, digest_size=DIGEST_BYTES)
        # int64 little-endian, so the same tokens name the same block on every host.
        block = array("q", token_ids[start:start + block_size])
        if sys.byteorder == "big":
            block.byteswap()
        digest.update(block.tobytes())
        previous = digest.digest()
        ids.append(previous.hex())
    return ids
