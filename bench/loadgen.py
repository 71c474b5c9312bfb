"""An open-loop load generator for any OpenAI-compatible server (kvmesh's admission, vLLM, ...).

Requests arrive as a Poisson process (exponential gaps from a seeded RNG) and each is a streaming
`POST /v1/completions` with the prompt as token ids (or text), `max_tokens`, `temperature: 0` and an
extra body (default `{"ignore_eos": true}`, which kvmesh and vLLM honour, so every answer has its full
length). Per request, measured from its scheduled arrival (so time spent waiting for a connection
slot counts, as a server's queue would):
  - TTFT: until the first SSE chunk that carries a token (a choice that is not a bare finish marker);
  - TBT: the mean time between tokens, (last token chunk - first) / (completion tokens - 1), with the
    token count from the final usage chunk (`stream_options.include_usage`) or else the chunks seen;
  - end to end: until the stream ends (`data: [DONE]`);
  - `kvmesh`: the per-request breakdown kvmesh's admission adds to its last chunk, when present.
The run always stops: at most `concurrency` requests are open at once, arrivals after `time_limit_s`
are not sent, and requests still open at `time_limit_s` are cancelled and counted as failed.
Results are plain data; `summarize` and `breakdown` reduce them to the figures a benchmark reports.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import numpy as np
from rich.progress import Progress

from .report import percentile
from .workloads import WorkRequest

STAGES = ("prefill_queue", "prefill", "transfer", "decode_queue", "decode")  # KVDirect Fig. 14


@dataclass
class RequestResult:
    """One request's timings, in seconds after its arrival."""

    index: int
    prompt_tokens: int
    max_tokens: int
    arrival: float                        # seconds after the run began
    ttft: float | None = None
    e2e: float | None = None
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    text: str = ""                        # the answer, as the chunks carried it
    error: str | None = None
    status: int | None = None             # the HTTP status
    retry_after: str | None = None        # its Retry-After header, on a refusal
    kvmesh: dict[str, Any] | None = None  # the admission's breakdown, when the server is kvmesh

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def tbt(self) -> float | None:
        """Mean time between tokens; None with fewer than two tokens."""
        if len(self.token_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.completion_tokens - 1)


