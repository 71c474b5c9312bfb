"""The CaR benchmark's workloads (CaR IV), synthesised: no data set is downloaded.

- Multi-turn conversations: each turn's prompt is the conversation so far (every earlier message
  and answer) plus a new message, so a turn can reuse all of the previous turn's KV. User messages
  are log-normal around ShareGPT's mean prompt (161 tokens, vLLM Fig. 11) scaled by 1/2, answers a
  fixed ANSWER_LEN tokens (generated, so the next turn's history holds the model's own tokens).
- Shared system prompts: a few long system prompts, each request one of them (Zipf-like: the first
  most often) plus a short user message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .workloads import END_ID, FIRST_ID, Lengths

ANSWER_LEN = 32
MESSAGE = Lengths(mean=80.0, sigma=0.5, low=16, high=256)
USER = Lengths(mean=40.0, sigma=0.4, low=8, high=128)


@dataclass(frozen=True)
class Conversation:
    messages: list[list[int]]   # the user's turns, in order


def conversations(n: int, turns: int, seed: int = 0) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    return [Conversation([rng.integers(FIRST_ID, END_ID, int(m)).tolist() for m in MESSAGE.sample(rng, turns)])
            for _ in range(n)]


def system_prompt_requests(n: int, prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """n prompts: one of `prompts` system prompts of `prompt_len` tokens (the k-th with weight 1/(k+1))
    followed by a user message."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(FIRST_ID, END_ID, prompt_len).tolist() for _ in range(prompts)]
    weights = 1 / np.arange(1, prompts + 1)
    picks = rng.choice(prompts, size=n, p=weights / weights.sum())
    return [systems[k] + rng.integers(FIRST_ID, END_ID, int(u)).tolist() for k, u in zip(picks, USER.sample(rng, n))]


def final_context(conversation: Conversation) -> int:
    """Tokens of the conversation's last turn, its answer included."""
    return sum(len(m) for m in conversation.messages) + ANSWER_LEN * len(conversation.messages)
