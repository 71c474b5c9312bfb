"""One prefill engine's link (its NIC; on this machine its data-plane socket or shm), shared by the
transfers of all its pairs: each decode engine's pulls from it, or in push mode the writes to it.

On a pair's connection its transfers go first come, first served (link.py). The pairs with a
transfer under way split the bandwidth evenly (processor sharing): with n of them, each moves its
bytes at bandwidth / n, and every finish time moves when a transfer starts or ends. A transfer's
per-read cost is its own: it is not stretched. So a transfer with r seconds left of its alone time,
s of them bytes (the per-read time first, then the bytes), ends r + (n - 1) s later while n stays
the same; alone it ends `data_s` after its start, the same float as link.py's price.

The link is played forward from what has been queued: `add` queues a transfer and says which owners'
transfers now land at another time than it said before (a transfer queued now slows those under way,
never speeds them)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .link import Transfer


@dataclass(slots=True, eq=False)
class Piece:
    """A transfer, or one layer's share of a pushed chunk's writes."""

    release: float        # when it is queued on its pair's connection
    data_s: float         # its time alone
    bytes_s: float        # the part of it the sharing stretches
    owner: Hashable
    done: float = math.inf  # when it lands, as played forward from what is queued


class SharedLink:
    def __init__(self) -> None:
        self.at = 0.0                                     # the time `serving` is at
        self.queues: dict[Hashable, deque[Piece]] = {}    # pair -> its pieces not landed, the one under way first
        self.serving: dict[Hashable, tuple[float, float, float]] = {}  # pair -> (since, r, s) of its first
        self.last: dict[Hashable, Piece] = {}             # owner -> its last piece not landed

    def add(self, now: float, pair: Hashable, owner: Hashable, transfer: Transfer,
            releases: Sequence[float]) -> list[tuple[Hashable, float]]:
        """Queue `transfer` on `pair`'s connection in as many equal pieces as `releases` (each at or
        after `now`): a pull at once, a pushed chunk a layer at a time. The owners whose last piece now
        lands at another time (the new owner among them), and when."""
        self._serve(now, commit=True)
        queue = self.queues.setdefault(pair, deque())
        first = max(releases[0], queue[-1].done) if queue else releases[0]
        alone = all(other is pair or not pieces or pieces[-1].done <= first for other, pieces in self.queues.items())
        for release in releases:
            piece = Piece(release, transfer.data_s / len(releases), transfer.bytes_s / len(releases), owner)
            if alone:  # no other pair's transfer overlaps: first come, first served on its own
                piece.done = (max(release, queue[-1].done) if queue else release) + piece.data_s
            queue.append(piece)
        self.last[owner] = queue[-1]
        if alone:
            return [(owner, queue[-1].done)]
        before = {key: piece.done for key, piece in self.last.items()}
        self._serve(math.inf, commit=False)
        return [(key, piece.done) for key, piece in self.last.items() if piece.done != before[key]]

    def _serve(self, until: float, commit: bool) -> None:
        """Play the queued pieces forward to `until`, setting each landed piece's `done`; with `commit`
        the link moves there (the landed pieces leave), else only the pieces' times are set."""
        queues, serving, at = self.queues, dict(self.serving), self.at
        head = dict.fromkeys(queues, 0)  # each pair's first piece not landed in this play
        while True:
            n, end, ending = len(serving), math.inf, []
            for pair, (since, r, s) in serving.items():
                finish = since + r + (n - 1) * s
                if finish < end:
                    end, ending = finish, [pair]
                elif finish == end:
                    ending.append(pair)
            start = min((pieces[head[pair]].release for pair, pieces in queues.items()
                         if pair not in serving and head[pair] < len(pieces)), default=math.inf)
            now = min(end, start)
            if now > until or now == math.inf:
                break
            for pair in ending if end == now else ():
                queues[pair][head[pair]].done = now
                head[pair] += 1
                del serving[pair]
            starting = [pair for pair, pieces in queues.items()
                        if pair not in serving and head[pair] < len(pieces) and pieces[head[pair]].release <= now]
            if len(serving) + len(starting) != n:  # the share changes: those under way moved at 1 / n so far
                serving = {pair: _moved(state, now, n) for pair, state in serving.items()}
            for pair in starting:
                piece = queues[pair][head[pair]]
                serving[pair] = (now, piece.data_s, piece.bytes_s)
            at = now
        if commit:
            for pair, landed in head.items():
                pieces = queues[pair]
                for _ in range(landed):
                    piece = pieces.popleft()
                    if self.last.get(piece.owner) is piece:
                        del self.last[piece.owner]
                if not pieces:
                    del queues[pair]
            self.serving, self.at = serving, at


def _moved(state: tuple[float, float, float], now: float, n: int) -> tuple[float, float, float]:
    """A transfer's (since, r, s) moved on to `now` at a share of 1 / n: its per-read time (r - s)
    at full speed first, then its bytes at the share."""
    since, r, s = state
    elapsed, reads = now - since, r - s
    if elapsed <= reads:
        return now, r - elapsed, s
    s = max(0.0, s - (elapsed - reads) / n)
    return now, s, s
