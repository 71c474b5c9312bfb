"""What the engine thread tells the service, as returned values (events.py), never calls into it: a
step's pulls (where a request's KV is to land), held KV released by a COMPLETE or its lease, and
reservations for push mode."""

from __future__ import annotations

from kvmesh.libs.messages.engine import KVHandle, SamplingParams
from kvmesh.services.engine.native.events import EngineEvents, PullOrder

from .conftest import engine_for


def test_a_step_orders_the_pull_of_a_request_whose_kv_is_elsewhere(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, block_size=4)
    layers = engine.blocks.num_layers
    source = KVHandle(engine="p0", data_address="tcp://127.0.0.1:1", request_id="p-r0", num_tokens=9, block_size=4,
                      layers=[[7, 8, 9]] * layers)
    engine.add("r0", list(range(1, 11)), SamplingParams(max_tokens=2), kv_source=source)

    events = engine.step()

    request = engine.scheduler.find("r0")
    assert events.frames == [] and events.released == []
    assert events.pulls == [PullOrder("r0", source, [list(layer.blocks[:3]) for layer in request.layers])]
    engine.abort("r0")
    assert engine.pull_done("r0", 0.0, error="gone") == []   # aborted while pulling: freed when the pull ends
    assert engine.state().free_blocks == engine.state().total_blocks


def test_a_reservation_orders_no_pull_and_its_lease_frees_it(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, block_size=4)
    engine.reserve("r1", 9)

    events = engine.step()

    assert [(o.request_id, o.source, [len(blocks) for blocks in o.local]) for o in events.pulls] == \
        [("r1", None, [3] * engine.blocks.num_layers)]
    expired, _ = engine.expire_leases(engine.clock() + engine.kv_lease_s + 1)
    assert not expired   # a reservation nobody claimed is aborted: it held no KV of anyone's
    assert engine.state().free_blocks == engine.state().total_blocks


def test_held_kv_is_released_once_by_complete_or_lease(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint)
    for request_id in ("kept", "expires"):
        engine.add(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), hold_kv=True)
    frames = engine.step().frames
    assert sorted(f.kv_handle.request_id for f in frames) == ["expires", "kept"]

    assert engine.release_held("kept") == EngineEvents(released=["kept"])
    assert not engine.release_held("kept")          # a second COMPLETE releases nothing
    expired, next_deadline = engine.expire_leases(engine.clock() + engine.kv_lease_s + 1)
    assert (expired, next_deadline) == (EngineEvents(released=["expires"]), None)
    assert engine.state().free_blocks == engine.state().total_blocks
