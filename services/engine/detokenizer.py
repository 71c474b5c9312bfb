"""Incremental detokenisation with stop strings: what text a client may be sent after each token.

Until the output ends, text is held back while it could still be the start of a stop string, and
while it ends in a partial UTF-8 character (the tokenizer shows those as U+FFFD)."""

from __future__ import annotations

from .request import Request


def advance_text(request: Request, tokenizer, final: bool) -> tuple[str, bool]:
    """Update `request.text` after a new token; returns (text to send now, whether a stop string
    ended the output). On a stop, the text is cut before the stop string."""
    stops = request.sampling.stop
    text = tokenizer.decode(request.output_ids, skip_special_tokens=True)
    stopped = False
    for stop in stops:
        at = text.find(stop, max(0, request.sent_chars - len(stop) + 1))
        if at != -1:
            text, stopped = text[:at], True
    request.text = text
    if stopped or final:
        ready = len(text)
    else:
        ready = len(text.rstrip("\ufffd")) - max((len(s) - 1 for s in stops), default=0)
    ready = max(ready, request.sent_chars)
    delta = text[request.sent_chars:ready]
    request.sent_chars = ready
    return delta, stopped
