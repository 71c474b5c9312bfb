"""`kvmesh bench chaos`: a steady load through the front door while each component of a local 1P1D
cluster is killed in turn (issue 29), with every answer checked.

One `kvmesh up` (its supervisor restarts what dies); the full run's Redis is a Sentinel group of
its own (a master, a replica, three Sentinels: what docs/deploy.md deploys), which kvmeta follows. First a reference: each prompt of a small pool
answered greedily, one at a time, on the healthy cluster. Then the capacity: the pool sent twice at
once, answers per second. Then a Poisson load at half that capacity, half the requests streamed and
half answered whole, each with a deadline. While it runs, after a warm-up, one fault at a time: kill -9
of the Redis master (the Sentinels promote the replica; `--quick`: kvmesh up's own redis, which the
supervisor restarts), kvmeta, the predictor, the scheduler, the prefill engine, the decode engine and
admission (each waited on until it is ready again, then a settling pause), and a cut of the
decode engine's data-plane connections to the prefill engine, again and again for 3 s (`ss -K`,
while pulls run, so that pulls are cut mid-read). After the
last fault the load goes on for a while, then drains. Then the overload: ten times the capacity for
`overload_s` (60 s), every service's RSS sampled, then the fault phase's rate again; and the cluster
is inspected.

Per fault: the requests in flight at the kill and those sent before the next fault; of the requests
that ended before the next fault (each belongs to the last fault it ran into), the failures, split
into those in flight at the kill and those sent after it, the hung ones (past their deadline) and the
answers that differ from the reference; and the time from the kill to the first success of a request
sent after it. At the end: blocks held on each engine (free against total) and kvmeta's registry
against the live engines. Keys and targets are issue 29's: 0 hung, 0 wrong, 0 leaked blocks, 0 ghost
or missing workers, 0 failures outside the requests in flight; recovery within 5 s for a stateless
service and 15 s for an engine. Overload: every refusal a 429 with Retry-After, no other failure, each
service's peak RSS within 2x its RSS before (the bound this bench states), the answered streamed
requests' P90 TTFT within their SLO, and latency back within 1.5x the P90 before the faults within
5 s of its end. Every request names a TTFT SLO of 5 s (`ttft_ms`), which admission refuses past (a
429) when it expects a request to wait longer for those ahead of it.

The engines run in float32 with dense weights, so a request's greedy answer does not depend on what it
is batched with (bf16 kernels and the 4-bit path pick their code by row count, and a near-tie could
flip a token without anything being wrong). `--quick`: the `tiny` preset, four faults (kvmesh up's
redis, scheduler, decode engine, data-plane cut), shorter pauses, 4 s of overload.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import matplotlib
import msgspec
import numpy as np
import uvloop
from rich.progress import Progress

from kvmesh.infra.local.processes import SentinelGroup, redis_address, sentinel_group
from kvmesh.infra.local.state import read_state
from kvmesh.infra.local.status import status
from kvmesh.libs.kvmeta.messages import WorkerList
from kvmesh.services.engine.model_source import DEFAULT_MODEL

from .loadgen import RequestResult, api_base, poisson_arrivals, read_answer, served_model
from .report import BenchResult, Row, save_figure
from .serve import LocalCluster, Setup

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SEED = 29
DATA_PLANE = "data plane"
CUT_WINDOW_S = 3.0  # the data-plane fault cuts every connection to the prefill engine's data port this long
REDIS_FAILOVER = "redis master, Sentinel failover"
ENGINES = ("engine-p0", "engine-d0")
STATELESS = ("kvmeta", "predictor", "scheduler", "admission")
TIMELINE_PLOT = Path("bench-results/chaos_timeline.png")
RECOVERY_TARGETS = {"stateless": 5.0, "engine": 15.0}
OVERLOAD_FACTOR = 10.0
RSS_GROWTH_BOUND = 2.0  # a service's peak RSS under overload against its RSS before: the bound this bench holds to
NORMAL_LATENCY = 1.5    # back to normal: every later request within this much of the P90 latency before the faults
TTFT_SLO_S = 5.0        # every request's TTFT SLO: under overload admission refuses what would wait past it


@dataclass(frozen=True)
class Plan:
    model: str
    faults: tuple[str, ...]
    prompts: int          # distinct prompts, each answered once for the reference
    max_tokens: int
    warm_s: float         # load before the first fault
    settle_s: float       # after a component is ready again, before the next fault
    tail_s: float         # load after the last fault
    deadline_s: float     # a request still open this long after it was sent has hung
    restart_timeout_s: float
    overload_s: float     # ten times the capacity, this long
    after_s: float        # then the fault phase's rate again, this long
    sentinels: bool       # Redis is a Sentinel group of the bench's own, not kvmesh up's one redis


FULL = Plan(model=DEFAULT_MODEL, faults=(REDIS_FAILOVER, "kvmeta", "predictor", "scheduler", "engine-p0",
                                         "engine-d0", "admission", DATA_PLANE),
            prompts=16, max_tokens=16, warm_s=10, settle_s=6, tail_s=10, deadline_s=60, restart_timeout_s=180,
            overload_s=60, after_s=60, sentinels=True)
QUICK = Plan(model="tiny", faults=("redis", "scheduler", "engine-d0", DATA_PLANE), prompts=8, max_tokens=12,
             warm_s=4, settle_s=3, tail_s=4, deadline_s=30, restart_timeout_s=90, overload_s=4, after_s=8,
             sentinels=False)


@dataclass
class Sent:
    """One request of the load: what was asked, and what came back."""

    prompt: int
    stream: bool
    result: RequestResult
    ended: float | None = None     # seconds after the load began

    @property
    def sent(self) -> float:
        return self.result.arrival

    @property
    def hung(self) -> bool:
        return self.result.error == "hung"


@dataclass
class Fault:
    target: str
    at: float                          # the kill, seconds after the load began
    ready_at: float | None = None      # the supervisor had it ready again (None: not within the timeout)
    note: str = ""


@dataclass
class Overload:
    """The overload phase: what was sent, what came back, and every service's memory."""

    rate: float
    rss_before: dict[str, float]
    rss_peak: dict[str, float] = field(default_factory=dict)
    requests: list[Sent] = field(default_factory=list)   # at `rate`
    after: list[Sent] = field(default_factory=list)      # at the fault phase's rate, from `ended`
    ended: float = 0.0                                   # the last overload arrival, seconds into the load


