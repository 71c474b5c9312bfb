"""LayerKV's decodes with `decode_offloaded` "restore" (section 4): a prefilled request's offloaded
layers come back to the device once, and it decodes only then, from the device. The native
Scheduler over a real BlockManager and the SimEngine over its layer count decide the same steps; no
decode is staged; a restore costs its copy as any move between the tiers; and when every running
request waits for room and nothing runs, one gives its place up. The conformance also runs "stage"
(decodes staged every step), which tests/sim/test_layer_count.py ran before "restore" was the default."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.policies import registry
from kvmesh.policies.iteration import Status
from kvmesh.policies.offload import OffloadPlan, decodes_next
from kvmesh.sim.engine import SimEngine
from kvmesh.sim.request import SimRequest

from .test_layer_count import LAYERED
from .test_one_scheduler import COST, SCRIPT, SMALL, run_both

RESTORE = replace(LAYERED, offload=replace(LAYERED.offload, decode_offloaded="restore"))
STAGE = replace(LAYERED, offload=replace(LAYERED.offload, decode_offloaded="stage"))


@pytest.mark.parametrize("spec", [RESTORE, STAGE], ids=["restore", "stage"])
@pytest.mark.parametrize("device_blocks", [56, 40], ids=["pool", "tight"])
@pytest.mark.parametrize("admission", ["fcfs", "layerkv"])
@pytest.mark.parametrize("decode", [False, True], ids=["colocated", "decode"])
def test_the_simulator_restores_layers_as_the_native_scheduler_step_by_step(admission, decode, device_blocks, spec):
    spec = replace(spec, device_blocks=device_blocks)
    native_log, sim_log, blocks, engine = run_both({"layer_offload": "layerkv", "prefill_admission": admission},
                                                   decode, spec)

    for k, (ours, theirs) in enumerate(zip(sim_log, native_log)):
        assert ours == theirs, f"step {k}"
    assert blocks.free("device") == engine.free == spec.device_blocks
    assert blocks.free("cxl") == engine.blocks.free("cxl") == spec.cxl_blocks
    moved = engine.scheduler.layers_offloaded
    assert moved["admitted"] + moved["forecast"] > 0 and moved["restored"] > 0


def staged_decodes(spec) -> int:
    """SCRIPT on the simulator alone: the decodes that a step computed with layers in the cxl tier."""
    engine = SimEngine(spec, COST, {"layer_offload": "layerkv"})
    requests = [SimRequest(rid, arrival, prompt, out, ttft, tbt, predicted)
                for rid, arrival, prompt, out, ttft, tbt, predicted in SCRIPT]
    staged, now = 0, 0.0
    while not all(r.finished_at is not None for r in requests):
        for request in requests:
            if now <= request.arrival < now + 1.0:
                engine.add(request)
        step = engine.schedule(now)
        staged += sum(bool(r.offloaded) and decodes_next(r.view()) for r, _ in step.chunks)
        if step.chunks:
            engine.complete(step, now + engine.seconds(step))
        now += 1.0
    return staged


def test_no_decode_is_staged_once_restores_bring_the_layers_back():
    assert staged_decodes(STAGE) > 0, "the script is meant to decode offloaded requests"
    assert staged_decodes(RESTORE) == 0


def prefilled(engine: SimEngine, request: SimRequest, device_layers: tuple[int, ...], at: float) -> None:
    """The request as its prompt's last chunk leaves it: `device_layers` on the device, its first token out."""
    assert engine.blocks.place(request, device_layers) and engine.blocks.reserve(request, 4, request.prompt_len)
    request.num_computed, request.token_times, request.scheduled_at = request.prompt_len, [at], at
    request.status = Status.RUNNING
    engine.running.append(request)


def test_a_prefilled_request_decodes_once_its_layers_are_back_paying_their_copy_once():
    engine = SimEngine(RESTORE, COST, {"layer_offload": "layerkv"})
    request = SimRequest("a", 0.0, 14, 3, predicted_output_median=3)
    prefilled(engine, request, (1, 3), 0.5)
    step = engine.schedule(1.0)
    # layers 0 and 2 back (2 x 4 blocks), then the decode from the device: nothing staged
    assert step.chunks == [(request, 1)] and step.staged == {} and request.offloaded == ()
    assert step.swap_s == pytest.approx(8 * RESTORE.block_bytes / RESTORE.swap_in_bytes_per_s)
    engine.complete(step, 2.0)
    step = engine.schedule(2.0)
    assert step.chunks == [(request, 1)] and step.swap_s == 0.0 and step.staged == {}


