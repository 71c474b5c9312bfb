"""The vLLM backend's cxl-tier table: prefix lookups, slots for new blocks, CaR's scores and the
replacement order, pins, and the changes kvmeta is told of."""

from __future__ import annotations

import pytest

from kvmesh.policies.cache.replacement import car, lru
from kvmesh.services.engine.vllm_backend.host_table import HostTable


def filled(capacity: int, ids: list[str], replacement=car) -> HostTable:
    table = HostTable(capacity, replacement)
    for at, node_id in enumerate(ids):
        assert table.take_for_saves([(node_id, 0)], float(at))
    table.unpin(ids)
    return table


def test_a_lookup_counts_the_blocks_held_in_a_row_after_the_device_hit():
    table = filled(8, ["a", "b", "d"])
    assert table.match(["a", "b", "c", "d"], 0) == 2
    assert table.match(["x", "b", "c", "d"], 1) == 1    # vLLM found block 0 on the device
    assert table.match(["a", "b"], 2) == 0
    assert table.looked_up == 4 + 3 + 0


def test_each_new_block_gets_a_free_slot_until_there_is_none():
    table = HostTable(3, car)
    assert table.take_for_saves([(c, 0) for c in "abc"], 0.0) == [0, 1, 2]
    assert table.take_for_saves([("d", 0)], 0.0) == []          # every slot pinned this step
    assert table.saved == 3 and table.evicted == 0


def test_car_gives_up_the_lowest_score_first_and_lru_breaks_ties():
    table = filled(3, ["a", "b", "c"])
    table.release(["a", "b", "c"])                        # their requests ended: scores 0
    table.use("a", 10.0)                                  # a running request uses a: +2
    slot_b = table.nodes["b"].slot
    assert table.take_for_saves([("d", 0)], 11.0) == [slot_b]  # b and c score 0, b least recently used
    assert set(table.nodes) == {"a", "c", "d"} and table.evicted == 1
    assert table.nodes["a"].score == 2 + 2 - 2


def test_lru_would_have_evicted_the_node_in_use():
    table = filled(3, ["a", "b", "c"], replacement=lru)
    table.release(["a", "b", "c"])
    table.nodes["a"].score = 2   # in use, but LRU does not look
    assert table.take_for_saves([("d", 0)], 11.0) == [0] and "a" not in table.nodes


def test_a_pinned_node_is_never_evicted():
    table = filled(2, ["a", "b"])
    table.release(["a", "b"])
    assert table.take_for_load(["a"], 5.0) == [table.nodes["a"].slot]
    assert table.take_for_saves([("c", 0)], 6.0) == [1]        # b gave its slot up, a is being loaded
    assert table.take_for_saves([("d", 0)], 7.0) == []         # a and c pinned
    table.unpin(["a", "c"])
    assert table.take_for_saves([("d", 0)], 8.0)
    assert table.loaded == 1 and table.nodes["d"].pins == 1


def test_kvmeta_hears_of_added_rescored_and_evicted_nodes_once():
    table = filled(2, ["a", "b"])
    changed, dropped = table.take_changes()
    assert {n.node_id for n in changed} == {"a", "b"} and dropped == []
    table.release(["a", "b"])
    table.use("b", 3.0)
    table.take_for_saves([("c", 0)], 4.0)                      # evicts a
    changed, dropped = table.take_changes()
    assert {n.node_id for n in changed} == {"b", "c"} and dropped == ["a"]
    assert table.take_changes() == ([], [])


def test_a_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        HostTable(-1, car)


def test_room_for_several_new_nodes_is_made_in_one_choice():
    table = filled(3, ["a", "b", "c"])
    table.release(["a", "b", "c"])
    table.use("b", 10.0)
    assert table.take_for_saves([("d", 0), ("e", 0)], 11.0) == [table.nodes["d"].slot, table.nodes["e"].slot]
    assert set(table.nodes) == {"b", "d", "e"} and table.evicted == 2   # a and c, the idle ones scored 0
    slot_b = table.nodes["b"].slot
    assert table.take_for_saves([("f", 0), ("g", 0), ("h", 0)], 12.0) == [slot_b]      # d and e pinned: room for the first only
    assert set(table.nodes) == {"d", "e", "f"}


def test_a_prompt_saved_in_one_step_gives_up_its_tail_first():
    """Blocks of one prompt saved together have one last_access: without the depth, LRU would pick by
    NodeID, and evicting the head first strands the rest (a lookup matches from the start)."""
    table = HostTable(3, lru)
    assert table.take_for_saves([("head", 0), ("middle", 1), ("tail", 2)], 1.0) == [0, 1, 2]
    table.unpin(["head", "middle", "tail"])
    table.release(["head", "middle", "tail"])
    assert table.take_for_saves([("other", 0)], 2.0) == [2] and set(table.nodes) == {"head", "middle", "other"}
    assert table.match(["head", "middle", "tail"], 0) == 2
