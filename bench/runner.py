"""`kvmesh bench NAME [--quick] [--json PATH] [--target URL] [--model NAME]`: run one benchmark, print
its table, save its JSON. `--target` (serve only) points the load at another OpenAI-compatible server;
`--model` (sim only) names the engines' model."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .report import save, show

BENCHES = ("kvmeta", "engine", "transfer", "serve", "tracing", "cacheopt", "layerkv", "car", "vllm", "vllm_car", "vllm_cacheopt", "peer", "chaos", "sim",
           "sim_scale", "sim_cacheopt", "sim_layerkv", "sim_car")


def run_bench(name: str, *, quick: bool, json_path: Path | None, target: str | None = None,
              model: str | None = None) -> int:
    if name not in BENCHES:
        print(f"kvmesh bench: no benchmark {name!r}; there are: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    if target is not None and name != "serve":
        print(f"kvmesh bench: --target is for `serve` only, not {name!r}", file=sys.stderr)
        return 2
    if model is not None and name != "sim":
        print(f"kvmesh bench: --model is for `sim` only, not {name!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"kvmesh.bench.{name}")
    options = {"target": target} if target is not None else {"model": model} if model is not None else {}
    result = module.run(quick=quick, **options)
    show(result)
    if json_path is not None:
        save(result, json_path)
    return 0
