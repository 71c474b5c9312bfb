"""Small builders for test bodies."""

from __future__ import annotations

from kvmesh.libs.kvmeta.messages import BlockGeometry, BlockLease, Capacity, CacheEntry, GpuNic, WorkerInfo


def worker_info(worker_id: str, role: str = "prefill", gpus: int = 2) -> WorkerInfo:
    return WorkerInfo(
        id=worker_id, role=role, control_url=f"http://127.0.0.1:1/{worker_id}", data_address="127.0.0.1:2",
        model="tiny", geometry=BlockGeometry(block_size=16, num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16"),
        pairing=[GpuNic(gpu=i, nic=f"mlx5_{i}", address=f"10.0.0.{i}") for i in range(gpus)],
        capacity=Capacity(device_blocks=1024, cxl_blocks=4096))


def entries(node_ids: list[str], tier: str = "device", size: int = 8192) -> list[CacheEntry]:
    return [CacheEntry(node_id=n, tier=tier, size=size) for n in node_ids]


def lease(engine: str, lease_ms: int = 30_000, layers: int = 4) -> BlockLease:
    return BlockLease(engine=engine, layers=[[2 * i, 2 * i + 1] for i in range(layers)], token_count=20,
                      lease_ms=lease_ms)