@dataclass
class Inspection:
    """The cluster after the load drained."""

    held_blocks: dict[str, int] = field(default_factory=dict)     # per engine: total - free
    ghosts: list[str] = field(default_factory=list)               # registered, but no such live engine
    missing: list[str] = field(default_factory=list)              # live engines kvmeta does not list


def run(quick: bool) -> BenchResult:
    plan = QUICK if quick else FULL
    env = {"KVMESH_ENGINE_MODEL": plan.model, "KVMESH_ENGINE_DTYPE": "float32", "KVMESH_ENGINE_QUANTIZED_WEIGHTS": "off"}
    with (asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, Progress(transient=True) as progress,
          tempfile.TemporaryDirectory(prefix="kvmesh-bench-chaos-") as tmp, contextlib.ExitStack() as stack):
        starting = progress.add_task("starting the 1P1D cluster", total=None)
        up_args: tuple[str, ...] = ("--prefill", "1", "--decode", "1")
        group = None
        if plan.sentinels:
            group = sentinel_group(Path(tmp) / "redis", "kvmesh-chaos")
            stack.callback(group.stop)
            up_args += ("--redis-url", group.master.url)
            env |= {"KVMESH_KVMETA_REDIS_SENTINELS": json.dumps(group.sentinels),
                    "KVMESH_KVMETA_REDIS_MASTER": group.name}
        with LocalCluster(Setup("chaos", "1P1D", up_args, env), Path(tmp) / "cluster") as cluster:
            progress.remove_task(starting)
            chaos = Chaos(plan, cluster, progress, group)
            runner.run(chaos.prepare())
            runner.run(chaos.load_with_faults())
            overload = runner.run(chaos.overload())
            inspection = runner.run(chaos.inspect())
    return _result(plan, quick, chaos, overload, inspection)


