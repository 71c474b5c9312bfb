"""A node the prefetcher brought back for a waiting turn is not moved out again by the idle offload
before that turn (issue 31): past the high-water mark the idle offload moves only nodes no live
request will reuse (policies/cache/replacement.py's UNCLAIMED_SCORE), so it never undoes a prefetch.
The native engine and the simulator alike, on the prefetcher conformance test's script: three second
turns whose first turns' nodes went to the cxl tier, waiting in the window while the others run.

Before, the idle offload took prefetched nodes out while their turn waited and the next firing step
fetched them again: 11 prefetches of 8 nodes (1,408 bytes), 24 nodes moved out (3,072 bytes). Now 7
prefetches of 6 nodes (the 2 others stay on the device, spared as nodes a window turn will reuse):
one node is fetched twice, because a running request growing on a full device took it (a running
request's room comes first, the device's hard limit), not the idle offload.

A request's own room takes a claimed node only once no unclaimed idle node is left (replacement.py's
victims), whatever the cache policy's rank. With `lru` beside CaR's admission a prefetched node, its
last use long past, went first: before, 9 prefetches (1,152 bytes) and 22 nodes moved out, a running
request's growth taking 3 prefetched nodes while unclaimed ones were idle; now as with `car`'s rank."""

from __future__ import annotations

from .test_prefetch_conformance import CAR, LAYERS, SHAPE, run_native, run_sim

NODE_BYTES = LAYERS * SHAPE.bytes   # 128
PREFETCHED, MOVED_OUT = 7, 20       # nodes
LRU = {**CAR, "cache_policy": "lru"}


def test_the_native_engine_s_idle_offload_leaves_prefetched_nodes_for_their_turn():
    _, engine = run_native()
    blocks = engine.blocks
    assert engine.scheduler.reuse.prefetched == PREFETCHED
    assert dict(blocks.moved_nodes) == {"device": PREFETCHED, "cxl": MOVED_OUT}   # every reload a prefetch
    assert dict(blocks.moved_bytes) == {"device": PREFETCHED * NODE_BYTES, "cxl": MOVED_OUT * NODE_BYTES}
    assert engine.state().prefix_cache_hit_blocks == {"device": 24, "cxl": 0}


def test_the_simulator_s_idle_offload_leaves_prefetched_nodes_for_their_turn():
    _, engine = run_sim()
    blocks = engine.blocks
    assert engine.scheduler.reuse.prefetched == PREFETCHED
    assert dict(blocks.moved_nodes) == {"device": PREFETCHED, "cxl": MOVED_OUT}
    # Out: 11 nodes by the idle offload, 9 to make room on the step's path; in: prefetches only.
    assert dict(blocks.copied) == {"offload_idle": 11 * NODE_BYTES, "offload": 9 * NODE_BYTES,
                                   "prefetch": PREFETCHED * NODE_BYTES}
    assert dict(blocks.hit_blocks) == {"device": 24}


def test_a_running_request_s_room_takes_prefetched_nodes_last_whatever_the_rank():
    """Step by step, the lru rank's engine and simulator prefetch what the car rank's engine does."""
    native_log, native = run_native(LRU)
    sim_log, sim = run_sim(LRU)
    assert native_log == sim_log == run_native(CAR)[0]
    assert native.scheduler.reuse.prefetched == sim.scheduler.reuse.prefetched == PREFETCHED
    assert dict(native.blocks.moved_nodes) == dict(sim.blocks.moved_nodes) == {"device": PREFETCHED, "cxl": MOVED_OUT}
    assert dict(sim.blocks.copied) == {"offload_idle": 11 * NODE_BYTES, "offload": 9 * NODE_BYTES,
                                       "prefetch": PREFETCHED * NODE_BYTES}
