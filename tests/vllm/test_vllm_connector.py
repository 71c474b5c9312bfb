"""The kvmesh KV connector between two stock vLLM instances (vLLM's CPU build): prefill on one,
decode on the other, the prompt's KV pulled one-sided over the shm data plane (conftest's `pair`)."""

from __future__ import annotations

import time

import pytest

from kvmesh.bench.vllm_process import VllmProcess

from .conftest import SYNC_LOAD_TOKENS

BLOCK = 32
# Whole blocks and a last one partly full; pulled while other steps go on (100, 65) and inside the
# step that runs them (40, 33: up to conftest's SYNC_LOAD_TOKENS).
PROMPTS = [list(range(10, 10 + n)) for n in (100, 40, 65, 33)]
HOLD = {"do_remote_decode": True}


def prefill(producer: VllmProcess, prompts: list[list[int]]) -> list[dict]:
    result = producer.generate(prompts, max_tokens=1, params=[HOLD] * len(prompts))
    return result["kv_transfer_params"]


def pulled_blocks(prompt: list[int]) -> int:
    """The prompt's blocks a decode instance pulls: all of them, but a pull inside the request's step
    leaves out the KV of the last token (that step computes it again), so a block holding only it."""
    kv_tokens = len(prompt) - 1 if len(prompt) <= SYNC_LOAD_TOKENS else len(prompt)
    return -(-kv_tokens // BLOCK)


def wait_for_free(instance: VllmProcess, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = instance.ask("blocks")
        if blocks["free"] == blocks["total"] or time.monotonic() > deadline:
            return blocks
        time.sleep(0.1)


def test_1p1d_answers_as_one_instance_with_every_pulled_byte_in_place(pair):
    producer, consumer = pair
    held = prefill(producer, PROMPTS)
    assert [p["num_tokens"] for p in held] == [len(p) for p in PROMPTS]
    assert [len(p["remote_block_ids"]) for p in held] == [-(-len(p) // BLOCK) for p in PROMPTS]
    blocks = producer.ask("blocks")
    assert blocks["total"] - blocks["free"] == sum(len(p["remote_block_ids"]) for p in held)   # held for decode
    # Every block of the prompt is pulled; those before the last token's block, decoding never writes
    # (it computes the last token again and appends after it), so their bytes must stay the producer's.
    untouched = [len(p) - 1 >> 5 for p in PROMPTS]
    digests = [producer.ask("digest", blocks=p["remote_block_ids"][:n])["digest"] for p, n in zip(held, untouched)]

    decoded = consumer.generate(PROMPTS, max_tokens=8, params=held)
    for prompt, params, n, digest in zip(PROMPTS, held, untouched, digests):   # before the freed blocks are reused
        pulled = consumer.ask("pulled", request=params["remote_request_id"])
        assert len(pulled["blocks"]) == pulled_blocks(prompt) and pulled["bytes"] > 0
        assert consumer.ask("digest", blocks=pulled["blocks"][:n])["digest"] == digest
    assert decoded["outputs"] == consumer.generate(PROMPTS, max_tokens=8)["outputs"]   # one instance, colocated
    assert wait_for_free(producer)["free"] == blocks["total"]   # every COMPLETE freed its request's blocks
    assert wait_for_free(consumer)["free"] == blocks["total"]


def test_kv_no_decode_instance_takes_is_freed_when_its_lease_runs_out(pair):
    producer, consumer = pair
    held = prefill(producer, PROMPTS[:2])
    blocks = producer.ask("blocks")
    assert blocks["total"] - blocks["free"] == sum(len(p["remote_block_ids"]) for p in held)
    time.sleep(3.0)   # the producer's lease
    assert wait_for_free(producer)["free"] == blocks["total"]
    # A decode instance that comes too late reads blocks that may hold something else by now: the
    # producer refuses its COMPLETE, and the decode instance recomputes instead.
    late = consumer.generate(PROMPTS[:2], max_tokens=8, params=held)
    assert late["outputs"] == consumer.generate(PROMPTS[:2], max_tokens=8)["outputs"]
    assert wait_for_free(consumer)["free"] == consumer.ask("blocks")["total"]


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[1]], ids=["pulled-beside-steps", "pulled-in-its-step"])
def test_a_pull_from_a_prefill_instance_that_is_gone_is_recomputed(pair, prompt):
    producer, consumer = pair
    held = prefill(producer, [prompt])
    wrong = [{**held[0], "remote_address": "127.0.0.1:1"}]   # nobody listens there
    decoded = consumer.generate([prompt], max_tokens=8, params=wrong)
    assert decoded["outputs"] == consumer.generate([prompt], max_tokens=8)["outputs"]
    assert wait_for_free(producer, timeout_s=6.0)["free"] == producer.ask("blocks")["total"]   # its lease ran out
    assert wait_for_free(consumer)["free"] == consumer.ask("blocks")["total"]
