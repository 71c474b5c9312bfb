"""The link model: bytes from the KV geometry, reads with and without coalescing, transfers one
after another on a pair's connection."""

import pytest

from kvmesh.sim.link import KVGeometry, LinkSpec, pull, push
from kvmesh.sim.shared_link import SharedLink

GEOMETRY = KVGeometry(num_layers=4, kv_heads=2, head_dim=64, dtype_bytes=2)
LINK = LinkSpec(gbps=2.0, latency_us=500.0, per_read_us=10.0)


def test_a_pull_moves_whole_blocks_of_every_layer():
    """100 tokens in blocks of 16: 7 blocks a layer, each K and V of 16 tokens x 2 heads x 64 x 2 bytes."""
    transfer = pull(LINK, GEOMETRY, 16, 100)
    assert GEOMETRY.block_bytes(16) == 2 * 16 * 2 * 64 * 2 == 8192
    assert transfer.bytes == 7 * 4 * 8192
    assert transfer.reads == 4  # contiguous blocks: one read a layer
    assert transfer.data_s == pytest.approx(4 * 10e-6 + 7 * 4 * 8192 / 2e9, rel=1e-12)
    assert transfer.latency_s == pytest.approx(500e-6, rel=1e-12)


@pytest.mark.parametrize("coalescing, runs, reads", [(True, 1, 4), (True, 3, 12), (True, 50, 28), (False, 1, 28)])
def test_coalescing_merges_each_contiguous_run_into_one_read(coalescing, runs, reads):
    spec = LinkSpec(gbps=LINK.gbps, latency_us=LINK.latency_us, per_read_us=LINK.per_read_us, coalescing=coalescing,
                    block_runs=runs)
    transfer = pull(spec, GEOMETRY, 16, 100)
    assert transfer.reads == reads  # never more runs than blocks: 7 a layer
    assert transfer.seconds - pull(LINK, GEOMETRY, 16, 100).seconds == pytest.approx((reads - 4) * 10e-6, rel=1e-9)


def test_transfers_on_one_link_go_first_come_first_served():
    """The second one's reads start when the first one's have landed; the ACK wait holds nobody."""
    link, first, second = SharedLink(), pull(LINK, GEOMETRY, 16, 100), pull(LINK, GEOMETRY, 16, 30)
    assert link.add(1.0, [("d", "a", first, [1.0])]) == [("a", 1.0 + first.data_s)]
    assert link.add(1.0, [("d", "b", second, [1.0])]) == [("b", 1.0 + first.data_s + second.data_s)]
    assert link.add(5.0, [("d", "c", first, [5.0])]) == [("c", 5.0 + first.data_s)]  # idle by then


def test_bad_geometry_and_links_are_refused():
    assert KVGeometry.parse("32:8:128:2") == KVGeometry(32, 8, 128, 2)
    for text in ("32:8:128", "32:8:x:2", "0:8:128:2"):
        with pytest.raises(ValueError):
            KVGeometry.parse(text)
    with pytest.raises(ValueError):
        LinkSpec(gbps=0)


@pytest.mark.parametrize("step_s", [0.02, 1e-4])
def test_pushed_writes_follow_the_layers_and_leave_the_last_layers_write(step_s):
    """Layer k of L is computed at start + k T / L and its write (w = data / L) queues then: the last
    is ACKed at start + max(T + w, T / L + L w) + latency (a link slower than the layers backs up)."""
    transfer, layers = push(LINK, GEOMETRY, 16, 0, 100), GEOMETRY.num_layers
    assert transfer.bytes == pull(LINK, GEOMETRY, 16, 100).bytes
    w = transfer.data_s / layers
    releases = [2.0 + step_s * layer / layers for layer in range(1, layers + 1)]
    [(_, landed)] = SharedLink().add(2.0, [("d", "a", transfer, releases)])
    assert landed == pytest.approx(2.0 + max(step_s + w, step_s / layers + layers * w), rel=1e-12)


def test_a_chunk_pushes_the_blocks_it_fills():
    """Tokens 20-51 in blocks of 16 touch blocks 1-3 (block 1, begun earlier, is written again)."""
    assert push(LINK, GEOMETRY, 16, 20, 32).bytes == 3 * GEOMETRY.num_layers * GEOMETRY.block_bytes(16)
