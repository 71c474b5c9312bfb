"""Push mode in the engine (KVDirect's push, as the simulator models it): every step that computes a
chunk of a push-mode prompt writes the blocks that chunk filled, a layer at a time, into the decode
side's reserved blocks (a block it completes written again); the last chunk's step samples without
waiting for the writes, and the first token goes out once they have landed. An in-process engine on
the tiny model and a real data plane (tcp) to a server standing in for the decode engine's pool."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.puller import KVDirectPuller
from kvmesh.libs.rdma.kvdirect.pusher import KVDirectPusher, LayerPush
from kvmesh.libs.rdma.kvdirect.server import KVDirectServer

from ..conftest import TOKEN
from .conftest import assert_all_blocks_free, engine_for, run_all

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
BUDGET = 40  # tokens a step computes: a 50-token prompt in chunks of 40 and 10, the second completing block 2
PROMPT = list(range(300, 350))


async def nothing_to_release(request_id: str) -> bool:
    return False


class DecodeSide:
    """A server exposing a pool shaped as the engine's (the decode engine's blocks, zeros), and a
    pusher over the engine's own pool."""

    def __init__(self, engine, blocks: int | None = None):
        self.engine = engine
        shape = engine.blocks.device.tensor.shape
        self.pool = torch.zeros((blocks or shape[0], *shape[1:]), dtype=engine.blocks.device.tensor.dtype)
        self.server = KVDirectServer(open_endpoint("tcp", TOKEN), nothing_to_release, timeout=3.0)
        self.server.expose("device", self.pool)
        self.puller = KVDirectPuller(open_endpoint("tcp", TOKEN), timeout=3.0)
        self.puller.expose("device", engine.blocks.device.tensor)
        self.address = ""

    async def start(self) -> DecodeSide:
        self.address = await self.server.start()
        await self.puller.endpoint.start()
        return self

    async def close(self) -> None:
        await self.puller.close()
        await self.server.close()

    def reserved(self, tokens: int, offset: int = 0) -> list[list[int]]:
        """Blocks for `tokens` tokens in each layer, away from the engine's own low block ids."""
        per_layer = -(-tokens // self.engine.blocks.block_size)
        top = self.pool.shape[0] - offset
        return [list(range(top - per_layer * (layer + 1), top - per_layer * layer))
                for layer in range(self.engine.blocks.num_layers)]

    async def push(self, reserved: list[list[int]]) -> LayerPush:
        return await KVDirectPusher(self.puller, "device", timeout=3.0).push(self.address, reserved)


def engine_with(tiny_checkpoint, **overrides):
    return engine_for(tiny_checkpoint, token_budget=BUDGET, dataplane="none", layer_profile="off", **overrides)


@pytest.fixture
async def decode_side(tiny_checkpoint):
    side = await DecodeSide(engine_with(tiny_checkpoint)).start()
    yield side
    await side.close()


async def landed(push: LayerPush) -> str | None:
    return await asyncio.wait_for(asyncio.wrap_future(push.landed), 10)


async def test_each_chunk_writes_its_blocks_and_the_first_token_waits_for_them_to_land(decode_side):
    engine, block = decode_side.engine, decode_side.engine.blocks.device.shape.bytes
    reserved = decode_side.reserved(len(PROMPT))
    push = await decode_side.push(reserved)
    request = engine.add("p", PROMPT, GREEDY, push=push)
    engine.step()
    first_step = engine.last_pushed_bytes
    events = engine.step()
    assert (first_step, engine.last_pushed_bytes) == (3 * 4 * block, 2 * 4 * block)  # blocks 0-2, then 2-3
    assert events.frames == [] and not engine.scheduler.has_work()  # sampled; the token waits for the writes
    assert await landed(push) is None
    for layer, remote in enumerate(reserved):
        assert torch.equal(decode_side.pool[remote], engine.blocks.device.tensor[request.layers[layer].blocks])
    (frame,) = engine.pushes_landed()
    assert frame.finish_reason == "length" and frame.timings.first_token == frame.times[0]
    assert_all_blocks_free(engine)
    # the same token as the prompt served without a push (its KV from the prefix cache now)
    assert frame.token_ids == run_all(engine, [PROMPT], GREEDY)[0].output_ids


async def test_cached_prefix_blocks_are_written_once_with_the_first_chunk(decode_side):
    """80 tokens whose first 32 (2 blocks) are cached: the first step computes 32-72 and writes
    blocks 0-4, the cached ones too; the second computes 72-80 and writes block 4 again."""
    engine, block = decode_side.engine, decode_side.engine.blocks.device.shape.bytes
    prompt = PROMPT[:32] + list(range(500, 548))
    run_all(engine, [PROMPT[:32] + [7]], GREEDY)
    push = await decode_side.push(decode_side.reserved(len(prompt)))
    request = engine.add("p", prompt, GREEDY, push=push)
    pushed = [(engine.step(), engine.last_pushed_bytes)[1] for _ in range(2)]
    assert request.num_cached == 32 and pushed == [5 * 4 * block, 1 * 4 * block]
    assert await landed(push) is None
    assert [f.finish_reason for f in engine.pushes_landed()] == ["length"]
    assert_all_blocks_free(engine)


async def test_a_write_the_peer_refuses_ends_the_request_with_an_error_and_frees_its_blocks(decode_side):
    """The second chunk's last block is one the peer's pool does not have: the first chunk's writes
    land, the second's fail (not the engine's step); the request ends with an error, nothing leaks."""
    engine = decode_side.engine
    reserved = decode_side.reserved(len(PROMPT))
    beyond = decode_side.pool.shape[0] + 5
    push = await decode_side.push([[*layer[:3], beyond] for layer in reserved])
    engine.add("p", PROMPT, GREEDY, push=push)
    engine.step(), engine.step()
    assert await landed(push) is not None
    assert [f.finish_reason for f in engine.pushes_landed()] == ["error"]
    assert_all_blocks_free(engine)


async def test_a_push_whose_peer_went_away_ends_with_an_error_and_frees_its_blocks(decode_side):
    """The decode side goes away between the two chunks, the first chunk's writes in flight."""
    engine = decode_side.engine
    push = await decode_side.push(decode_side.reserved(len(PROMPT)))
    engine.add("p", PROMPT, GREEDY, push=push)
    assert engine.step().frames == []
    await asyncio.wait_for(decode_side.server.close(), 10)
    assert engine.step().frames == []
    assert await asyncio.wait_for(asyncio.wrap_future(push.landed), 20) is not None
    assert [f.finish_reason for f in engine.pushes_landed()] == ["error"]
    assert_all_blocks_free(engine)


async def test_an_abort_while_writes_are_in_flight_frees_the_blocks_once_they_have_landed(decode_side):
    engine = decode_side.engine
    push = await decode_side.push(decode_side.reserved(len(PROMPT)))
    engine.add("p", PROMPT, GREEDY, push=push)
    engine.step()
    assert [f.finish_reason for f in engine.abort("p")] == ["abort"]
    assert await landed(push) is None
    assert engine.pushes_landed() == []
    assert_all_blocks_free(engine)


async def test_an_abort_after_the_sample_sends_no_token(decode_side):
    engine = decode_side.engine
    push = await decode_side.push(decode_side.reserved(len(PROMPT)))
    engine.add("p", PROMPT, GREEDY, push=push)
    engine.step(), engine.step()
    assert [f.finish_reason for f in engine.abort("p")] == ["abort"]
    assert await landed(push) is None
    assert engine.pushes_landed() == [] and engine.abort("p") == []
    assert_all_blocks_free(engine)


async def test_a_prompt_swapped_out_mid_prefill_writes_its_blocks_again_when_it_resumes(tiny_checkpoint):
    """Six blocks a layer: A's 50 tokens (4 blocks) take steps 1-2, B's first 30 (2 blocks) step 2;
    A's blocks stay held while its writes land, so B, short of 2 blocks for its last 20 tokens, is
    swapped out. Its blocks were free to be reused while its first writes were in flight: resumed,
    it writes every block again, and the decode side ends with B's KV as computed."""
    side = await DecodeSide(engine_with(tiny_checkpoint, device_blocks=24, cxl_blocks=64, prefix_caching=False,
                                        policies={"preemption_strategy": "swap"}), blocks=64).start()
    try:
        engine, block = side.engine, side.engine.blocks.device.shape.bytes
        prompt_b = list(range(600, 650))
        reserved_a, reserved_b = side.reserved(len(PROMPT)), side.reserved(len(prompt_b), offset=4 * 4)
        push_a, push_b = await side.push(reserved_a), await side.push(reserved_b)
        engine.add("a", PROMPT, GREEDY, push=push_a)
        b = engine.add("b", prompt_b, GREEDY, push=push_b)
        engine.step(), engine.step()
        engine.step()
        assert engine.preemptions["swap"] == 1 and b.num_computed == 30
        assert await landed(push_a) is None
        engine.pushes_landed()
        engine.step()
        assert engine.last_pushed_bytes == 4 * 4 * block  # blocks 0-4, not 1-4
        assert await landed(push_b) is None
        for layer, remote in enumerate(reserved_b):
            assert torch.equal(side.pool[remote], engine.blocks.device.tensor[b.layers[layer].blocks])
        assert [f.finish_reason for f in engine.pushes_landed()] == ["length"]
        assert_all_blocks_free(engine)
    finally:
        await side.close()