class Chaos:
    def __init__(self, plan: Plan, cluster: LocalCluster, progress: Progress, redis: SentinelGroup | None = None):
        self.plan, self.cluster, self.progress, self.redis = plan, cluster, progress, redis
        self.prompts = [f"Question {i}: what comes after the number {7 * i + 3}? Answer in one sentence."
                        for i in range(plan.prompts)]
        self.reference: list[str] = []
        self.capacity = 0.0
        self.rate = 0.0
        self.requests: list[Sent] = []
        self.faults: list[Fault] = []
        self.model = ""
        self._began = 0.0

    async def prepare(self) -> None:
        """The reference answers, one request at a time, and the capacity, the pool sent twice at once."""
        self.model = await served_model(self.cluster.url, self.cluster.api_key)
        task = self.progress.add_task("reference answers", total=len(self.prompts))
        async with self._session() as session:
            for i in range(len(self.prompts)):
                result = RequestResult(index=i, prompt_tokens=0, max_tokens=self.plan.max_tokens, arrival=0.0)
                await read_answer(session, self._endpoint, self._body(i, stream=False), time.perf_counter(), result)
                if not result.ok:
                    raise RuntimeError(f"the healthy cluster failed the reference request {i}: {result.error}")
                self.reference.append(result.text)
                self.progress.advance(task)
            self.progress.remove_task(task)
            burst = [RequestResult(index=i, prompt_tokens=0, max_tokens=self.plan.max_tokens, arrival=0.0)
                     for i in range(2 * len(self.prompts))]
            began = time.perf_counter()
            await asyncio.gather(*(read_answer(session, self._endpoint, self._body(i % len(self.prompts), i % 2 == 0),
                                               began, r) for i, r in enumerate(burst)))
            self.capacity = sum(r.ok for r in burst) / (time.perf_counter() - began)
        self.rate = self.capacity / 2

    async def load_with_faults(self) -> None:
        """The Poisson load at half the capacity, the faults injected one by one while it runs."""
        task = self.progress.add_task(f"load at {self.rate:.2f} req/s, faults: {', '.join(self.plan.faults)}",
                                      total=len(self.plan.faults))
        async with self._session() as session:
            self._began = time.perf_counter()
            async with self._loaded(session, self.rate, SEED, self.requests):
                await asyncio.sleep(self.plan.warm_s)
                for target in self.plan.faults:
                    self.faults.append(await self._inject(target))
                    self.progress.advance(task)
                    await asyncio.sleep(self.plan.settle_s)
                await asyncio.sleep(self.plan.tail_s)
        self.progress.remove_task(task)

    async def overload(self) -> Overload:
        """Ten times the capacity for `overload_s`, every service's RSS sampled, then the fault phase's
        rate again for `after_s`, to see when latency is back to what it was before the faults."""
        rate = OVERLOAD_FACTOR * self.capacity
        task = self.progress.add_task(f"overload at {rate:.1f} req/s for {self.plan.overload_s:g} s, then "
                                      f"{self.rate:.2f} req/s", total=None)
        result = Overload(rate=rate, rss_before=self._rss())
        sampling = asyncio.ensure_future(self._sample_rss(result.rss_peak))
        async with self._session() as session:
            async with self._loaded(session, rate, SEED + 1, result.requests) as stop:
                await asyncio.sleep(self.plan.overload_s)
                stop()
                result.ended = time.perf_counter() - self._began
                async with self._loaded(session, self.rate, SEED + 2, result.after):
                    await asyncio.sleep(self.plan.after_s)
        sampling.cancel()
        self.progress.remove_task(task)
        return result

    @contextlib.asynccontextmanager
    async def _loaded(self, session: aiohttp.ClientSession, rate: float, seed: int,
                      into: list[Sent]) -> AsyncIterator[Callable[[], None]]:
        """Poisson arrivals at `rate`, appended to `into`, from now until the block ends or calls the
        `stop` it is given; then every request sent is waited for."""
        stop, open_requests = asyncio.Event(), set()
        rng, start = np.random.default_rng(seed), time.perf_counter() - self._began

        async def send() -> None:
            for at in poisson_arrivals(1_000_000, rate, seed) + start:
                await asyncio.sleep(max(0.0, self._began + at - time.perf_counter()))
                if stop.is_set():
                    return
                sent = Sent(prompt=int(rng.integers(len(self.prompts))), stream=bool(rng.integers(2)),
                            result=RequestResult(index=len(into), prompt_tokens=0, max_tokens=self.plan.max_tokens,
                                                 arrival=float(at)))
                into.append(sent)
                request = asyncio.ensure_future(self._ask(session, sent))
                open_requests.add(request)
                request.add_done_callback(open_requests.discard)

        sender = asyncio.ensure_future(send())
        try:
            yield stop.set
        finally:
            stop.set()
            await sender
            if open_requests:
                await asyncio.wait(set(open_requests))

    def _rss(self) -> dict[str, float]:
        """Each service's resident memory now, MiB."""
        rss = {}
        for child in read_state(self.cluster.run_dir).children:
            try:
                status_lines = Path(f"/proc/{child.pid}/status").read_text().splitlines()
            except OSError:
                continue
            kib = next(int(line.split()[1]) for line in status_lines if line.startswith("VmRSS:"))
            rss[child.name] = kib / 1024
        return rss

    async def _sample_rss(self, peak: dict[str, float]) -> None:
        while True:
            for name, mib in self._rss().items():
                peak[name] = max(peak.get(name, 0.0), mib)
            await asyncio.sleep(0.5)

    async def inspect(self) -> Inspection:
        """Blocks held on each engine once idle (given a few seconds), and kvmeta's registry against them."""
        inspection = Inspection()
        children = {c.name: c for c in (await asyncio.to_thread(status, self.cluster.run_dir)).children}
        token = self._token()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}",
                                                  "Accept": "application/json"}) as session:
            for engine in ENGINES:
                for _ in range(20):
                    async with session.get(children[engine].url + "/v1/state") as response:
                        state = await response.json(content_type=None)
                    held = sum(state["total_blocks"].values()) - sum(state["free_blocks"].values())
                    if held == 0:
                        break
                    await asyncio.sleep(0.5)
                inspection.held_blocks[engine] = held
        workers = await self._workers()
        registered = {w.info.id: w.info.control_url for w in workers}
        live = {name: children[name].url for name in ENGINES if children[name].ready}
        inspection.ghosts = sorted(w for w, url in registered.items() if live.get(w) != url)
        inspection.missing = sorted(set(live) - set(registered))
        return inspection

    async def _ask(self, session: aiohttp.ClientSession, sent: Sent) -> None:
        try:
            await asyncio.wait_for(read_answer(session, self._endpoint, self._body(sent.prompt, sent.stream),
                                               self._began + sent.sent, sent.result), self.plan.deadline_s)
        except asyncio.TimeoutError:
            sent.result.error = "hung"
        except (aiohttp.ClientError, OSError, msgspec.DecodeError) as exc:
            sent.result.error = f"{type(exc).__name__}: {exc}"
        sent.ended = time.perf_counter() - self._began

    async def _inject(self, target: str) -> Fault:
        now = time.perf_counter() - self._began
        if target == DATA_PLANE:
            return Fault(target, now, ready_at=now, note=await self._cut_data_plane())
        if target == REDIS_FAILOVER:
            return await self._fail_over(now)
        pid = next(c.pid for c in read_state(self.cluster.run_dir).children if c.name == target)
        os.kill(pid, signal.SIGKILL)
        fault = Fault(target, now)
        deadline = time.monotonic() + self.plan.restart_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            child = next(c for c in (await asyncio.to_thread(status, self.cluster.run_dir)).children
                         if c.name == target)
            if child.pid != pid and child.ready:
                fault.ready_at = time.perf_counter() - self._began
                break
        return fault

    async def _fail_over(self, now: float) -> Fault:
        """kill -9 of the Redis master; ready again once the Sentinels name another one and kvmeta,
        following them, answers from it."""
        old = await asyncio.to_thread(self.redis.master_port)
        master = next(c for c in (self.redis.master, self.redis.replica) if redis_address(c.url)[1] == old)
        master.kill()
        fault = Fault(REDIS_FAILOVER, now, note=f"master :{old} killed")
        deadline = time.monotonic() + self.plan.restart_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            with contextlib.suppress(Exception):  # the Sentinels may not answer mid-failover
                promoted = await asyncio.to_thread(self.redis.master_port)
                if promoted != old and await self._kvmeta_answers():
                    fault.ready_at = time.perf_counter() - self._began
                    fault.note += f", :{promoted} promoted"
                    break
        return fault

    async def _kvmeta_answers(self) -> bool:
        try:
            await self._workers()
            return True
        except (aiohttp.ClientError, OSError, msgspec.DecodeError):
            return False

    async def _cut_data_plane(self) -> str:
        """Destroy every TCP connection to the prefill engine's data-plane port (the decode engine's
        pulls), again and again for CUT_WINDOW_S: a pull in flight then is cut in the middle, and one
        that reconnects is cut again. One cut at one instant seldom meets a pull of a few ms."""
        port = int(next(w.info.data_address for w in await self._workers() if w.info.id == "engine-p0").rsplit(":", 1)[1])
        cut, deadline = 0, time.monotonic() + CUT_WINDOW_S
        while time.monotonic() < deadline:
            done = await asyncio.to_thread(subprocess.run, ["ss", "-K", "-t", "state", "established", "dport", "=",
                                                            f":{port}"], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return f"ss -K failed: {done.stderr.strip()}"
            cut += max(0, len(done.stdout.strip().splitlines()) - 1)
            await asyncio.sleep(0.005)
        return f"{cut} connection(s) to port {port} cut over {CUT_WINDOW_S:g} s"

    async def _workers(self) -> list:
        """kvmeta's registry of live workers."""
        kvmeta = next(c for c in read_state(self.cluster.run_dir).children if c.name == "kvmeta")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self._token()}",
                                                  "Accept": "application/msgpack"}) as session:
            async with session.get(kvmeta.url + "/v1/workers") as response:
                response.raise_for_status()
                return msgspec.msgpack.decode(await response.read(), type=WorkerList).workers

    def _token(self) -> str:
        return Path(read_state(self.cluster.run_dir).token_file).read_text().strip()

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.cluster.api_key}"},
                                     connector=aiohttp.TCPConnector(limit=0),  # the server's queue, not ours
                                     timeout=aiohttp.ClientTimeout(total=None))

    @property
    def _endpoint(self) -> str:
        return api_base(self.cluster.url) + "/v1/completions"

    def _body(self, prompt: int, stream: bool) -> dict:
        body = {"model": self.model, "prompt": self.prompts[prompt], "max_tokens": self.plan.max_tokens,
                "temperature": 0, "stream": stream, "ignore_eos": True, "ttft_ms": TTFT_SLO_S * 1000}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def _result(plan: Plan, quick: bool, chaos: Chaos, overload: Overload, inspection: Inspection) -> BenchResult:
    requests, faults = chaos.requests, chaos.faults
    wrong = [r for r in requests + overload.requests + overload.after
             if r.result.ok and r.result.text != chaos.reference[r.prompt]]
    kills = [f.at for f in faults] + [float("inf")]
    first = kills[0]
    before = [r for r in requests if _end(r) < first]
    rows = [Row(compared="before the first fault", path="", cells={
        "requests": len(before), "failed": sum(not r.result.ok for r in before),
        "wrong": sum(r in wrong for r in before)})]
    recovery: dict[str, float] = {}
    outside = 0
    for fault, next_kill in zip(faults, kills[1:]):
        # Each request belongs to the fault before its end: what it ran into last.
        ended = [r for r in requests if fault.at <= _end(r) < next_kill]
        failed = [r for r in ended if not r.result.ok]
        in_flight = [r for r in requests if r.sent <= fault.at < _end(r)]
        successes = [r.sent + r.result.e2e for r in requests if r.sent >= fault.at and r.result.ok]
        recovery[fault.target] = (min(successes) - fault.at) if successes else float("inf")
        outside += sum(r.sent >= fault.at for r in failed)
        rows.append(Row(compared=fault.target, path=fault.note or "kill -9", cells={
            "restart s": (fault.ready_at - fault.at) if fault.ready_at is not None else float("inf"),
            "in flight": len(in_flight), "failed in flight": sum(r.sent < fault.at for r in failed),
            "sent after": sum(fault.at <= r.sent < next_kill for r in requests),
            "failed after": sum(r.sent >= fault.at for r in failed),
            "hung": sum(r.hung for r in ended), "wrong": sum(r in wrong for r in ended),
            "recovery s": recovery[fault.target]}))
    rows.append(Row(compared="the whole run", path=f"{chaos.rate:.2f} req/s offered", cells={
        "requests": len(requests), "failed": sum(not r.result.ok for r in requests),
        "hung": sum(r.hung for r in requests), "wrong": len(wrong),
        "blocks held after": sum(inspection.held_blocks.values())}))
    engine_recovery = [v for k, v in recovery.items() if k in ENGINES]
    other_recovery = [v for k, v in recovery.items() if k not in ENGINES]
    ratios = {"hung_requests": float(sum(r.hung for r in requests)), "wrong_answers": float(len(wrong)),
              "leaked_blocks": float(sum(inspection.held_blocks.values())),
              "ghost_or_missing_workers": float(len(inspection.ghosts) + len(inspection.missing)),
              "failures_outside_in_flight": float(outside)}
    targets = dict.fromkeys(ratios, 0.0)
    if other_recovery:
        ratios["recovery_s_max_stateless"] = max(other_recovery)
        targets["recovery_s_max_stateless"] = RECOVERY_TARGETS["stateless"]
    if engine_recovery:
        ratios["recovery_s_max_engine"] = max(engine_recovery)
        targets["recovery_s_max_engine"] = RECOVERY_TARGETS["engine"]
    baseline = _p90([r.result.e2e for r in before if r.result.ok])
    overload_rows, overload_ratios, overload_targets = _overload_figures(overload, baseline, wrong)
    rows += overload_rows
    ratios |= overload_ratios
    targets |= overload_targets
    failed = sum(not r.result.ok for r in requests)
    return BenchResult(
        bench="chaos", quick=quick, ratios=ratios, targets=targets, directions=dict.fromkeys(targets, "<="),
        ceilings={"capacity req/s": chaos.capacity},
        config={"model": plan.model, "topology": "1P1D (kvmesh up --prefill 1 --decode 1), float32, dense weights",
                "faults": list(plan.faults), "rate req/s": chaos.rate, "capacity req/s": chaos.capacity,
                "prompts": plan.prompts, "max_tokens": plan.max_tokens, "deadline_s": plan.deadline_s,
                "warm_s": plan.warm_s, "settle_s": plan.settle_s, "tail_s": plan.tail_s,
                "errors": sorted({r.result.error[:120] for r in requests if r.result.error}),
                "overload_errors": dict(collections.Counter(r.result.error[:120] for r in overload.requests + overload.after
                                                            if r.result.error and r.result.status != 429)),
                "held_blocks": inspection.held_blocks, "ghosts": inspection.ghosts, "missing": inspection.missing,
                "overload req/s": overload.rate, "overload_s": plan.overload_s, "after_s": plan.after_s,
                "rss_mib_before_overload": overload.rss_before, "rss_mib_peak_overload": overload.rss_peak,
                "rss_growth_bound": RSS_GROWTH_BOUND, "ttft_slo_s": TTFT_SLO_S, "normal_latency": f"within {NORMAL_LATENCY}x the P90 before the faults"},
        rows=rows, plots=[_plot(requests + overload.requests + overload.after, faults, overload)],
        headline=f"{len(requests)} requests at {chaos.rate:.2f} req/s (half the measured {chaos.capacity:.2f}), "
                 f"{len(faults)} faults: {failed} failed ({outside} of them sent after a kill), "
                 f"{int(ratios['hung_requests'])} hung, {len(wrong)} wrong answers, "
                 f"{int(ratios['leaked_blocks'])} blocks held after the drain")


