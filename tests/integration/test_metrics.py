"""Every service's `/metrics` after a known workload on a real disaggregated cluster (redis-server,
kvmeta, a prefill and a decode engine, the scheduler and admission, each its own process): the
counters exactly, the histograms filled, and at the end every engine's KV blocks free again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import cluster_name
from .admission_fixtures import MODEL, Cluster, idle, start_cluster, wait_until_idle

KEY = "sk-metrics"
SLO_CLASSES = {"interactive": {"ttft_ms": 60_000, "tbt_ms": 60_000}}
BLOCK_SIZE = 16  # the engines' default


def prompt(seed: int, length: int = 40) -> list[int]:
    return [5 + (seed * 7 + j) % 400 for j in range(length)]


@dataclass(frozen=True)
class Sent:
    """One request of the workload, and what the answer said."""

    prompt: list[int]
    max_tokens: int
    slo_class: str
    cached_tokens: int = 0


class Scrape:
    """One service's /metrics, parsed by prometheus' own parser."""

    def __init__(self, text: str):
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def value(self, name: str, **labels: str) -> float:
        """The sum over every sample of `name` whose labels include `labels` (0 if none)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def labels(self, name: str, label: str) -> set[str]:
        return {s.labels[label] for s in self.samples if s.name == name}


@dataclass
class Run:
    cluster: Cluster
    sent: list[Sent]
    metrics: dict[str, Scrape]  # by service, engines by id


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_url: str,
            request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with ExitStack() as exits:
        yield start_cluster(exits, tmp_path_factory.mktemp("metrics"), redis_url, cluster_name(request),
                            {"engine-p0": "prefill", "engine-d0": "decode"}, KVMESH_API_KEY=KEY,
                            KVMESH_ADMISSION_SLO_CLASSES=json.dumps(SLO_CLASSES))


async def workload(client: openai.AsyncOpenAI) -> list[Sent]:
    """Three answered requests, one after the other (the third repeats the first one's prompt, so the
    prefill engine finds it cached; the second is `interactive` and streamed), and one 400."""
    sent = []
    for ids, max_tokens, slo_class, stream in ((prompt(1), 4, None, False), (prompt(2), 6, "interactive", True),
                                               (prompt(1), 5, None, False)):
        extra = {"ignore_eos": True, **({"slo_class": slo_class} if slo_class else {})}
        if stream:
            chunks = [c async for c in await client.completions.create(
                model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra)]
            usage = chunks[-1].usage
        else:
            usage = (await client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                     extra_body=extra)).usage
        assert usage.completion_tokens == max_tokens
        sent.append(Sent(ids, max_tokens, slo_class or "default", usage.prompt_tokens_details.cached_tokens))
    with pytest.raises(openai.BadRequestError, match="unknown slo_class 'gold'"):
        await client.completions.create(model=MODEL, prompt=prompt(3), max_tokens=2,
                                        extra_headers={"X-KVMesh-SLO-Class": "gold"})
    return sent


async def scrape(url: str) -> Scrape:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as response:
            assert response.status == 200
            return Scrape(await response.text())


@pytest.fixture(scope="module")
def run(cluster: Cluster) -> Run:
    """The workload, run once for the module, and every service's metrics after it."""
    return asyncio.run(run_workload(cluster))


