"""The simulator's blocks: counts per tier, all or nothing, and every block back when all is released."""

from kvmesh.sim.block_count import BlockCount
from kvmesh.sim.request import SimRequest


def test_reserving_swapping_and_releasing_count_every_layer():
    blocks = BlockCount(block_size=4, num_layers=3, totals={"device": 12, "cxl": 6})
    a, b = SimRequest("a", 0.0, 8, 4), SimRequest("b", 0.0, 4, 4)
    assert blocks.reserve(a, 2, 8) and blocks.free("device") == 6 and a.blocks_per_layer == 2
    assert blocks.reserve(a, 2, 1) and blocks.free("device") == 6  # within its blocks: nothing more
    assert not blocks.reserve(b, 3, 12) and b.blocks_per_layer == 0 and blocks.free("device") == 6
    assert blocks.swap_out(a) and a.tier == "cxl" and (blocks.free("device"), blocks.free("cxl")) == (12, 0)
    assert blocks.reserve(b, 3, 12) and blocks.free("device") == 3
    assert not blocks.swap_in(a) and a.tier == "cxl"  # 6 blocks do not fit in 3
    blocks.release(b)
    assert blocks.swap_in(a) and a.tier == "device" and blocks.moved == {"cxl": 6, "device": 6}
    blocks.release(a)
    assert (blocks.free("device"), blocks.free("cxl"), a.blocks_per_layer) == (12, 6, 0)
    assert blocks.pool_view().free == {"device": 12, "cxl": 6}


def test_without_a_cxl_tier_a_swap_fails():
    blocks = BlockCount(block_size=4, num_layers=1, totals={"device": 4})
    a = SimRequest("a", 0.0, 4, 4)
    assert blocks.reserve(a, 1, 4) and not blocks.swap_out(a) and a.tier == "device"
    assert blocks.attach_prefix(a, 0.0) == 0  # no prefix cache