def _overload_figures(overload: Overload, baseline: float,
                      wrong: list[Sent]) -> tuple[list[Row], dict[str, float], dict[str, float]]:
    """The overload phase's rows, keys and targets: refusals are 429 with Retry-After, what is taken is
    answered within its TTFT SLO, memory stays within RSS_GROWTH_BOUND, and latency is normal again
    soon after."""
    sent, after = overload.requests, overload.after
    refused = [r for r in sent + after if r.result.status == 429]
    failed = [r for r in sent + after if not r.result.ok and r.result.status != 429]
    # back to normal: from the first request sent after the overload from which on every answer is in time
    late = [r.sent for r in after if not (r.result.ok and r.result.e2e <= NORMAL_LATENCY * baseline)]
    normal_from = next((r.sent for r in after if r.sent > max(late, default=-1.0)), float("inf"))
    # a whole answer's first token reaches its client with the last: TTFT is the streamed requests'
    streamed_ttft_p90 = _p90([r.result.ttft for r in sent if r.result.ok and r.stream])
    growth = {name: peak / overload.rss_before[name] for name, peak in overload.rss_peak.items()
              if overload.rss_before.get(name)}
    rows = [Row(compared="overload", path=f"{overload.rate:.1f} req/s, 10x the capacity", cells={
                "requests": len(sent), "answered": sum(r.result.ok for r in sent),
                "429": sum(r.result.status == 429 for r in sent), "failed": sum(r in failed for r in sent),
                "hung": sum(r.hung for r in sent), "wrong": sum(r in wrong for r in sent),
                "ttft p90 s": streamed_ttft_p90,
                "e2e p90 s": _p90([r.result.e2e for r in sent if r.result.ok]), "e2e p90 before s": baseline}),
            Row(compared="after the overload", path="the fault phase's rate", cells={
                "requests": len(after), "answered": sum(r.result.ok for r in after),
                "failed": sum(r in failed for r in after), "e2e p90 s": _p90([r.result.e2e for r in after if r.result.ok]),
                "normal after s": normal_from - overload.ended})]
    ratios = {"overload_429_without_retry_after": float(sum(r.result.retry_after is None for r in refused)),
              "overload_failures_not_429": float(len(failed)),
              "overload_rss_growth_max": max(growth.values(), default=0.0),
              "overload_answered_ttft_p90_s": streamed_ttft_p90,
              "overload_normal_after_s": normal_from - overload.ended}
    targets = {"overload_429_without_retry_after": 0.0, "overload_failures_not_429": 0.0,
               "overload_rss_growth_max": RSS_GROWTH_BOUND, "overload_answered_ttft_p90_s": TTFT_SLO_S,
               "overload_normal_after_s": RECOVERY_TARGETS["stateless"]}
    return rows, ratios, targets


