"""KVDirectNode, the one adapter both engine backends put on libs/rdma: two nodes, each serving its
tensors and landing a peer's, pull and push blocks between them, a COMPLETE reaches the serving
side's release, and a synchronous caller (vLLM's worker) drives a node through ThreadedNode."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.libs.rdma.kvdirect.node import KVDirectNode, ThreadedNode
from kvmesh.libs.rdma.kvdirect.puller import BlockReads
from kvmesh.libs.rdma.shm.shared import shared_tensor

from .conftest import TOKEN

LAYER = (16, 2, 4, 8)   # a vLLM-like layer cache: the block first, the backend's layout after


def pattern(seed: int) -> torch.Tensor:
    tensor = shared_tensor(LAYER, torch.bfloat16)
    tensor.copy_((torch.arange(tensor.numel(), dtype=torch.float32) + seed * 1000).view(LAYER).to(torch.bfloat16))
    return tensor


def releasing(released: list[str]):
    def release(request_id: str) -> bool:
        released.append(request_id)
        return True
    return release


def node(backend: str, tensors: dict[str, torch.Tensor], released: list[str]) -> KVDirectNode:
    return KVDirectNode(backend, TOKEN, "127.0.0.1", 0, served=tensors, landing=tensors, release=releasing(released),
                        timeout=5.0)


async def test_nodes_pull_and_push_each_others_blocks(backend):
    mine, theirs = {"l0": pattern(1), "l1": pattern(2)}, {"l0": pattern(3), "l1": pattern(4)}
    expected = {name: tensor.clone() for name, tensor in theirs.items()}
    released: list[str] = []
    a, b = node(backend, mine, []), node(backend, theirs, released)
    b_address = await b.start()
    await a.start()
    try:
        report = await a.pull(b_address, "r0", [BlockReads(n, n, [3, 4, 5], [10, 11, 12]) for n in mine])
        assert report.bytes == 2 * 3 * mine["l0"][0].numel() * 2
        assert released == ["r0"]
        for name in mine:
            assert torch.equal(mine[name][10:13], expected[name][3:6])

        push = await a.push(b_address, "l1", [[], [7, 8]])   # layer 1 of the request goes to blocks 7, 8
        await asyncio.to_thread(push.layer_done, 1, 0, [0, 1])
        push.finish()
        assert await asyncio.wrap_future(push.landed) is None
        assert torch.equal(theirs["l1"][7:9], mine["l1"][0:2])
    finally:
        await a.close()
        await b.close()


async def test_a_node_that_serves_needs_a_release():
    with pytest.raises(ValueError, match="release"):
        KVDirectNode("tcp", TOKEN, "127.0.0.1", 0, served={"l0": pattern(0)})


def test_a_synchronous_caller_pulls_through_a_threaded_node():
    served, landing = {"l0": pattern(5)}, {"l0": pattern(6)}
    released: list[str] = []
    prefill = ThreadedNode(KVDirectNode("tcp", TOKEN, "127.0.0.1", 0, served=served, release=releasing(released)))
    decode = ThreadedNode(KVDirectNode("tcp", TOKEN, "127.0.0.1", 0, landing=landing))
    try:
        assert decode.address == ""   # it serves nothing
        decode.pull(prefill.address, "r1", [BlockReads("l0", "l0", [0, 1], [2, 3])]).result(10)
        assert torch.equal(landing["l0"][2:4], served["l0"][0:2]) and released == ["r1"]
    finally:
        decode.close()
        prefill.close()
