"""One stock vLLM instance (vLLM's CPU build, run from .venv-vllm) behind a KV connector, driven by
JSON lines on stdin: what the vLLM backend's tests and `kvmesh bench vllm` start, a stand-in for a
vLLM server whose scheduler and connector they can also look into.

    python -m kvmesh.bench.vllm_instance MODEL --role kv_producer --cpu 0 [--connector kvmesh|example|none]
                                               [--data-port N] [--settings JSON]
                                               [--prefix-caching] [--kv-bytes N] [--max-model-len N]
                                               [--kvmesh-scheduler JSON]

Between commands the engine steps while it has work, as a server's loop does. Answers are JSON
lines prefixed with "@@ " on stdout (other output is vLLM's):
  {"op": "generate", "prompts": [[ids]], "max_tokens": N, "params": [kv_transfer_params | null]}
      -> {"outputs": [[ids]], "kv_transfer_params": [...]}              (all at once, then answers)
  {"op": "add", "id": ID, "prompt": [ids], "max_tokens": N, "params": kv_transfer_params | null,
   "targets": {SLOs, predicted lengths} | null, "stop_after": N | null}
      -> later, when it ends: {"done": ID, "added": wall-clock s, "token_times": [...], "token_ids": [...],
                               "cached_tokens": N
                               (prompt tokens not computed here), "kv_transfer_params": ...}
      (`targets` reach KVMeshScheduler's policies as the engine service passes them; `stop_after`
      ends the request after that many tokens, as if it sampled EOS, while its policies see max_tokens)
  {"op": "policies", "policies": {hook: name}} -> {"policies": {...}}: KVMeshScheduler's, switched
  {"op": "scheduler"} -> {"preemptions": N, "planned_preemptions": N, "allocations_grown": {...}}:
      KVMeshScheduler's counts, all time (planned: victims its allocation plan named, not vLLM); under
      stock vLLM's scheduler the preempted ids its steps reported, nothing planned or grown
  {"op": "blocks"} -> {"free": N, "total": N}: vLLM's own block pool
  {"op": "digest", "blocks": [ids]} -> {"digest": hex}: sha256 of those blocks in every layer
  {"op": "pulled", "request": remote request id} -> {"blocks": [local ids], "bytes": N}: its latest pull
  {"op": "pulls"} -> {"bytes": [...], "reads_seconds": [...], "seconds": [...], "started": [unix s]}: the
      latest pulls' reports
  {"op": "tier"} -> {"loaded": N, "saved": N, "evicted": N, "slot_bytes": N, "load_seconds": s}: KVMeshConnector's
      cxl tier (blocks loaded back, written through, evicted; the copy thread's time loading)
  {"op": "exit"}
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import select
import signal
import sys
import time

BLOCK_SIZE = 32
SCHEDULER = "kvmesh.services.engine.vllm_backend.scheduler.KVMeshScheduler"
CONNECTORS = {
    "kvmesh": dict(kv_connector="KVMeshConnector",
                   kv_connector_module_path="kvmesh.services.engine.vllm_backend.connector"),
    "example": dict(kv_connector="ExampleConnector"),   # vLLM's own: KV through files in shared storage
    "nixl": dict(kv_connector="NixlConnector"),         # vLLM's production P/D connector (NIXL, host memory here)
}


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1` prints where a stuck instance is
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--role", default="kv_both", choices=["kv_producer", "kv_consumer", "kv_both"])
    parser.add_argument("--cpu", default="0", help="the core (or range) vLLM's threads are bound to")
    parser.add_argument("--connector", default="kvmesh", choices=[*CONNECTORS, "none"])
    parser.add_argument("--data-port", type=int, default=0)
    parser.add_argument("--settings", default="{}", help="JSON: more kv_connector_extra_config")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache on the device")
    parser.add_argument("--kv-bytes", type=int, default=0, help="the KV cache's size (default: 1 GiB)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="at most what the KV cache holds")
    parser.add_argument("--kvmesh-scheduler", metavar="JSON",
                        help='KVMeshScheduler with this additional_config["kvmesh"]: {"policies": ..., '
                             '"allocation": ...}')
    args = parser.parse_args()
    # One torch thread: vLLM binds its OMP threads to --cpu, but torch's intra-op pool still starts one
    # thread per core, and two instances side by side then fight over both cores (`kvmesh bench vllm`,
    # the P/D pair at 2 req/s: P50 TTFT 3.0 s without this, 0.29 s with it).
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=args.cpu,
                      OMP_NUM_THREADS="1")
    if not args.kv_bytes:   # vLLM's CPU build takes this over kv_cache_memory_bytes
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if args.connector == "nixl":   # NixlConnector's handshake listens where its environment says
        os.environ.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(args.data_port))
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if args.connector != "none":
        transfer = KVTransferConfig(**CONNECTORS[args.connector], kv_role=args.role, engine_id=args.role,
                                    kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"data_port": args.data_port, "timeout_s": 3.0,
                                                               **json.loads(args.settings)}
                                    if args.connector == "kvmesh" else json.loads(args.settings))
    llm = LLM(args.model, dtype="float32", block_size=BLOCK_SIZE, enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.prefix_caching, kv_transfer_config=transfer,
              kv_cache_memory_bytes=args.kv_bytes or None,
              **(dict(scheduler_cls=SCHEDULER, additional_config={"kvmesh": json.loads(args.kvmesh_scheduler)})
                 if args.kvmesh_scheduler else {}))
    Driver(llm).serve()
    llm.llm_engine.engine_core.shutdown()   # the connector's too: its data plane closes
    sys.stdout.flush()
    os._exit(0)   # whatever threads vLLM or the data plane left behind end with the process


class Driver:
    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        if not hasattr(self.scheduler, "preemptions"):   # stock vLLM's: count what its steps report
            self.scheduler.schedule = PreemptionCount(self.scheduler.schedule)
        self.token_times: dict[str, list[float]] = {}   # of requests added with "add"
        self.added: dict[str, float] = {}                # and when each was
        self.stop_after: dict[str, int] = {}             # and how many tokens each ends at

    def serve(self) -> None:
        reply({"ready": True})
        for line in self._commands():
            command = json.loads(line)
            if command["op"] == "exit":
                break
            answer = getattr(self, "_" + command["op"])(command)
            if answer is not None:
                reply(answer)

    def _generate(self, command: dict) -> dict:
        params = [sampling(command["max_tokens"], p) for p in command["params"]]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in command["prompts"]], params, use_tqdm=False)
        return {"outputs": [list(o.outputs[0].token_ids) for o in outputs],
                "kv_transfer_params": [o.kv_transfer_params for o in outputs]}

    def _add(self, command: dict) -> None:
        self.engine.add_request(command["id"], {"prompt_token_ids": command["prompt"]},
                                sampling(command["max_tokens"], command.get("params"), command.get("targets")))
        self.token_times[command["id"]] = []
        self.added[command["id"]] = time.time()
        if command.get("stop_after"):
            self.stop_after[command["id"]] = command["stop_after"]

    def _policies(self, command: dict) -> dict:
        self.scheduler.set_policies(command["policies"])
        return {"policies": self.scheduler.policy_names}

    def _scheduler(self, command: dict) -> dict:
        if isinstance(self.scheduler.schedule, PreemptionCount):
            return {"preemptions": self.scheduler.schedule.preemptions, "planned_preemptions": 0,
                    "allocations_grown": {}}
        return {"preemptions": self.scheduler.preemptions, "planned_preemptions": self.scheduler.planned_preemptions,
                "allocations_grown": self.scheduler.ledger.grown}

    def _blocks(self, command: dict) -> dict:
        pool = self.scheduler.kv_cache_manager.block_pool
        return {"free": pool.get_num_free_blocks(), "total": pool.num_gpu_blocks - 1}

    def _digest(self, command: dict) -> dict:
        import torch
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        caches = get_kv_transfer_group().kv_caches
        digest = hashlib.sha256()
        for name in sorted(caches):
            digest.update(caches[name][command["blocks"]].contiguous().view(torch.uint8).numpy().tobytes())
        return {"digest": digest.hexdigest()}

    def _pulled(self, command: dict) -> dict:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        pulls = [(load, report) for load, report in get_kv_transfer_group().pulls
                 if load.remote_request_id == command["request"]]
        return {"blocks": pulls[-1][0].local_blocks, "bytes": pulls[-1][1].bytes} if pulls else {}

    def _pulls(self, command: dict) -> dict:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        pulls = list(get_kv_transfer_group().pulls)
        return {"bytes": [r.bytes for _, r in pulls], "reads_seconds": [r.reads_seconds for _, r in pulls],
                "seconds": [r.seconds for _, r in pulls], "started": [load.started for load, _ in pulls]}

    def _tier(self, command: dict) -> dict:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        table = self.scheduler.connector.table
        tier = get_kv_transfer_group().tier
        return {"loaded": table.loaded, "saved": table.saved, "evicted": table.evicted, "slot_bytes": tier.slot_bytes,
                "load_seconds": tier.load_seconds}

    def _commands(self):
        """stdin's lines; between them the engine steps while it has work, as a server's loop does (a
        finished request's KV is held, and released, over later steps). Read unbuffered: select()
        knows nothing of lines a buffered reader has already taken in."""
        stdin, pending = sys.stdin.fileno(), b""
        while True:
            if self.scheduler.has_requests():
                self._step()
                # Only held KV left: wait a little between steps, so the data plane's thread gets the GIL.
                idle = not self.scheduler.get_num_unfinished_requests()
                ready, _, _ = select.select([stdin], [], [], 0.005 if idle else 0)
            else:
                ready, _, _ = select.select([stdin], [], [], 0.05)
            if ready:
                chunk = os.read(stdin, 1 << 16)
                if not chunk:
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                yield from lines

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.time()
        for output in outputs:
            times = self.token_times.get(output.request_id)
            if times is None:
                continue
            times += [now] * (len(output.outputs[0].token_ids) - len(times))
            stop = self.stop_after.get(output.request_id)   # None: it runs to max_tokens
            reached = stop is not None and len(times) >= stop
            if reached and not output.finished:   # as if it sampled EOS there
                self.engine.abort_request([output.request_id])
            if output.finished or reached:
                del self.token_times[output.request_id]
                self.stop_after.pop(output.request_id, None)
                reply({"done": output.request_id, "added": self.added.pop(output.request_id),
                       "token_times": times[:stop], "token_ids": list(output.outputs[0].token_ids)[:stop],
                       "cached_tokens": output.num_cached_tokens, "kv_transfer_params": output.kv_transfer_params})


class PreemptionCount:
    """Stock vLLM's `Scheduler.schedule`, counting the requests each step's output says it preempted."""

    def __init__(self, schedule):
        self.schedule, self.preemptions = schedule, 0

    def __call__(self, *args, **kwargs):
        output = self.schedule(*args, **kwargs)
        self.preemptions += len(output.preempted_req_ids or ())
        return output


def sampling(max_tokens: int, kv_transfer_params: dict | None, targets: dict | None = None):
    from vllm import SamplingParams

    from kvmesh.services.engine.vllm_backend.policy_hooks import TARGETS

    extra = {**({"kv_transfer_params": kv_transfer_params} if kv_transfer_params else {}),
             **({TARGETS: targets} if targets else {})}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra or None)


def reply(answer: dict) -> None:
    print("@@ " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
