# The two commands of the README's quick start. Both set the machine up first (idempotent).
.PHONY: setup up test peers

setup:
	@scripts/setup.sh

up: setup
	.venv/bin/kvmesh up

# Two workers, each taking whole files: most of the suite waits on service processes starting.
test: setup
	.venv/bin/python -m pytest -n 2 --dist loadfile

# Optional: the peer libraries `kvmesh bench transfer` compares against (Mooncake, NIXL), and NIXL
# for vLLM's NixlConnector, `kvmesh bench vllm`'s P/D baseline.
peers: setup
	@scripts/setup.sh --peers
