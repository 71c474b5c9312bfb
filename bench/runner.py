"""`kvmesh bench NAME [--quick] [--json PATH] [--target URL] [--model NAME] [--layer-decode MODE]`: run
one benchmark, print its table, save its JSON. `--target` (serve only) points the load at another
OpenAI-compatible server; `--model` (sim only) names the engines' model; `--layer-decode` (layerkv and
sim_layerkv) is how LayerKV's decodes get their offloaded layers, restore or stage."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .report import save, show

BENCHES = ("kvmeta", "engine", "transfer", "serve", "tracing", "cacheopt", "layerkv", "car", "vllm", "vllm_car", "vllm_cacheopt", "peer", "chaos", "sim",
           "sim_scale", "sim_cacheopt", "sim_layerkv", "sim_car")
# The options only some benchmarks take, and which.
TAKEN_BY = {"target": ("serve",), "model": ("sim",), "layer_decode": ("layerkv", "sim_layerkv")}


def run_bench(name: str, *, quick: bool, json_path: Path | None, target: str | None = None,
              model: str | None = None, layer_decode: str | None = None) -> int:
    if name not in BENCHES:
        print(f"kvmesh bench: no benchmark {name!r}; there are: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    options = {k: v for k, v in (("target", target), ("model", model), ("layer_decode", layer_decode))
               if v is not None}
    for option in options:
        if name not in TAKEN_BY[option]:
            print(f"kvmesh bench: --{option.replace('_', '-')} is for "
                  f"{' and '.join(f'`{b}`' for b in TAKEN_BY[option])} only, not {name!r}", file=sys.stderr)
            return 2
    module = importlib.import_module(f"kvmesh.bench.{name}")
    result = module.run(quick=quick, **options)
    show(result)
    if json_path is not None:
        save(result, json_path)
    return 0
