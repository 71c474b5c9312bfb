"""EngineLoop: the engine is built on the thread that steps it (one OpenMP team in the process, see
EngineLoop's docstring), and a build that fails fails `start()`."""

from __future__ import annotations

import threading

import pytest

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.services.engine.native.engine_loop import EngineLoop

from .conftest import engine_for


def test_the_engine_is_built_and_stepped_on_one_thread(tiny_checkpoint):
    built_on, delivered = [], []
    done = threading.Event()

    def build():
        built_on.append(threading.get_ident())
        return engine_for(tiny_checkpoint)

    def deliver(events):
        delivered.extend(events.frames)
        if any(frame.finish_reason for frame in events.frames):
            done.set()

    loop = EngineLoop(build, deliver)
    engine = loop.start()
    try:
        stepped_on = loop.call(lambda: (threading.get_ident(), None)).result(10)

        def add() -> None:
            engine.add("r0", [1, 2, 3], SamplingParams(max_tokens=4))
        loop.submit(add)
        assert done.wait(30)
    finally:
        loop.stop()
    assert built_on == [stepped_on] != [threading.get_ident()]
    assert sum(len(frame.token_ids) for frame in delivered) == 4
    state = engine.state()
    assert state.free_blocks == state.total_blocks


def test_a_build_that_fails_fails_start():
    def build():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineLoop(build, lambda events: None).start()
