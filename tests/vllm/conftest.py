"""vLLM instances for the vLLM backend's tests: real vLLM (its CPU build, from .venv-vllm), each in
its own process on its own core. Skipped, saying why, where that virtualenv could not be made."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.bench.vllm_process import VllmProcess, vllm_missing
from kvmesh.infra.local.processes import free_port


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    from kvmesh.services.engine.native.models import save_preset_checkpoint

    return save_preset_checkpoint("tiny", tmp_path_factory.mktemp("vllm-tiny"), seed=0)


SYNC_LOAD_TOKENS = 64


@pytest.fixture(scope="module")
def pair(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmProcess, VllmProcess]]:
    """A prefill (producer) and a decode (consumer) instance, one core each, started side by side, on the
    shm data plane: vLLM's KV cache is private memory, which the consumer reads by cross-memory attach
    (the engine service's tests run the tcp one). The consumer pulls prompts of up to SYNC_LOAD_TOKENS
    tokens inside the step that runs them, longer ones while other steps go on."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    cores = sorted(os.sched_getaffinity(0))
    producer = VllmProcess(vllm_model, "kv_producer", str(cores[0]), logs / "producer.log", data_port=free_port(),
                           lease_s=3.0, backend="shm")
    consumer = VllmProcess(vllm_model, "kv_consumer", str(cores[-1]), logs / "consumer.log", backend="shm",
                           sync_load_tokens=SYNC_LOAD_TOKENS)
    try:
        producer.ready()
        consumer.ready()
        yield producer, consumer
    finally:
        producer.stop()
        consumer.stop()
