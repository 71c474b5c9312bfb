"""Admission's backlog: the wait a new request can expect for the requests ahead of it to get their
first tokens, pending / rate (Little's law), with time as an argument."""

from __future__ import annotations

import contextlib

import pytest

from kvmesh.services.admission.limits import Backlog


def _answered(backlog: Backlog, times: list[float]) -> None:
    """Requests that came in and got their first tokens at `times`."""
    for now in times:
        with backlog.waiting() as first_token:
            first_token(now)


def test_without_enough_first_tokens_there_is_no_estimate():
    backlog = Backlog(window_s=10.0, min_firsts=4)
    _answered(backlog, [0.0, 1.0, 2.0])
    with backlog.waiting():
        assert backlog.pending == 1
        assert backlog.expected_wait_s(2.5) is None


def test_the_wait_is_pending_over_the_rate_of_first_tokens_in_the_window():
    backlog = Backlog(window_s=10.0, min_firsts=4)
    _answered(backlog, [float(t) for t in range(20)])  # one a second for 20 s: 10 in the last window
    with contextlib.ExitStack() as ahead:
        for _ in range(5):
            ahead.enter_context(backlog.waiting())
        assert backlog.expected_wait_s(19.5) == pytest.approx(5 / (10 / 10.0))
    assert backlog.pending == 0 and backlog.expected_wait_s(19.5) == 0.0


def test_until_a_window_has_passed_the_rate_is_over_the_time_since_the_first_first_token():
    backlog = Backlog(window_s=10.0, min_firsts=4)
    _answered(backlog, [100.0, 100.5, 101.0, 101.5])  # 4 in the 2 s since the first
    with backlog.waiting(), backlog.waiting():
        assert backlog.expected_wait_s(102.0) == pytest.approx(2 / (4 / 2.0))
        # and never over less than a second: 4 at once is not a rate of thousands
        burst = Backlog(window_s=10.0, min_firsts=4)
        _answered(burst, [5.0] * 4)
        with burst.waiting():
            assert burst.expected_wait_s(5.001) == pytest.approx(1 / (4 / 1.0))


def test_first_tokens_older_than_the_window_no_longer_count():
    backlog = Backlog(window_s=10.0, min_firsts=4)
    _answered(backlog, [0.0, 1.0, 2.0, 3.0])
    with backlog.waiting():
        assert backlog.expected_wait_s(5.0) is not None
        assert backlog.expected_wait_s(12.5) is None  # three left the window: too few to tell


def test_only_the_first_mark_counts_and_a_request_that_ends_without_one_leaves_the_backlog():
    backlog = Backlog(window_s=10.0, min_firsts=1)
    with backlog.waiting() as first_token:
        first_token(1.0)
        first_token(1.5)  # a request run again after a failure marks again: ignored
        assert backlog.pending == 0
    with pytest.raises(RuntimeError), backlog.waiting():
        raise RuntimeError("the engine failed before the first token")
    assert backlog.pending == 0
    assert backlog.expected_wait_s(2.0) == 0.0
