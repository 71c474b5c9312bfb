"""Sampling: greedy, temperature, top-k, top-p, seeds, logprobs; and text with stop strings."""

from __future__ import annotations

import math

import torch

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.services.engine.native.detokenizer import advance_text
from kvmesh.services.engine.native.request import Request
from kvmesh.services.engine.native.sampling import sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])


def draw(params: SamplingParams, n: int = 400, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [sample(LOGITS, [params], [generator])[0][0] for _ in range(n)]


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    tokens, logprobs = sample(torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]]),
                              [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.0)],
                              [None, None])
    assert tokens == [1, 0] and logprobs[1] is None
    assert math.isclose(logprobs[0], torch.log_softmax(torch.tensor([0.0, 3.0, 1.0]), 0)[1].item(), rel_tol=1e-6)


def test_top_k_and_top_p_keep_only_the_head_of_the_distribution():
    assert set(draw(SamplingParams(top_k=2))) == {0, 1}
    probs = torch.softmax(LOGITS[0], 0)  # 0.61, 0.22, 0.14, ...: top_p 0.7 keeps the first two
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert set(draw(SamplingParams(top_p=0.7))) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.5))) == {0}


def test_temperature_flattens_or_sharpens():
    hot = draw(SamplingParams(temperature=5.0))
    cold = draw(SamplingParams(temperature=0.2))
    assert len(set(hot)) == 5 and cold.count(0) > 390


def test_same_seed_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(LOGITS, [params], [torch.Generator().manual_seed(7)])[0][0]]
    generator = torch.Generator().manual_seed(7)
    batched = sample(torch.cat([LOGITS, LOGITS]), [SamplingParams(temperature=0.0), params], [None, generator])[0]
    assert batched[1] == alone[0]


class CharTokenizer:
    """Token i is chr(i); enough to test text handling without a model."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_string_cuts_the_text_and_is_never_sent():
    request = Request("r", [1], SamplingParams(stop=("END",)), 0.0, 1)
    sent = ""
    for ch in "hello EN":
        request.output_ids.append(ord(ch))
        delta, stopped = advance_text(request, CharTokenizer(), final=False)
        sent += delta
        assert not stopped
    assert sent == "hello "  # "EN" held back: it may start the stop string
    request.output_ids.append(ord("D"))
    delta, stopped = advance_text(request, CharTokenizer(), final=False)
    assert stopped and sent + delta == "hello " and request.text == "hello "


class ByteTokenizer:
    """Token i is byte i: multi-byte characters span tokens, as in byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_partial_characters_are_held_until_complete():
    request = Request("r", [1], SamplingParams(), 0.0, 1)
    sent = []
    for byte in "aé€".encode():
        request.output_ids.append(byte)
        sent.append(advance_text(request, ByteTokenizer(), final=False)[0])
    assert sent == ["a", "", "é", "", "", "€"] and request.text == "aé€"


def test_incremental_text_equals_decoding_everything_at_once():
    text = "kv caches move engine to engine — ünïcödé too"
    request = Request("r", [1], SamplingParams(), 0.0, 1)
    sent = ""
    for byte in text.encode():
        request.output_ids.append(byte)
        sent += advance_text(request, ByteTokenizer(), final=False)[0]
    assert sent == text


def test_sampling_draws_each_token_with_its_probability_and_never_a_masked_one():
    """The batched inverse-CDF draw: frequencies within 4 sigma of the probabilities over 20,000 draws
    of a 5-token distribution with one token masked out (probability 0), on one generator."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.15, 0.05]]).repeat(20_000, 1)
    generator = torch.Generator().manual_seed(3)
    from kvmesh.services.engine.native.sampling import _inverse_cdf

    drawn = _inverse_cdf(probs, [generator] * len(probs))
    counts = torch.bincount(drawn, minlength=5).double() / len(probs)
    assert counts[1] == 0
    sigma = (probs[0] * (1 - probs[0]) / len(probs)).sqrt()
    assert ((counts - probs[0].double()).abs() <= 4 * sigma + 1e-12).all(), counts
