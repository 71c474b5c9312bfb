"""The engine's eviction queue against the plain definition: idle nodes sorted by the policy's rank."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvmesh.policies.cache import car, lru
from kvmesh.policies.views import CachedBlockView
from kvmesh.policies.cache.eviction_queue import EvictionQueue

IDS = [f"n{i}" for i in range(6)]
views = st.builds(CachedBlockView, node_id=st.sampled_from(IDS), last_access=st.integers(0, 4).map(float),
                  hits=st.just(0), score=st.integers(-1, 2).map(float), depth=st.integers(0, 3))
operations = st.lists(st.one_of(st.tuples(st.just("put"), views), st.tuples(st.just("discard"), st.sampled_from(IDS)),
                                st.tuples(st.just("pop"), st.integers(0, 3), st.sampled_from([None, 0.0]))),
                      max_size=200)


@given(operations, st.sampled_from([lru, car]), st.integers(0, 200))
def test_pops_follow_the_rank_of_each_node_s_latest_view(ops, rank, switch_at):
    queue, idle = EvictionQueue(lru), {}
    for step, (kind, *args) in enumerate(ops):
        if step == switch_at:
            queue.use(rank)
        if kind == "put":
            idle[args[0].node_id] = args[0]
            queue.put(args[0])
        elif kind == "discard":
            idle.pop(args[0], None)
            queue.discard(args[0])
        else:
            n, max_score = args
            allowed = [v for v in idle.values() if max_score is None or v.score <= max_score]
            expected = [v.node_id for v in sorted(allowed, key=queue.rank)[:n]]
            accept = None if max_score is None else (lambda v: v.score <= max_score)
            assert queue.pop(n, accept) == expected
            for node_id in expected:
                del idle[node_id]
        assert len(queue) == len(idle) and all(node_id in queue for node_id in idle)
