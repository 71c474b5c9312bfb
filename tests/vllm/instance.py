"""One vLLM instance (vLLM's CPU build, in .venv-vllm) with the kvmesh connector, driven by JSON
lines on stdin: the tests' stand-in for a vLLM server, whose scheduler it can also look into.

    python instance.py MODEL ROLE DATA_PORT CPU SETTINGS
      ROLE: kv_producer | kv_consumer; CPU: the core its threads are bound to; SETTINGS: JSON of more
      kv_connector_extra_config (the connector's Settings)

Commands, one JSON object a line; each answer is one JSON line prefixed with "@@ " on stdout:
  {"op": "generate", "prompts": [[ids]], "max_tokens": N, "params": [kv_transfer_params | null]}
      -> {"outputs": [[ids]], "kv_transfer_params": [...]}
  {"op": "blocks"} -> {"free": N, "total": N}: vLLM's own block pool
  {"op": "digest", "blocks": [ids]} -> {"digest": hex}: sha256 of those blocks in every layer
  {"op": "pulled", "request": remote request id} -> {"blocks": [local ids], "bytes": N}: its latest pull
  {"op": "exit"}
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import sys

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                  VLLM_CPU_OMP_THREADS_BIND=sys.argv[4])

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402

BLOCK_SIZE = 32


def main() -> None:
    model, role, port, settings = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[5])
    transfer = KVTransferConfig(kv_connector="KVMeshConnector",
                                kv_connector_module_path="kvmesh.services.engine.vllm_backend.connector",
                                kv_role=role, engine_id=role, kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"data_port": port, "timeout_s": 3.0, **settings})
    llm = LLM(model, dtype="float32", block_size=BLOCK_SIZE, enforce_eager=True, max_model_len=1024, max_num_seqs=8,
              enable_prefix_caching=False, kv_transfer_config=transfer)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    reply({"ready": True})
    for line in commands(llm, scheduler):
        command = json.loads(line)
        if command["op"] == "generate":
            params = [SamplingParams(max_tokens=command["max_tokens"], temperature=0.0, ignore_eos=True,
                                     extra_args={"kv_transfer_params": p} if p else None) for p in command["params"]]
            outputs = llm.generate([{"prompt_token_ids": p} for p in command["prompts"]], params, use_tqdm=False)
            reply({"outputs": [list(o.outputs[0].token_ids) for o in outputs],
                   "kv_transfer_params": [o.kv_transfer_params for o in outputs]})
        elif command["op"] == "blocks":
            pool = scheduler.kv_cache_manager.block_pool
            reply({"free": pool.get_num_free_blocks(), "total": pool.num_gpu_blocks - 1})
        elif command["op"] == "digest":
            caches = get_kv_transfer_group().kv_caches
            digest = hashlib.sha256()
            for name in sorted(caches):
                digest.update(caches[name][command["blocks"]].contiguous().view(torch.uint8).numpy().tobytes())
            reply({"digest": digest.hexdigest()})
        elif command["op"] == "pulled":
            pulls = [(load, report) for load, report in get_kv_transfer_group().pulls
                     if load.remote_request_id == command["request"]]
            reply({"blocks": pulls[-1][0].local_blocks, "bytes": pulls[-1][1].bytes} if pulls else {})
        elif command["op"] == "exit":
            break


def commands(llm: LLM, scheduler):
    """stdin's lines; between them the engine steps while it has work, as a server's loop does (a
    finished request's KV is held, and released, over later steps)."""
    while True:
        if scheduler.has_requests():
            llm.llm_engine.step()
            # Only held KV left: wait a little between steps, so the data plane's thread gets the GIL.
            idle = not scheduler.get_num_unfinished_requests()
            ready, _, _ = select.select([sys.stdin], [], [], 0.005 if idle else 0)
        else:
            ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if ready:
            line = sys.stdin.readline()
            if not line:
                return
            yield line


def reply(answer: dict) -> None:
    print("@@ " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