@dataclass
class LoadResult:
    rate: float        # offered requests per second
    wall_s: float      # from the first arrival to the last answer (or the time limit)
    results: list[RequestResult]
    unsent: int        # arrivals after the time limit


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Arrival times (s) of `n` requests at `rate` per second; the first at 0, the same for the same seed."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def api_base(url: str) -> str:
    """`http://host:port` from any of `http://host:port`, `.../`, `.../v1`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def served_model(url: str, api_key: str | None = None) -> str:
    """The first model `GET /v1/models` lists."""
    async with aiohttp.ClientSession(headers=_headers(api_key)) as session:
        async with session.get(api_base(url) + "/v1/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]


async def run_load(url: str, requests: list[WorkRequest], rate: float, *, model: str, api_key: str | None = None,
                   seed: int = 0, concurrency: int = 64, time_limit_s: float = 120.0,
                   extra_body: dict[str, Any] | None = None, progress: Progress | None = None,
                   label: str = "") -> LoadResult:
    """Send `requests` to `url` at `rate` per second (Poisson) and time every answer."""
    arrivals = poisson_arrivals(len(requests), rate, seed)
    extra = {"ignore_eos": True} if extra_body is None else extra_body
    endpoint = api_base(url) + "/v1/completions"
    results = [RequestResult(index=i, prompt_tokens=len(r.prompt_ids), max_tokens=r.max_tokens, arrival=float(t))
               for i, (r, t) in enumerate(zip(requests, arrivals))]
    task = progress.add_task(label, total=len(requests)) if progress is not None else None
    slots = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(headers=_headers(api_key), connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        began = time.perf_counter()

        async def one(request: WorkRequest, result: RequestResult) -> None:
            await asyncio.sleep(max(0.0, began + result.arrival - time.perf_counter()))
            body = {"model": model, "prompt": request.prompt_ids, "max_tokens": request.max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}
            try:
                async with slots:
                    await read_answer(session, endpoint, body, began + result.arrival, result)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
                result.error = f"{type(exc).__name__}: {exc}"
            if task is not None:
                progress.advance(task)

        sent = [asyncio.ensure_future(one(r, res)) for r, res in zip(requests, results) if res.arrival < time_limit_s]
        done, pending = await asyncio.wait(sent, timeout=time_limit_s) if sent else (set(), set())
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - began
    for result in results[: len(sent)]:
        if result.e2e is None and result.error is None:
            result.error = "cancelled at the time limit"
    return LoadResult(rate=rate, wall_s=wall, results=results[: len(sent)], unsent=len(requests) - len(sent))


async def read_answer(session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any], arrival: float,
                      result: RequestResult) -> None:
    """POST one request and read its SSE stream (or a whole JSON answer) into `result`."""
    async with session.post(endpoint, data=msgspec.json.encode(body),
                            headers={"Content-Type": "application/json"}) as response:
        result.status = response.status
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            result.retry_after = response.headers.get("Retry-After")
            return
        if response.content_type != "text/event-stream":
            _take(msgspec.json.decode(await response.read()), time.perf_counter() - arrival, result)
        else:
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                _take(msgspec.json.decode(data), time.perf_counter() - arrival, result)
                if result.error is not None:
                    return
    result.e2e = time.perf_counter() - arrival
    result.completion_tokens = result.completion_tokens or len(result.token_times)
    result.ttft = result.token_times[0] if result.token_times else None
    if result.ttft is None:
        result.error = "the answer carried no token"


def _take(chunk: dict[str, Any], at: float, result: RequestResult) -> None:
    """Fold one chunk (or whole answer) received `at` seconds after arrival into `result`."""
    if "error" in chunk:
        result.error = f"error in stream: {chunk['error']}"
        return
    for choice in chunk.get("choices") or ():
        if choice.get("text") or choice.get("finish_reason") is None:
            result.token_times.append(at)
        result.text += choice.get("text") or ""
    if chunk.get("usage"):
        result.completion_tokens = chunk["usage"].get("completion_tokens", 0)
    if chunk.get("kvmesh"):  # kvmesh sends null on every chunk but the last
        result.kvmesh = chunk["kvmesh"]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# -- reducing results -----------------------------------------------------------------------------


def summarize(load: LoadResult) -> dict[str, float]:
    """P50/P90 TTFT, TBT and end-to-end latency (ms) of the completed requests; the same over every
    request sent (`..._every_ms`: a failed or timed-out one misses any SLO, infinite, at the top of the
    distribution); mean end to end, and what was served."""
    done = [r for r in load.results if r.ok]
    failed = len(load.results) - len(done)
    ttft = [r.ttft * 1e3 for r in done]
    tbt = [r.tbt * 1e3 for r in done if r.tbt is not None]
    e2e = [r.e2e * 1e3 for r in done]
    figures = {"completed": float(len(done)), "failed": float(failed),
               "unsent": float(load.unsent), "offered_rps": load.rate,
               "served_rps": len(done) / load.wall_s if load.wall_s > 0 else 0.0}
    for name, values in (("ttft", ttft), ("tbt", tbt), ("e2e", e2e)):
        for q in (50, 90):
            figures[f"{name}_p{q}_ms"] = float(np.percentile(values, q)) if values else float("nan")
            figures[f"{name}_p{q}_every_ms"] = percentile(values + [math.inf] * failed, q)
    figures["e2e_mean_ms"] = float(np.mean(e2e)) if e2e else float("nan")
    return figures


def breakdown(load: LoadResult) -> dict[str, float] | None:
    """Mean milliseconds per stage (KVDirect Fig. 14) over the requests that carried kvmesh's
    `timings_ms`; None when none did (a server other than kvmesh)."""
    timings = [r.kvmesh["timings_ms"] for r in load.results if r.ok and r.kvmesh and "timings_ms" in r.kvmesh]
    if not timings:
        return None
    return {stage: float(np.mean([t.get(stage, 0.0) for t in timings])) for stage in STAGES}
