"""The peer libraries of `kvmesh bench transfer` (Mooncake, NIXL) move the scattered blocks
byte-exactly between two processes; a peer whose library is not installed is skipped with why."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.bench import transfer_peers


@pytest.mark.parametrize("peer", transfer_peers.PEERS)
def test_peer_moves_every_byte(peer: str) -> None:
    reason = transfer_peers.available()[peer]
    if reason is not None:
        pytest.skip(f"{peer} unavailable here: {reason}")
    # measure() checks every destination byte (and that nothing else was written) and raises if not.
    assert transfer_peers.measure(peer, 4096, 64, repeats=1) > 0


def test_expected_blocks_are_the_owners_blocks() -> None:
    """The reader's expectation is computed without the owner's pool: it must match it row for row."""
    pool = transfer_peers.source_pool(32, 256, seed=3)
    ids = np.array([7, 0, 31, 8])
    assert np.array_equal(transfer_peers.source_blocks(ids, 256, seed=3), pool[ids])
    assert len({bytes(row) for row in pool}) == len(pool)  # every block differs from every other