def _p90(seconds: list[float]) -> float:
    return float(np.percentile(seconds, 90)) if seconds else float("nan")


def _end(request: Sent) -> float:
    return request.ended if request.ended is not None else float("inf")


def _plot(requests: list[Sent], faults: list[Fault], overload: Overload) -> str:
    """Answers and errors per second over the run, with a marker at each fault and the overload shaded."""
    end = max((r.ended or r.sent) for r in requests) if requests else 1.0
    bins = np.arange(0.0, end + 1.0, 1.0)
    ok = [r.ended for r in requests if r.result.ok and r.ended is not None]
    bad = [r.ended if r.ended is not None else r.sent for r in requests if not r.result.ok]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.hist(ok, bins=bins, color="tab:blue", alpha=0.7, label="answers/s")
    ax.hist(bad, bins=bins, color="tab:red", alpha=0.8, label="errors/s")
    for fault in faults:
        ax.axvline(fault.at, color="black", linestyle="--", linewidth=0.8)
        ax.text(fault.at, ax.get_ylim()[1] * 0.95, f" {fault.target}", rotation=90, va="top", fontsize=8)
        if fault.ready_at is not None and fault.ready_at > fault.at:
            ax.axvspan(fault.at, fault.ready_at, color="grey", alpha=0.15)
    if overload.requests:
        ax.axvspan(overload.requests[0].sent, overload.ended, color="tab:orange", alpha=0.15, label="overload")
    ax.set_xlabel("seconds into the load")
    ax.set_ylabel("per second")
    ax.set_title("kvmesh bench chaos: answers and errors, faults marked (shaded: until the supervisor had it ready)")
    ax.legend(loc="upper right")
    return save_figure(fig, TIMELINE_PLOT)
