"""Admission's decisions at the front door, without I/O: a token bucket per API key (`rate_limit`),
the bounded queue in front of the engines (`queue`: who runs, who waits, who is refused, who takes a
freed slot), the wait a new request can expect for its first token and when that refuses it
(`backlog`), and admission's default limits (`limits`). The admission service carries them out with
its clock and its HTTP answers; the simulator's front door (sim/front_door.py) with simulated time."""

from .backlog import Backlog, behind_by
from .limits import AdmissionLimits
from .queue import Admit, AdmissionQueue
from .rate_limit import RateLimiter, TokenBucket

__all__ = ["Admit", "AdmissionLimits", "AdmissionQueue", "Backlog", "RateLimiter", "TokenBucket", "behind_by"]
