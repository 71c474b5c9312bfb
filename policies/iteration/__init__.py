"""The iteration scheduler the native engine and the simulator both run: state with no I/O, over the
seams of seams.py (issue 31: the simulator calls the engine's own decisions, not a copy of them)."""

from .hooks import Policies
from .scheduler import Plan, ScheduledChunk, Scheduler
from .seams import Blocks, Schedulable
from .status import Status

__all__ = ["Blocks", "Plan", "Policies", "Schedulable", "ScheduledChunk", "Scheduler", "Status"]
