"""One client request is one trace across admission, the scheduler, kvmeta and the prefill and decode
engines, read back from the span file every service appends to; the abort path is marked, and logs
in JSON carry the trace and request ids. Real processes on loopback."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from ..conftest import cluster_name
from .admission_fixtures import MODEL, start_cluster, wait_until_idle

KEY = "sk-trace-test"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest):
    run_dir = tmp_path_factory.mktemp("traced")
    spans_file = run_dir / "spans.jsonl"
    with ExitStack() as exits:
        cluster = start_cluster(exits, run_dir, redis_url, cluster_name(request), {"engine-p0": "prefill", "engine-d0": "decode"},
                                every_env={"KVMESH_TRACE_FILE": str(spans_file), "KVMESH_TRACE_SAMPLE": "1.0",
                                           "KVMESH_LOG_FORMAT": "json"},
                                KVMESH_API_KEY=KEY)
        yield cluster, spans_file, run_dir


@pytest.fixture(autouse=True)
async def engines_end_idle(traced):
    yield
    cluster = traced[0]
    for engine in cluster.engines.values():
        state = await wait_until_idle(engine.url)
        assert state["free_blocks"] == state["total_blocks"], f"{engine.name} leaked blocks: {state}"


def read_traces(path: Path) -> dict[str, list[dict]]:
    traces: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines() if path.exists() else []:
        span = json.loads(line)
        traces[span["trace_id"]].append(span)
    return traces


async def trace_of(path: Path, request_id: str, wanted: set[str], timeout: float = 15.0) -> list[dict]:
    """The spans of the trace whose admission span has `request_id`, once every name in `wanted` is there."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        for spans in read_traces(path).values():
            if any(s["name"] == "admission" and s["attributes"].get("kvmesh.request_id") == request_id for s in spans):
                if wanted <= {s["name"] for s in spans} or asyncio.get_running_loop().time() > deadline:
                    return spans
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no trace for {request_id} in {path}")
        await asyncio.sleep(0.2)


def one(spans: list[dict], name: str, service: str | None = None) -> dict:
    found = [s for s in spans if s["name"] == name and (service is None or s["service"] == service)]
    assert len(found) == 1, f"{len(found)} spans {name!r} ({service}): {[(s['name'], s['service']) for s in spans]}"
    return found[0]


PHASES = {"admission", "route", "POST /v1/route", "prefill", "decode", "POST /v1/prefill", "POST /v1/decode",
          "prefill.queue", "prefill.compute", "decode.queue", "kv.transfer", "decode.compute"}


async def test_a_request_is_one_trace_across_every_service(traced):
    cluster, spans_file, _ = traced
    async with openai.AsyncOpenAI(base_url=cluster.admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        reply = await client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=6)
    spans = await trace_of(spans_file, reply.id, PHASES | {"kvmeta"})
    # exactly this request's trace in the file: background calls (heartbeats, watches) start none
    assert [trace for trace in read_traces(spans_file).values()
            if any(s["name"] == "admission" and s["attributes"]["kvmesh.request_id"] == reply.id for s in trace)] == [spans]
    by_id = {s["span_id"]: s for s in spans}
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["name"] == "admission" and root["service"] == "admission" and root["kind"] == "SERVER"
    assert all(s["parent_id"] in by_id for s in spans if s is not root), "a span's parent is missing from the trace"
    assert {s["service"] for s in spans} == {"admission", "scheduler", "engine-p0", "engine-d0", "kvmeta"}

    parent = lambda span: by_id[span["parent_id"]]  # noqa: E731
    route, prefill, decode = one(spans, "route"), one(spans, "prefill"), one(spans, "decode")
    assert parent(route) is parent(prefill) is parent(decode) is root
    assert parent(one(spans, "POST /v1/route", "scheduler")) is route
    prefill_server, decode_server = one(spans, "POST /v1/prefill", "engine-p0"), one(spans, "POST /v1/decode", "engine-d0")
    assert parent(prefill_server) is prefill and parent(decode_server) is decode
    for name in ("prefill.queue", "prefill.compute"):
        assert parent(one(spans, name, "engine-p0")) is prefill_server
    for name in ("decode.queue", "kv.transfer", "decode.compute"):
        assert parent(one(spans, name, "engine-d0")) is decode_server
    kvmeta_calls = [s for s in spans if s["service"] == "kvmeta"]
    assert kvmeta_calls and all(parent(s) is prefill_server for s in kvmeta_calls)  # the held KV's lease and release

    transfer = one(spans, "kv.transfer")["attributes"]
    assert transfer["kvmesh.bytes"] > 0 and 0 < transfer["kvmesh.reads_posted"] <= transfer["kvmesh.pieces"]
    assert transfer["kvmesh.backend"] == "tcp" and transfer["kvmesh.gbps"] > 0
    facts = root["attributes"]
    # each hop's count of the 6 tokens, so that a token lost on the way says where
    made = {name: one(spans, name)["attributes"]["kvmesh.completion_tokens"]
            for name in ("prefill.compute", "decode.compute")}
    counts = {"engines": made, "relayed": facts["kvmesh.completion_tokens"], "answered": reply.usage.completion_tokens,
              "finish": (facts["kvmesh.finish_reason"], reply.choices[0].finish_reason)}
    assert made == {"prefill.compute": 1, "decode.compute": 5} and counts["relayed"] == counts["answered"] == 6, counts
    assert facts["kvmesh.finish_reason"] == "length"
    assert facts["kvmesh.transfer_mode"] == "pull" and facts["kvmesh.prefill_engine"] == "engine-p0"
    assert len(facts["kvmesh.tbt_ms"]) == 5 and 0 < facts["kvmesh.ttft_ms"] <= facts["kvmesh.e2e_ms"]
    assert all(s["status"] != "ERROR" for s in spans)


async def test_a_client_going_away_is_marked_on_its_trace_and_in_the_logs(traced):
    cluster, spans_file, run_dir = traced
    async with openai.AsyncOpenAI(base_url=cluster.admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        stream = await client.completions.create(model=MODEL, prompt="a long story", max_tokens=400, stream=True,
                                                 extra_body={"ignore_eos": True})
        request_id = (await anext(aiter(stream))).id
        await stream.close()  # the client goes away mid-stream
    spans = await trace_of(spans_file, request_id, {"admission", "decode"})
    root = one(spans, "admission")
    assert root["status"] == "ERROR" and "abort" in [e["name"] for e in root["events"]]
    log_lines = [json.loads(line) for line in (run_dir / "logs" / "admission.log").read_text().splitlines()
                 if line.startswith("{")]
    aborted = [line for line in log_lines if line.get("request_id") == request_id]
    assert aborted and aborted[-1]["trace_id"] == root["trace_id"]
