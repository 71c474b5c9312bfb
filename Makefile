# The two commands of the README's quick start. Both set the machine up first (idempotent).
.PHONY: setup up test peers

setup:
	@scripts/setup.sh

up: setup
	.venv/bin/kvmesh up

test: setup
	.venv/bin/python -m pytest

# Optional: the peer libraries `kvmesh bench transfer` compares against (Mooncake, NIXL).
peers: setup
	@scripts/setup.sh --peers
