"""CaR's prefetcher in the native engine and in the simulator (issue 31): the native Engine's own step
(services/engine/native/engine.py: schedule, the model, sample, commit, frames, the idle offload),
its model and clock stubbed, against SimEngine, on the same conversations at the same times. The
prefetcher's fetch(t) weighs when the soonest running request ends, TPOP x its length less the time
it has run: TPOP is read from the engine's recent step times, the time run from its clock, so both
must be the step as a whole, the work after its tokens are sampled included (commits, frames,
the idle offload). A simulated step lasts that whole time."""

from __future__ import annotations

import math

import torch

from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.libs.messages.engine import SamplingParams, Targets
from kvmesh.policies.iteration import Policies
from kvmesh.policies.iteration.reuse import Reuse, WindowParams
from kvmesh.services.engine.kv_blocks import BlockShape
from kvmesh.services.engine.native.block_manager import BlockManager
from kvmesh.services.engine.native.engine import Engine
from kvmesh.services.engine.native.kv_pool import KVPool
from kvmesh.services.engine.native.scheduler import Scheduler
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost

LAYERS, BLOCK, VOCAB = 2, 4, 8
SHAPE = BlockShape(block_size=BLOCK, num_kv_heads=1, head_dim=2, dtype=torch.float32)
CAR = {"prefill_admission": "car", "cache_policy": "car"}
WINDOW = WindowParams(size=2, max_wait_s=3.0)
# A step's model run, then the work after its sample; binary fractions, so both clocks add exactly.
MODEL_S, AFTER_SAMPLE_S = 0.5, 0.25
COPY_BYTES_PER_S = math.inf  # copies take no time: fetch(t) fires once the soonest running request is due
SPEC = EngineSpec(block_size=BLOCK, num_layers=LAYERS, device_blocks=2 * 14, max_num_seqs=4, token_budget=16,
                  cxl_blocks=2 * 32, block_bytes=SHAPE.bytes, swap_out_bytes_per_s=COPY_BYTES_PER_S,
                  swap_in_bytes_per_s=COPY_BYTES_PER_S, prefix_caching=True, cache_cxl=True, window=WINDOW)
SYSTEM = list(range(1, 9))
# (conversation, arrival, new tokens, output): three conversations of two turns on a device of 14
# blocks a layer; the second turns come while the others run, their first turns' nodes in the cxl tier.
TURNS = [(0, 0.0, 6, 10), (1, 0.0, 9, 10), (2, 0.0, 7, 10), (0, 9.0, 5, 10), (1, 9.5, 6, 10), (2, 10.0, 5, 10)]
# Each output predicted SHORT tokens short: fetch(t) then fires while the running turn still has
# SHORT steps to go, the lead a load time would give it (copies take no time here).
SHORT = 3


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StubRunner:
    """The model's run takes MODEL_S on the clock; every sampled token is 0 (all-zero logits, greedy)."""

    def __init__(self, clock: Clock):
        self.clock = clock

    def run(self, chunks, reloads=None, staging=([], []), after_layer=None) -> torch.Tensor:
        self.clock.now += MODEL_S
        return torch.zeros(sum(c.samples for c in chunks), VOCAB)


class StubTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def script() -> list[tuple[str, float, list[int], int]]:
    """(request id, arrival, prompt, output length): a turn's prompt is its conversation so far
    (the answers are all token 0) and its new tokens."""
    history, turns = {}, []
    for conversation, arrival, new, out in TURNS:
        prompt = history.get(conversation, SYSTEM) + [100 * (conversation + 1) + len(turns) + i for i in range(new)]
        turns.append((f"c{conversation}-{len(turns)}", arrival, prompt, out))
        history[conversation] = prompt + [0] * out
    return turns


def native_engine(clock: Clock, policies: dict[str, str] = CAR) -> Engine:
    hooks = Policies(policies)
    pools = {"device": KVPool("device", SPEC.device_blocks, SHAPE), "cxl": KVPool("cxl", SPEC.cxl_blocks, SHAPE)}
    blocks = BlockManager(pools, LAYERS, hooks, cache_cxl=True)
    blocks.layerwise_reload = True   # as the factory sets it with a cxl tier of nodes
    offload_idle = blocks.offload_idle

    def offload_idle_after_the_sample() -> int:  # the last of the step's work after its sample
        clock.now += AFTER_SAMPLE_S
        return offload_idle()

    blocks.offload_idle = offload_idle_after_the_sample
    scheduler = Scheduler(blocks, hooks, SPEC.max_num_seqs, SPEC.token_budget,
                          reuse=Reuse(blocks, WINDOW, COPY_BYTES_PER_S))
    return Engine(StubRunner(clock), blocks, scheduler, StubTokenizer(), (), clock=clock)


def run_native(policies: dict[str, str] = CAR) -> tuple[list, Engine]:
    """The engine stepped back to back (idle until the next arrival when it has no work)."""
    clock = Clock()
    engine = native_engine(clock, policies)
    pending = list(script())
    log = []
    while pending or engine.scheduler.has_work():
        if not engine.scheduler.has_work():
            clock.now = max(clock.now, pending[0][1])
        while pending and pending[0][1] <= clock.now:
            request_id, arrival, prompt, out = pending.pop(0)
            engine.add(request_id, prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
                       arrival=arrival, targets=Targets(predicted_output_len=out - SHORT))
        started = clock.now
        engine.step()
        log.append((started, engine.scheduler.reuse.prefetched))
    return log, engine


def run_sim(policies: dict[str, str] = CAR) -> tuple[list, SimEngine]:
    """The simulated engine over the same script: a step lasts the engine's whole step."""
    engine = SimEngine(SPEC, StepCost(a=MODEL_S + AFTER_SAMPLE_S, b=0.0, c=0.0), policies)
    pending = [SimRequest(request_id, arrival, len(prompt), out, block_names=tuple(node_ids(prompt + [0] * out, BLOCK)),
                          predicted_output_len=out - SHORT) for request_id, arrival, prompt, out in script()]
    now, log = 0.0, []
    while pending or engine.has_work():
        if not engine.has_work():
            now = max(now, pending[0].arrival)
        while pending and pending[0].arrival <= now:
            engine.add(pending.pop(0))
        started = now
        step = engine.schedule(now)
        if step.chunks:
            now += engine.seconds(step)
            engine.complete(step, now)
        log.append((started, engine.scheduler.reuse.prefetched))
    return log, engine


def test_the_engine_s_tpop_is_its_whole_step():
    """What fetch(t) reads as TPOP: each step from its start to the end of the work after its sample,
    the time a running request waits for its next token."""
    _, engine = run_native()
    assert set(engine.scheduler.iteration_s) == {MODEL_S + AFTER_SAMPLE_S}


def test_the_simulated_prefetcher_brings_back_what_the_engine_s_does_step_by_step():
    """Each step's start and the nodes prefetched by then, and where the turns found their prefixes."""
    native_log, native = run_native()
    sim_log, sim = run_sim()

    assert native.scheduler.reuse.prefetched > 0, "the script is meant to prefetch"
    assert sim_log == native_log
    found = {tier: n for tier, n in native.state().prefix_cache_hit_blocks.items() if n}
    # The turns left waiting (c1's, c2's) found in the device what the prefetcher brought back in the
    # room spare before their turn; c0's, admitted as it came, and what the spare room did not hold,
    # were reloaded at their turn.
    assert dict(sim.blocks.hit_blocks) == found == {"device": 20, "cxl": 4}
