"""Stock vLLM as a kvmesh engine (issue 10): the kvmesh KV connector, which moves a prompt's KV
from a prefill vLLM instance to a decode one over libs/rdma (KVDirect pull mode). Importing it
needs vLLM: `scripts/setup-vllm.sh` installs vLLM's CPU build into .venv-vllm (docs/vllm.md)."""
