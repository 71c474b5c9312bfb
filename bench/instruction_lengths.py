"""Natural output lengths: the default model's own answers to real instructions, generated once.

`bench/data/instructions.jsonl` holds 640 user instructions in 13 categories (a factual question up
to a story, a quarter with a passage, email or code of their own), written without any wording that
states how long the answer should be. This script serves each one to SmolLM2-135M-Instruct in the
native engine, chat template applied, greedy, up to MAX_OUTPUT tokens, and writes what the model did
to `bench/data/instruction_lengths.jsonl`, line for line: the prompt's tokens, the answer's tokens,
and whether it ended on EOS ("stop") or at the cap ("length", 40% of them: the 135M model often
runs on; the cap stands for a request's max_tokens). The benchmarks whose length predictor must learn a
length from a prompt's text (cacheopt, layerkv) replay these lengths: the signal is what the model
does with such a request, not a phrase planted in the prompt.

Greedy decoding makes the file a function of the model, the engine's arithmetic and the
instructions. Regenerate (~15 min on two cores) with:

    .venv/bin/python -m kvmesh.bench.instruction_lengths
"""

from __future__ import annotations

import json

import torch
from tqdm import tqdm

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.native.factory import build_engine

from .instruction_trace import INSTRUCTIONS, LENGTHS, read

MAX_OUTPUT = 512


def main() -> None:
    torch.manual_seed(0)
    instructions = read(INSTRUCTIONS)
    engine = build_engine(EngineConfig(torch_threads=2))
    params = SamplingParams(max_tokens=MAX_OUTPUT, temperature=0.0)
    requests = []
    for i, item in enumerate(instructions):
        messages = [{"role": "user", "content": item["instruction"]}]
        rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = engine.tokenizer.encode(rendered, add_special_tokens=False)   # as admission encodes a chat
        requests.append(engine.add(str(i), prompt, params))
    with tqdm(total=len(requests), desc="answering", unit="request") as progress:
        done = 0
        while engine.scheduler.has_work():
            engine.step()
            finished = sum(r.finished for r in requests)
            progress.update(finished - done)
            done = finished
    rows = [{"prompt_tokens": len(r.prompt_ids), "output_tokens": len(r.output_ids), "finish_reason": r.finish_reason}
            for r in requests]
    LENGTHS.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    stopped = [row["output_tokens"] for row in rows if row["finish_reason"] == "stop"]
    print(f"{len(rows)} answers, {len(stopped)} ended on EOS; mean {sum(r['output_tokens'] for r in rows) / len(rows):.1f} "
          f"tokens -> {LENGTHS}")


if __name__ == "__main__":
    main()
