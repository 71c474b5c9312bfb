"""What the engine service and KVMeshScheduler agree on, importable without vLLM: the native engine's
policy hooks vLLM's scheduler lets in, and the extra_args key of a request's SLOs and predicted lengths."""

HOOKS = ("preemption_order", "prefill_admission", "kv_allocation")
TARGETS = "kvmesh_targets"
