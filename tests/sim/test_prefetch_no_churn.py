"""A node the prefetcher brought back for a waiting turn is not moved out again by the idle offload
before that turn (issue 31): past the high-water mark the idle offload moves only nodes no live
request will reuse (policies/cache/replacement.py's UNCLAIMED_SCORE), so it never undoes a prefetch.
The native engine and the simulator alike, on the prefetcher conformance test's script: three second
turns whose first turns' nodes went to the cxl tier; c0's is admitted as it comes (room enough) and
reloads its nodes at its turn, the two others wait for room while others run and are prefetched for
in the room spare (the rest reloaded at their turn).

(Before, the idle offload took prefetched nodes out while their turn waited and the next firing step
fetched them again. On an earlier form of this script, where the prefetcher also fired for turns
admitted in the same step, that was 11 prefetches of 8 nodes against 7 once fixed.) Here 4 nodes
prefetched, each once, and 4 reloaded at a turn (2 of them c0's).

A request's own room takes a claimed node only once no unclaimed idle node is left (replacement.py's
victims), whatever the cache policy's rank. With `lru` beside CaR's admission a prefetched node, its
last use long past, would go first: a running request's growth takes it and it is prefetched again
(5 prefetches here with the rank alone); now as with `car`'s rank."""

from __future__ import annotations

from .test_prefetch_conformance import CAR, LAYERS, SHAPE, run_native, run_sim

NODE_BYTES = LAYERS * SHAPE.bytes   # 128
PREFETCHED, MOVED_OUT = 4, 21       # nodes
RELOADED = 4                        # at a turn: c0's two, one each of c1's and c2's
LRU = {**CAR, "cache_policy": "lru"}


def test_the_native_engine_s_idle_offload_leaves_prefetched_nodes_for_their_turn():
    _, engine = run_native()
    blocks = engine.blocks
    assert engine.scheduler.reuse.prefetched == PREFETCHED
    assert dict(blocks.moved_nodes) == {"device": PREFETCHED + RELOADED, "cxl": MOVED_OUT}
    assert dict(blocks.moved_bytes) == {"device": (PREFETCHED + RELOADED) * NODE_BYTES, "cxl": MOVED_OUT * NODE_BYTES}
    assert engine.state().prefix_cache_hit_blocks == {"device": 20, "cxl": 4}


def test_the_simulator_s_idle_offload_leaves_prefetched_nodes_for_their_turn():
    _, engine = run_sim()
    blocks = engine.blocks
    assert engine.scheduler.reuse.prefetched == PREFETCHED
    assert dict(blocks.moved_nodes) == {"device": PREFETCHED + RELOADED, "cxl": MOVED_OUT}
    # Out: 13 nodes by the idle offload, 8 to make room on the step's path; in: prefetches and reloads.
    assert dict(blocks.copied) == {"offload_idle": 13 * NODE_BYTES, "offload": 8 * NODE_BYTES,
                                   "prefetch": PREFETCHED * NODE_BYTES, "load": RELOADED * NODE_BYTES}
    assert dict(blocks.hit_blocks) == {"device": 20, "cxl": 4}


def test_a_running_request_s_room_takes_prefetched_nodes_last_whatever_the_rank():
    """Step by step, the lru rank's engine and simulator prefetch what the car rank's engine does."""
    native_log, native = run_native(LRU)
    sim_log, sim = run_sim(LRU)
    assert native_log == sim_log == run_native(CAR)[0]
    assert native.scheduler.reuse.prefetched == sim.scheduler.reuse.prefetched == PREFETCHED
    assert dict(native.blocks.moved_nodes) == dict(sim.blocks.moved_nodes) == \
        {"device": PREFETCHED + RELOADED, "cxl": MOVED_OUT}
    assert dict(sim.blocks.copied) == {"offload_idle": 13 * NODE_BYTES, "offload": 8 * NODE_BYTES,
                                       "prefetch": PREFETCHED * NODE_BYTES, "load": RELOADED * NODE_BYTES}
