"""The CacheOpt benchmark's synthetic traces: Table 1's shapes, scaled, and a length signal in the wording."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.bench.cacheopt_traces import SCALE, TASKS, TRACES
from kvmesh.bench.workloads import END_ID, FIRST_ID


@pytest.mark.parametrize("name", sorted(TRACES))
def test_lengths_follow_the_scaled_table(name):
    trace = TRACES[name]
    requests = trace.requests(2000, seed=0)
    prompts = np.array([len(r.prompt_ids) for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert trace.prompt.low <= prompts.min() and prompts.max() <= trace.prompt.high
    assert trace.output.low <= outputs.min() and outputs.max() <= trace.output.high
    # Clipping moves the means a little; they stay near Table 1's, scaled.
    assert outputs.mean() == pytest.approx(trace.paper[1] * SCALE, rel=0.2)
    assert all(FIRST_ID <= i < END_ID for r in requests[:50] for i in r.prompt_ids)
    assert requests[:5] == trace.requests(2000, seed=0)[:5]


def test_the_wording_carries_the_length():
    requests = TRACES["sharegpt"].requests(2000, seed=0)
    by_task = {task: [r.output_len for r in requests if r.text.startswith(task)] for task, _ in TASKS}
    shortest, longest = np.mean(by_task[TASKS[0][0]]), np.mean(by_task[TASKS[-1][0]])
    assert longest > 5 * shortest
