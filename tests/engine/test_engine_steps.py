"""`GET /v1/steps`: the engine service records each step's shape, as policies.step_shape counts it,
and the wall time of its loop's turn, in a bounded ring; the vLLM backend says it records none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.infra.local.processes import Child
from kvmesh.libs.controlplane import BadRequest, ServiceClient
from kvmesh.libs.messages.engine import Frame
from kvmesh.services.engine.backend import EngineBackend
from kvmesh.services.engine.steps import EngineSteps, StepLog

from ..conftest import TOKEN
from .test_engine_http import start_engine

PROMPT = list(range(10, 47))  # 37 tokens


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    child = start_engine(tmp_path_factory.mktemp("engine"), tiny_checkpoint, KVMESH_ENGINE_PREFIX_CACHING="false")
    yield child
    child.stop()


async def test_a_request_s_steps_are_its_prefill_then_one_decode_a_token(engine: Child):
    async with ServiceClient(engine.url, token=TOKEN) as client:
        before = await client.call("GET", "/v1/steps", into=EngineSteps)
        since = before.steps[-1].index if before.steps else 0
        body = {"prompt_token_ids": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        frames = [f async for f in client.frames("/v1/generate", body, Frame)]
        after = await client.call("GET", f"/v1/steps?since={since}", into=EngineSteps)
    n = len(PROMPT)
    assert sum(len(f.token_ids) for f in frames) == 4
    assert [(s.prefill_tokens, s.decode_tokens, s.decode_context, s.prefill_context, s.prefill_sequences)
            for s in after.steps] == [(n, 0, 0, n * (n + 1) // 2, 1), (0, 1, n + 1, 0, 0), (0, 1, n + 2, 0, 0),
                                      (0, 1, n + 3, 0, 0)]
    assert [s.index for s in after.steps] == list(range(since + 1, since + 5))
    assert all(s.seconds > 0 for s in after.steps)
    assert after.steps[0].end <= after.steps[-1].end <= frames[-1].timings.finished + 1.0
    assert after.recorded == len(before.steps) + 4 and after.capacity > 0


def test_the_ring_keeps_the_latest_steps():
    log = StepLog(capacity=3)
    for index in range(1, 6):
        log.record(index, float(index), 0.001, (index, 0, 0, index, 1))
    assert [s.index for s in log.read().steps] == [3, 4, 5]
    assert [s.index for s in log.read(since=4).steps] == [5]
    assert log.read().recorded == 5 and log.read().capacity == 3


def test_an_unbounded_log_keeps_every_step_and_says_so():
    """An in-process bench keeps its whole run's steps (capacity None), and its read says None."""
    log = StepLog(capacity=None)
    for index in range(1, 20_001):
        log.record(index, float(index), 0.001, (0, 1, index, 0, 0))
    steps = log.read()
    assert len(steps.steps) == steps.recorded == 20_000 and steps.capacity is None


def test_a_backend_without_step_records_says_so():
    class Bare(EngineBackend):
        name = "vllm"
        start = __aexit__ = state = add = abort_soon = abort = abort_all = set_policies = None

    with pytest.raises(BadRequest, match="vllm backend does not record its steps"):
        Bare().steps(0)
