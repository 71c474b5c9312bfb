"""CaR's policies as pure functions: the priority classes and the Shuffled Window (III-B.1), fetch(t)
with worked numbers (III-B.2), and score replacement (III-B.3)."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest

from kvmesh.policies.cache import DONE_SCORE, RUN_SCORE, WINDOW_SCORE, fetch, lru, time_to_free_s
from kvmesh.policies.cache import car as evict
from kvmesh.policies.cache.eviction_queue import EvictionQueue
from kvmesh.policies.cache.replacement import UNCLAIMED_SCORE, victims
from kvmesh.policies.prefill_admission import car as admit
from kvmesh.policies.prefill_admission import fill_window, reuse_class
from kvmesh.policies.views import CachedBlockView, PoolView, RequestView

POOL = PoolView(block_size=16, num_layers=4, free=MappingProxyType({"device": 10}),
                total=MappingProxyType({"device": 10}))


def view(request_id: str, **fields) -> RequestView:
    defaults = dict(arrival=0.0, prompt_len=100, num_tokens=100, num_computed=0, num_generated=0, max_tokens=100,
                    blocks_per_layer=0, tier="device")
    return RequestView(request_id=request_id, **{**defaults, **fields})


# -- III-B.1: classes and the Shuffled Window -----------------------------------------------------

def test_device_reuse_first_no_history_second_any_cxl_reuse_last():
    assert reuse_class(view("a", cached_device_blocks=3)) == 0
    assert reuse_class(view("b")) == 1
    assert reuse_class(view("c", cached_cxl_blocks=1)) == 2
    assert reuse_class(view("d", cached_device_blocks=5, cached_cxl_blocks=1)) == 2  # partly from cxl: a transfer


def test_the_window_fills_by_class_then_arrival_and_keeps_its_members():
    waiting = [view("cxl", arrival=0.0, cached_cxl_blocks=2), view("none", arrival=1.0),
               view("device", arrival=2.0, cached_device_blocks=2), view("member", arrival=3.0, window_since=3.5),
               view("none-later", arrival=4.0)]
    # a window of 3 with one member: two enter, device reuse first, then no history
    assert fill_window(waiting, size=3, now=5.0, max_wait_s=10.0) == ["device", "none"]
    assert fill_window(waiting, size=1, now=5.0, max_wait_s=10.0) == []        # full already
    assert fill_window(waiting, size=10, now=5.0, max_wait_s=10.0) == ["device", "none", "none-later", "cxl"]


def test_a_request_waiting_past_max_wait_enters_before_any_class():
    waiting = [view("device", arrival=9.0, cached_device_blocks=2), view("old-cxl", arrival=0.0, cached_cxl_blocks=4)]
    assert fill_window(waiting, size=1, now=10.0, max_wait_s=10.0) == ["old-cxl"]   # waited 10 s: aged
    assert fill_window(waiting, size=1, now=9.5, max_wait_s=10.0) == ["device"]


def test_admission_serves_the_window_in_entry_order_then_the_rest_by_class():
    waiting = [view("late-member", arrival=0.0, window_since=2.0), view("early-member", arrival=1.0, window_since=1.0),
               view("cxl", arrival=0.5, cached_cxl_blocks=1), view("none", arrival=3.0),
               view("device", arrival=4.0, cached_device_blocks=1)]
    assert admit(waiting, [], POOL, 5.0) == ["early-member", "late-member", "device", "none", "cxl"]


# -- III-B.2: fetch(t) ----------------------------------------------------------------------------

def test_time_to_free_is_the_soonest_predicted_end():
    # TPOP 0.05 s: a 100-token request started 3 s ago has 5 - 3 = 2 s left; a 40-token one started
    # 1 s ago has 2 - 1 = 1 s left; one not started yet does not count.
    running = [view("a", predicted_output_len=100, scheduled_at=7.0), view("b", predicted_output_len=40, scheduled_at=9.0),
               view("c", predicted_output_len=1)]
    assert time_to_free_s(running, 10.0, 0.05) == pytest.approx(1.0)
    assert time_to_free_s([], 10.0, 0.05) == math.inf


def test_fetch_starts_when_the_soonest_end_is_within_the_load_time():
    running = [view("a", predicted_output_len=100, scheduled_at=7.0)]   # 2 s left at t = 10
    gib = 2**30
    assert not fetch(running, 10.0, 0.05, 64 * 2**20, 32 * gib)         # 64 MiB at 32 GiB/s: 1/512 s < 2 s
    assert fetch(running, 10.0, 0.05, 64 * gib, 32 * gib)               # 64 GiB: 2 s, not less than 2 s left
    assert fetch(running, 11.99, 0.05, 64 * 2**20, 32 * gib) is False    # 0.01 s left > 1/512 s
    assert fetch(running, 11.999, 0.05, 64 * 2**20, 32 * gib)            # 0.001 s left <= 1/512 s
    # the request's own max_tokens caps len_i when there is no prediction: 100 tokens here
    assert fetch([view("b", scheduled_at=5.0)], 10.0, 0.05, 1.0, 1.0)    # 5 - 5 = 0 s left <= 1 s


def test_an_idle_device_fetches_at_once():
    assert fetch([], 0.0, 0.05, 10 * 2**30, 1e9)
    assert fetch([view("queued", predicted_output_len=100)], 0.0, 0.05, 10 * 2**30, 1e9)


@pytest.mark.parametrize("tpop,size,bandwidth", [(-0.1, 1.0, 1.0), (0.1, -1.0, 1.0), (0.1, 1.0, 0.0)])
def test_fetch_refuses_impossible_inputs(tpop, size, bandwidth):
    with pytest.raises(ValueError):
        fetch([], 0.0, tpop, size, bandwidth)


# -- III-B.3: scores and replacement --------------------------------------------------------------

def test_a_request_s_scores_net_zero_over_its_life():
    assert WINDOW_SCORE == 1 and RUN_SCORE == 1 and DONE_SCORE == -2
    assert WINDOW_SCORE + RUN_SCORE + DONE_SCORE == 0


def eviction_order(rank, nodes: list[CachedBlockView]) -> list[str]:
    return [node.node_id for node in sorted(nodes, key=rank)]


def test_car_evicts_the_lowest_score_then_the_least_recently_used():
    nodes = [CachedBlockView("hot", last_access=1.0, hits=5, score=2), CachedBlockView("b", last_access=5.0, hits=0),
             CachedBlockView("a", last_access=3.0, hits=9), CachedBlockView("cold", last_access=9.0, hits=0, score=-1),
             CachedBlockView("tie", last_access=3.0, hits=0)]
    assert eviction_order(evict, nodes) == ["cold", "a", "tie", "b", "hot"]
    assert eviction_order(lru, nodes)[:2] == ["hot", "a"]   # the baseline ignores scores


@pytest.mark.parametrize("rank", [evict, lru])
def test_a_chain_let_go_at_once_is_evicted_tail_first(rank):
    """A head evicted before its tail would leave the tail cached but unreachable."""
    chain = [CachedBlockView(f"n{depth}", last_access=4.0, hits=0, depth=depth) for depth in (0, 1, 2)]
    older = CachedBlockView("older", last_access=1.0, hits=0, depth=0)
    assert eviction_order(rank, [*chain, older]) == ["older", "n2", "n1", "n0"]


@pytest.mark.parametrize("rank", [evict, lru])
def test_a_request_s_room_takes_claimed_nodes_only_after_every_unclaimed_one(rank):
    """A node a window request claimed (score 1: prefetched for it) goes last, even first in LRU order."""
    nodes = [CachedBlockView("prefetched", last_access=1.0, hits=0, score=1),
             CachedBlockView("claimed twice", last_access=2.0, hits=0, score=2),
             CachedBlockView("idle", last_access=5.0, hits=0), CachedBlockView("older", last_access=3.0, hits=0)]

    def pop(n: int, max_score: float | None = None) -> list[str]:
        idle = EvictionQueue(rank)
        for node in nodes:
            idle.put(node)
        return victims(idle, n, max_score)

    assert pop(2) == ["older", "idle"]
    assert pop(3) == ["older", "idle", "prefetched"]
    assert pop(9) == ["older", "idle", "prefetched", "claimed twice"]
    assert pop(9, UNCLAIMED_SCORE) == ["older", "idle"]   # the background moves: unclaimed only
