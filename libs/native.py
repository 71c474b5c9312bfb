"""Compiles and loads kvmesh's C++ extensions with torch's extension builder.

Each extension builds under the virtualenv (sys.prefix/torch_extensions/NAME, or
$KVMESH_EXT_DIR/NAME), so setup builds it once and every later process only loads it; torch
rebuilds it when the sources, the flags or the CPU change. A missing compiler or a failed build is
logged and returns None: every extension has a plain-Python or plain-torch fallback.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def build_directory(name: str) -> Path:
    root = os.environ.get("KVMESH_EXT_DIR")
    return Path(root) / name if root else Path(sys.prefix) / "torch_extensions" / name


@functools.cache
def load(name: str, sources: tuple[Path, ...], openmp: bool = False) -> ModuleType | None:
    """The compiled module NAME built from SOURCES (headers: the *.h next to them), or None (logged)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        log.warning("%s: no C++ compiler (%s) on PATH; using the fallback", name, compiler)
        return None
    if not cpp_extension.is_ninja_available():
        log.warning("%s: ninja is not installed; using the fallback", name)
        return None
    directory = build_directory(name)
    omp = ["-fopenmp"] if openmp else []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory):
            return cpp_extension.load(name=name, sources=[str(s) for s in sources],
                                      extra_cflags=cflags(sources) + omp, extra_ldflags=omp,
                                      build_directory=str(directory), verbose=False)
    except Exception as error:  # noqa: BLE001 - whatever failed, the fallback still works
        tail = "\n".join(str(error).splitlines()[-20:])  # the compiler's output can be long
        log.warning("%s: building in %s failed; using the fallback:\n%s", name, directory, tail)
        return None


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """One kvmesh process at a time builds or loads in `directory`, under a kernel lock that dies
    with its holder. torch's own baton (the file `lock`) outlives a build killed midway (a test's
    timeout), and every later load then waits for it for ever; under the kernel lock a baton left
    there is such a one, and is removed."""
    with open(directory / "kvmesh.lock", "w") as held, _venv_tools_first():
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


@contextlib.contextmanager
def _venv_tools_first() -> Iterator[None]:
    """The virtualenv's own tools (its pip-installed ninja) first on PATH while torch builds. A
    process started without the virtualenv on PATH ran the system's ninja, whose log hashes a
    command otherwise than the pip one's (1.11 against 1.13): each took the other's objects for
    stale, and every load by the other kind rebuilt the kernels."""
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


def cflags(sources: Sequence[Path]) -> list[str]:
    # -march=native ties the binary to this CPU; naming the CPU in a define makes torch's build
    # hash differ on another one (a copied virtualenv), so it rebuilds instead of crashing. torch
    # hashes the sources but not the headers they include, hence their own define.
    return ["-O3", "-march=native", f"-DKVMESH_CPU={_cpu_fingerprint()}",
            f"-DKVMESH_HEADERS={_headers_fingerprint(sources)}"]


def _cpu_fingerprint() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _headers_fingerprint(sources: Sequence[Path]) -> str:
    headers = sorted({h for s in sources for h in Path(s).parent.glob("*.h")})
    return hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()[:12]
