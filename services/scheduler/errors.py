"""The scheduler's errors of its own; its bodies are libs/messages/scheduler.py."""

from __future__ import annotations

from kvmesh.libs.controlplane import NotFound, ServiceUnavailable


class NoEngine(ServiceUnavailable):
    """No live engine serves the model now (or every one that does was excluded)."""

    type = "no_engine"


class UnknownModel(NotFound):
    """No engine has served the model since the scheduler started: the caller asked for the wrong one."""

    type = "model_not_found"
