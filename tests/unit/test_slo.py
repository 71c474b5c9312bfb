"""SLO classes at the front door: a request's class from its body or header, the SLOs a class gives,
an unknown class a 400; and the metrics one answered request leaves, by class."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from kvmesh.libs.controlplane import ConfigError, load_config
from kvmesh.services.admission.app import Config
from kvmesh.services.admission.limits import BoundedQueue
from kvmesh.services.admission.openai_api import ChatCompletionRequest, CompletionRequest, KvmeshInfo, OpenAIError
from kvmesh.services.admission.slo import Slo, SloClass, SloMetrics, Timing, slo_defaults, slo_of

CLASSES = slo_defaults({"interactive": SloClass(ttft_ms=200, tbt_ms=50), "batch": SloClass(ttft_ms=30_000)},
                       ttft_ms=1_000, tbt_ms=100)


def body(**fields) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt="x", **fields)


def test_a_request_without_a_class_is_default_with_the_service_wide_slos():
    assert slo_of(body(), CIMultiDict(), CLASSES) == Slo(slo_class="default", ttft_ms=1_000, tbt_ms=100)


def test_the_class_named_in_the_body_gives_its_slos():
    assert slo_of(body(slo_class="interactive"), CIMultiDict(), CLASSES) == Slo("interactive", 200, 50)


def test_the_class_header_is_read_when_the_body_names_none():
    headers = CIMultiDict({"x-kvmesh-slo-class": "interactive"})
    assert slo_of(body(), headers, CLASSES).slo_class == "interactive"
    assert slo_of(body(slo_class="batch"), headers, CLASSES).slo_class == "batch"  # the body wins


def test_a_value_the_class_leaves_out_is_the_service_wide_default():
    assert slo_of(body(slo_class="batch"), CIMultiDict(), CLASSES) == Slo("batch", 30_000, 100)


def test_the_request_own_slos_beat_its_class():
    headers = CIMultiDict({"X-KVMesh-TBT-Ms": "75"})
    assert slo_of(body(slo_class="interactive", ttft_ms=500), headers, CLASSES) == Slo("interactive", 500, 75)


def test_the_config_may_redefine_the_default_class():
    classes = slo_defaults({"default": SloClass(ttft_ms=300)}, ttft_ms=None, tbt_ms=None)
    assert slo_of(body(), CIMultiDict(), classes) == Slo("default", 300, None)


@pytest.mark.parametrize("in_body, headers", [("gold", {}), (None, {"X-KVMesh-SLO-Class": "gold"}), ("", {})])
def test_an_unknown_class_is_a_400_that_lists_the_known_ones(in_body, headers):
    with pytest.raises(OpenAIError) as raised:
        slo_of(body(slo_class=in_body), CIMultiDict(headers), CLASSES)
    error = raised.value
    assert (error.status, error.param, error.type) == (400, "slo_class", "invalid_request_error")
    assert repr(in_body or headers.get("X-KVMesh-SLO-Class", "")) in error.message
    assert "batch, default, interactive" in error.message


def test_slo_classes_come_from_the_config_and_a_bad_one_is_refused_at_start():
    env = {"KVMESH_ADMISSION_SLO_CLASSES": '{"interactive": {"ttft_ms": 200, "tbt_ms": 50}}'}
    assert load_config(Config, "admission", env=env).slo_classes == {"interactive": SloClass(ttft_ms=200, tbt_ms=50)}
    for bad in ('{"x": {"ttft_ms": -1}}', '{"x": {"ttft": 5}}'):
        with pytest.raises(ConfigError):
            load_config(Config, "admission", env={"KVMESH_ADMISSION_SLO_CLASSES": bad})


def test_timing_gives_every_gap_and_the_end_to_end_latency():
    timing = Timing(arrived=10.0, token_times=[10.5, 10.5, 10.75, 11.5])
    assert timing.gaps_s == [0.0, 0.25, 0.75]
    assert (timing.ttft_s, timing.mean_tbt_s, timing.e2e_s) == (0.5, pytest.approx(1 / 3), 1.5)


def test_one_answered_request_is_counted_under_its_class():
    registry = CollectorRegistry()
    metrics = SloMetrics(registry, BoundedQueue(max_running=4, max_queued=4))
    served = KvmeshInfo(mode="disaggregated", transfer_mode="pull",
                        timings_ms={"prefill_queue": 4.0, "prefill": 20.0, "decode_queue": 2.0, "transfer": 1.0,
                                    "decode": 30.0})
    timing = Timing(arrived=0.0, token_times=[0.1, 0.15, 0.2, 0.3])
    metrics.record(Slo("interactive", ttft_ms=200, tbt_ms=50), timing, served, "length")

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"slo_class": "interactive", **labels})

    assert value("kvmesh_admission_finished_requests_total", finish_reason="length") == 1
    assert value("kvmesh_admission_tbt_seconds_count") == 3  # every gap
    assert value("kvmesh_admission_mean_tbt_seconds_count") == 1
    assert value("kvmesh_admission_e2e_seconds_sum") == pytest.approx(0.3)
    assert value("kvmesh_admission_queue_seconds_sum", queue="prefill") == pytest.approx(0.004)
    assert value("kvmesh_admission_queue_seconds_sum", queue="decode") == pytest.approx(0.002)
    assert value("kvmesh_admission_slo_requests_total", slo="ttft", met="true") == 1
    assert value("kvmesh_admission_slo_requests_total", slo="tbt", met="false") == 1  # mean gap 66.7 ms > 50


def test_a_colocated_request_has_no_decode_queue_and_an_unfinished_stream_is_incomplete():
    registry = CollectorRegistry()
    metrics = SloMetrics(registry, BoundedQueue(max_running=4, max_queued=4))
    served = KvmeshInfo(mode="colocated", timings_ms={"prefill_queue": 1.0, "decode_queue": 0.0})
    metrics.record(Slo("default", None, None), Timing(arrived=0.0, token_times=[0.1]), served, None)
    labels = {"slo_class": "default"}
    assert registry.get_sample_value("kvmesh_admission_finished_requests_total",
                                     {**labels, "finish_reason": "incomplete"}) == 1
    assert registry.get_sample_value("kvmesh_admission_queue_seconds_count", {**labels, "queue": "prefill"}) == 1
    assert registry.get_sample_value("kvmesh_admission_queue_seconds_count", {**labels, "queue": "decode"}) is None


async def test_the_queue_gauges_read_admission_queue_when_scraped():
    registry = CollectorRegistry()
    queue = BoundedQueue(max_running=1, max_queued=4)
    SloMetrics(registry, queue)
    running, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with queue.slot():
            running.set()
            await release.wait()

    tasks = [asyncio.create_task(hold()) for _ in range(3)]
    await running.wait()
    await asyncio.sleep(0)  # the other two reach the queue
    assert registry.get_sample_value("kvmesh_admission_inflight_requests") == 1
    assert registry.get_sample_value("kvmesh_admission_queued_requests") == 2
    release.set()
    await asyncio.gather(*tasks)
    assert registry.get_sample_value("kvmesh_admission_inflight_requests") == 0
    assert registry.get_sample_value("kvmesh_admission_queued_requests") == 0


def test_slo_class_is_a_field_of_both_request_bodies():
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "slo_class": "batch"}'
    assert msgspec.json.decode(raw, type=ChatCompletionRequest).slo_class == "batch"
    assert msgspec.json.decode(b'{"model": "m", "prompt": "p", "slo_class": "batch"}',
                               type=CompletionRequest).slo_class == "batch"
