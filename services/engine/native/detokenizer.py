"""Incremental detokenisation with stop strings: what text a client may be sent after each token.

Each token is decoded with the one or two before it as context, and only the difference is kept
(as vLLM does), so a step costs the same however long the output grows, and tokenizers that drop
a word's leading space at the start of a decode still render it. A token that ends in a partial
UTF-8 character waits for the next one. Until the output ends, text that could be the start of a
stop string is held back."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .request import Request


def advance_text(request: Request, tokenizer, final: bool) -> tuple[str, bool]:
    """Extend `request.text` with the newest token; returns (text to send now, whether a stop
    string ended the output). On a stop, the text is cut before the stop string."""
    ids = request.output_ids
    decode = _decoder(tokenizer)
    before = decode(ids[request.prefix_offset:request.read_offset], skip_special_tokens=True)
    after = decode(ids[request.prefix_offset:], skip_special_tokens=True)
    if final or (len(after) > len(before) and not after.endswith("\ufffd")):
        request.text += after[len(before):]
        request.prefix_offset, request.read_offset = request.read_offset, len(ids)
    stops = request.sampling.stop
    stopped = False
    for stop in stops:
        at = request.text.find(stop, max(0, request.sent_chars - len(stop) + 1))
        if at != -1:
            request.text, stopped = request.text[:at], True
    held = 0 if stopped or final or not stops else max(len(s) for s in stops) - 1  # could begin a stop string
    ready = max(len(request.text) - held, request.sent_chars)
    delta = request.text[request.sent_chars:ready]
    request.sent_chars = ready
    return delta, stopped


def _decoder(tokenizer):
    """The tokenizer's decode, or the same text straight from a fast tokenizer's Rust backend (0.8
    against 2.5 us a call) when the transformers wrapper would only pass the ids through: its
    decode not overridden and no clean-up of spaces to apply."""
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces):
        return tokenizer.backend_tokenizer.decode
    return tokenizer.decode
