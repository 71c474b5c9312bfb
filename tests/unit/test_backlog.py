"""Admission's backlog: the wait a new request can expect for the requests ahead of it to get their
first tokens, pending over the rate of first tokens per busy second (a second with a request held),
with time as an argument."""

from __future__ import annotations

import pytest

from kvmesh.services.admission.limits import Backlog


def _served(backlog: Backlog, spans: list[tuple[float, float]]) -> None:
    """Requests held from each span's start to their first token at its end, one after another."""
    for start, first in spans:
        backlog.join(start)
        backlog.answered(first)


def test_without_enough_first_tokens_there_is_no_estimate():
    backlog = Backlog(window_s=10.0, min_firsts=4)
    _served(backlog, [(0.0, 0.1), (1.0, 1.1), (2.0, 2.1)])
    backlog.join(2.4)
    assert backlog.pending == 1
    assert backlog.expected_wait_s(2.5) is None


def test_at_light_load_the_wait_is_the_service_time_not_the_gap_between_arrivals():
    """One request a second, each given its first token in 0.1 s: one ahead means a wait of about
    0.1 s. Per second of the window (10 first tokens in 10 s) it would read 1 s, and a TTFT SLO of
    500 ms would refuse every request that came in behind another."""
    backlog = Backlog(window_s=10.0, min_firsts=4)
    _served(backlog, [(float(t), t + 0.1) for t in range(10)])
    backlog.join(10.0)
    # the window [0.05, 10.05]: 10 first tokens (0.1 to 9.1); held 0.05 + 9 * 0.1 + 0.05 s of it
    assert backlog.expected_wait_s(10.05) == pytest.approx(1 * 1.0 / 10)


def test_under_overload_every_second_is_busy_and_the_rate_is_the_throughput():
    backlog = Backlog(window_s=10.0, min_firsts=4)
    for _ in range(6):
        backlog.join(0.0)          # six held from the start, more than the cluster answers
    for t in range(1, 20):         # one first token a second, one more arriving each
        backlog.answered(float(t))
        backlog.join(float(t))
    assert backlog.pending == 6
    assert backlog.expected_wait_s(19.5) == pytest.approx(6 * 10.0 / 10)  # firsts 10 to 19, busy 10 s


def test_first_tokens_and_busy_time_older_than_the_window_no_longer_count():
    backlog = Backlog(window_s=10.0, min_firsts=4)
    _served(backlog, [(0.0, 0.5), (1.0, 1.5), (2.0, 2.5), (3.0, 3.5)])
    backlog.join(5.0)
    assert backlog.expected_wait_s(5.0) == pytest.approx(1 * 2.0 / 4)
    assert backlog.expected_wait_s(12.6) is None  # three left the window: too few to tell


def test_only_the_first_mark_counts_and_a_request_that_ends_without_one_leaves_the_backlog():
    backlog = Backlog(window_s=10.0, min_firsts=1)
    times = iter([0.5, 3.0, 3.5])
    with backlog.waiting(lambda: next(times)) as first_token:
        first_token(1.0)
        first_token(1.5)  # a request run again after a failure marks again: ignored
        assert backlog.pending == 0
    with pytest.raises(RuntimeError), backlog.waiting(lambda: next(times)):
        raise RuntimeError("the engine failed before the first token")
    assert backlog.pending == 0
    backlog.join(4.0)
    # one first token in the window; held 0.5 s until it, 0.5 s by the one that failed, 0.5 s now
    assert backlog.expected_wait_s(4.5) == pytest.approx(1 * 1.5 / 1)