def test_when_every_running_request_waits_for_room_the_one_behind_gives_its_device_layers_up():
    """20 device blocks: a and b keep 2 of 4 layers (8 blocks each); bringing a's other 2 back takes 8
    more and 4 are free, b's the same. b, behind a, decodes only once all of its layers are back, so
    its 2 on the device hold room for nothing: they go to the cxl tier, and a gets its layers back and
    decodes in the same step. Nobody is preempted (before, b was: recomputed, its prefill thrown away)."""
    spec = replace(RESTORE, device_blocks=20, offload=replace(RESTORE.offload, threshold_blocks=0))
    engine = SimEngine(spec, COST, {"layer_offload": "layerkv"})
    a, b = (SimRequest(rid, 0.0, 14, 2, predicted_output_median=2) for rid in "ab")
    prefilled(engine, a, (1, 3), 1.0)
    prefilled(engine, b, (1, 3), 2.0)
    assert engine.free == 4
    step = engine.schedule(3.0)
    assert step.chunks == [(a, 1)] and step.preempted == [] and step.staged == {}
    assert a.offloaded == () and b.offloaded == (0, 1, 2, 3) and b.num_computed == b.prompt_len


def test_with_nothing_else_to_run_the_first_in_line_gets_its_layers_back_whatever_the_policy(monkeypatch):
    """A layer_offload policy that keeps 2 layers of each admitted request and never plans a restore:
    once the request is prefilled nothing runs, and the scheduler brings its layers back itself."""
    monkeypatch.setitem(registry.HOOKS["layer_offload"], "keep2",
                        lambda inp: OffloadPlan(retain={r.request_id: 2 for r in inp.admitting}))
    engine = SimEngine(RESTORE, COST, {"layer_offload": "keep2"})
    request = SimRequest("a", 0.0, 14, 3)
    engine.add(request)
    step = engine.schedule(0.0)
    assert step.chunks == [(request, 12)] and request.offloaded == (0, 2)
    engine.complete(step, 1.0)
    step = engine.schedule(1.0)
    assert step.chunks == [(request, 2)] and set(step.staged) == {0, 2}  # the prompt's last chunk is staged
    engine.complete(step, 2.0)
    step = engine.schedule(2.0)
    assert step.chunks == [(request, 1)] and request.offloaded == () and step.staged == {} and not step.preempted


def test_a_decode_short_of_device_blocks_never_preempts_a_request_with_none_there():
    """32 device blocks: a and c decode with every layer, 4 blocks each, and both need a fifth; b,
    the latest, waits for all 4 of its layers. vLLM's order would take b first, which frees no device
    block (and throws its prefill away): c gives way instead."""
    spec = replace(RESTORE, device_blocks=32)
    engine = SimEngine(spec, COST, {"layer_offload": "layerkv"})
    a, c, b = SimRequest("a", 0.0, 16, 4), SimRequest("c", 0.1, 16, 4), SimRequest("b", 0.2, 14, 4)
    prefilled(engine, a, range(4), 0.5)
    prefilled(engine, c, range(4), 0.6)
    prefilled(engine, b, (), 0.7)
    assert engine.free == 0 and b.offloaded == (0, 1, 2, 3)
    step = engine.schedule(1.0)
    assert step.preempted == [("c", "recompute")] and (a, 1) in step.chunks and b in engine.running


def test_a_request_waiting_alone_under_the_ledger_gets_its_layers_back_and_finishes():
    """CacheOpt's ledger, 36 device blocks (9 a layer), a reservation of 2 a layer: a, alone, is
    allotted 32 tokens (8 blocks a layer) and keeps 1 of 4 layers. Prefilled (7 blocks a layer), its
    3 others back leave 9 - 7 = 2 a layer, its own promise 1: the reservation, kept from it, made it
    preempt itself, a whole prefill again for each token it sampled. Nobody else holds a place: the
    reservation goes too."""
    spec = replace(RESTORE, device_blocks=36, offload=replace(RESTORE.offload, threshold_blocks=20))
    engine = SimEngine(spec, COST, {"layer_offload": "layerkv", "kv_allocation": "cacheopt"}, SMALL)
    a = SimRequest("a", 0.0, 28, 4, tbt_slo_ms=1500.0, predicted_output_len=4, predicted_output_median=4)
    engine.add(a)
    now, preempted = 0.0, []
    for _ in range(20):
        step = engine.schedule(now)
        preempted += step.preempted
        if step.chunks:
            engine.complete(step, now + 0.5)
        now += 1.0
        if a.finished_at is not None:
            break
    assert a.finished_at is not None and preempted == [] and len(a.token_times) == 4
    assert engine.scheduler.layers_offloaded == {"admitted": 3, "forecast": 0, "restored": 3}
    assert engine.free == spec.device_blocks and engine.blocks.free("cxl") == spec.cxl_blocks