async def run_workload(cluster: Cluster) -> Run:
    async with openai.AsyncOpenAI(base_url=cluster.admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        sent = await workload(client)
    for engine in cluster.engines.values():  # the engines' counters are final once they are idle
        assert idle(await wait_until_idle(engine.url))
    services = {"admission": cluster.admission.url, "scheduler": cluster.scheduler.url,
                **{engine_id: child.url for engine_id, child in cluster.engines.items()}}
    return Run(cluster, sent, {name: await scrape(url) for name, url in services.items()})


def by_class(sent: list[Sent]) -> dict[str, list[Sent]]:
    classes: dict[str, list[Sent]] = {}
    for s in sent:
        classes.setdefault(s.slo_class, []).append(s)
    return classes


def test_admission_counts_every_request_by_outcome_class_and_status(run: Run):
    admission = run.metrics["admission"]
    assert admission.value("kvmesh_http_requests_total", route="/v1/completions", status="200") == 3
    assert admission.value("kvmesh_http_requests_total", route="/v1/completions", status="400") == 1
    assert admission.value("kvmesh_admission_finished_requests_total") == 3  # a 400 is not an answered request
    for slo_class, requests in by_class(run.sent).items():
        assert admission.value("kvmesh_admission_finished_requests_total", slo_class=slo_class,
                               finish_reason="length") == len(requests)
        for histogram in ("ttft", "mean_tbt", "e2e"):
            assert admission.value(f"kvmesh_admission_{histogram}_seconds_count", slo_class=slo_class) == len(requests)
        gaps = sum(s.max_tokens - 1 for s in requests)
        assert admission.value("kvmesh_admission_tbt_seconds_count", slo_class=slo_class) == gaps
        assert admission.value("kvmesh_admission_tbt_seconds_bucket", slo_class=slo_class, le="+Inf") == gaps
        for queue in ("prefill", "decode"):
            assert admission.value("kvmesh_admission_queue_seconds_count", slo_class=slo_class,
                                   queue=queue) == len(requests)
    e2e, ttft = (admission.value(f"kvmesh_admission_{name}_seconds_sum") for name in ("e2e", "ttft"))
    assert e2e > ttft > 0


def test_admission_counts_slo_attainment_by_class_and_its_queue_is_empty(run: Run):
    admission = run.metrics["admission"]
    for slo in ("ttft", "tbt"):  # a minute each: met
        assert admission.value("kvmesh_admission_slo_requests_total", slo_class="interactive", slo=slo,
                               met="true") == 1
    assert admission.labels("kvmesh_admission_slo_requests_total", "slo_class") == {"interactive"}  # default: none
    assert admission.value("kvmesh_admission_inflight_requests") == 0
    assert admission.value("kvmesh_admission_queued_requests") == 0


def test_the_scheduler_counts_routes_and_knows_both_engines(run: Run):
    scheduler = run.metrics["scheduler"]
    assert scheduler.value("kvmesh_scheduler_routes_total", mode="disaggregated") == 3
    assert scheduler.value("kvmesh_scheduler_engines", role="prefill") == 1
    assert scheduler.value("kvmesh_scheduler_engines", role="decode") == 1
    assert scheduler.value("kvmesh_scheduler_engines", role="both") == 0


def test_the_prefill_engine_counts_tokens_and_prefix_cache_hits(run: Run):
    prefill = run.metrics["engine-p0"]
    assert prefill.value("kvmesh_http_requests_total", route="/v1/prefill", status="200") == 3
    assert prefill.value("kvmesh_engine_generated_tokens_total") == 3  # the first token of each
    cached = sum(s.cached_tokens for s in run.sent)
    assert cached == 2 * BLOCK_SIZE  # the repeated prompt's two full blocks
    assert prefill.value("kvmesh_engine_prompt_tokens_total", source="cached") == cached
    prompts = sum(len(s.prompt) for s in run.sent)
    assert prefill.value("kvmesh_engine_prompt_tokens_total", source="computed") == prompts - cached
    assert prefill.value("kvmesh_engine_prefix_cache_lookup_blocks_total", tier="device") == sum(
        len(s.prompt) // BLOCK_SIZE for s in run.sent)
    assert prefill.value("kvmesh_engine_prefix_cache_hit_blocks_total", tier="device") == 2
    assert prefill.value("kvmesh_engine_kv_transfer_seconds_count") == 0  # it is pulled from, never pulls


def test_the_decode_engine_counts_tokens_and_the_kv_it_pulled(run: Run):
    decode = run.metrics["engine-d0"]
    assert decode.value("kvmesh_http_requests_total", route="/v1/decode", status="200") == 3
    assert decode.value("kvmesh_engine_generated_tokens_total") == sum(s.max_tokens - 1 for s in run.sent)
    assert decode.value("kvmesh_engine_prompt_tokens_total", source="computed") == 3  # each first token's KV
    assert decode.value("kvmesh_engine_kv_transfer_seconds_count") == 3
    assert decode.value("kvmesh_engine_kv_transfer_seconds_sum") > 0
    assert decode.value("kvmesh_engine_kv_transfer_bytes_total") > 0
    asked = decode.value("kvmesh_engine_kv_transfer_reads_asked_total")
    assert 0 < decode.value("kvmesh_engine_kv_transfer_reads_posted_total") <= asked


async def test_every_engine_ends_idle_with_all_its_blocks_free(run: Run):
    for engine_id in run.cluster.engines:
        engine = run.metrics[engine_id]
        assert engine.value("kvmesh_engine_queue_requests") == 0
        assert engine.value("kvmesh_engine_preemptions_total") == 0
        tiers = engine.labels("kvmesh_engine_kv_total_blocks", "tier")
        assert tiers == {"device", "cxl"}
        for tier in tiers:
            total = engine.value("kvmesh_engine_kv_total_blocks", tier=tier)
            assert total > 0 and engine.value("kvmesh_engine_kv_free_blocks", tier=tier) == total
        assert idle(await wait_until_idle(run.cluster.engines[engine_id].url))
