"""The predictor's sentence encoder: batching texts by length changes no embedding and keeps their order."""

from __future__ import annotations

import torch

from kvmesh.services.predictor.encoder import DIM, encoder


def test_a_batch_of_mixed_lengths_embeds_each_text_as_alone_and_in_order():
    texts = ["a long prompt about distributed key value caches " * 30, "hi", "what is the capital of France?",
             "", "summarise this: " + "tokens " * 300, "hi"]
    together = encoder()(texts)
    alone = torch.cat([encoder()([text]) for text in texts])
    assert together.shape == (len(texts), DIM)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)
    assert torch.equal(together[1], together[5])  # the same text twice, the same row


def test_no_texts_is_an_empty_batch():
    assert encoder()([]).shape == (0, DIM)
