"""Runs a benchmark's `--quick --json` as a user would; the bench tests judge its contract, not its values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

# For each bench test module's `pytestmark`: each benchmark runs under its own subprocess timeout
# (up to 600 s: a slower CPU, say one without AVX-512, takes the cacheopt benchmark past the suite's
# 120 s default).
BENCH_TIMEOUT = pytest.mark.timeout(660)


def quick_bench(tmp_path: Path, name: str, timeout: float) -> tuple[dict, subprocess.CompletedProcess]:
    """`kvmesh bench NAME --quick --json`, run as a user would; its JSON and the run."""
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "kvmesh", "bench", name, "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = msgspec.json.decode(out.read_bytes())
    assert result["bench"] == name and result["quick"] is True
    return result, done
