"""One prefill engine's link (its NIC; on this machine its data-plane socket or shm), shared by the
transfers of all its pairs: each decode engine's pulls from it, or in push mode the writes to it.

On a pair's connection its transfers go first come, first served (link.py). The pairs with a
transfer under way split the bandwidth evenly (processor sharing): with n of them, each moves its
bytes at bandwidth / n, and every finish time moves when a transfer starts or ends. A transfer's
per-read cost is its own: it is not stretched. So a transfer with r seconds left of its alone time,
s of them bytes (the per-read time first, then the bytes), ends r + (n - 1) s later while n stays
the same; alone it ends `data_s` after its start, the same float as link.py's price.

The link is played forward from what has been queued: `add` queues transfers (a pull, or a prefill
step's pushed chunks) and says which owners' transfers now land at another time than it said before
(a transfer queued now slows those it overlaps, never speeds them). One that overlaps no other
pair's is priced in closed form, without a play."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
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
        self.queues: dict[Hashable, deque[Piece]] = {}    # pair -> its pieces not landed, the one under way first
        self.serving: dict[Hashable, tuple[float, float, float]] = {}  # pair -> (since, r, s) of its first
        self.last: dict[Hashable, Piece] = {}             # owner -> its last piece not landed

    def add(self, now: float, transfers: Iterable[tuple[Hashable, Hashable, Transfer, Sequence[float]]]
            ) -> list[tuple[Hashable, float]]:
        """Queue each (pair, owner, transfer, releases) on its pair's connection, in as many equal pieces
        as `releases` (each at or after `now`): a pull at once, a pushed chunk a layer at a time. The
        owners whose last piece now lands at another time (the new owners among them), and when."""
        self._serve(now, commit=True)
        alone, added = True, {}  # owners queued now, in order
        for pair, owner, transfer, releases in transfers:
            queue = self.queues.setdefault(pair, deque())
            first = max(releases[0], queue[-1].done) if queue else releases[0]
            alone = alone and all(other == pair or pieces[-1].done <= first for other, pieces in self.queues.items()
                                  if pieces)
            data_s, bytes_s = transfer.data_s / len(releases), transfer.bytes_s / len(releases)
            for release in releases:
                piece = Piece(release, data_s, bytes_s, owner)
                if alone:  # no other pair's transfer overlaps: first come, first served on its own
                    piece.done = (max(release, queue[-1].done) if queue else release) + piece.data_s
                queue.append(piece)
            self.last[owner] = queue[-1]
            added[owner] = None
        if alone:
            return [(owner, self.last[owner].done) for owner in added]
        before = {key: piece.done for key, piece in self.last.items()}
        self._serve(math.inf, commit=False)
        return [(key, piece.done) for key, piece in self.last.items() if key in added or piece.done != before[key]]

    def _serve(self, until: float, commit: bool) -> None:
        """Play the queued pieces forward to `until`, setting each landed piece's `done`; with `commit`
        the link moves there (the landed pieces leave), else only the pieces' times are set."""
        if commit and len(self.queues) == 1:
            return self._serve_one(until)
        queues, serving = self.queues, dict(self.serving)
        head = dict.fromkeys(queues, 0)  # each pair's first piece not landed in this play
        while True:
            n, end, ending = len(serving), math.inf, []
            for pair, (since, r, s) in serving.items():
                finish = since + r + (n - 1) * s
                if finish < end:
                    end, ending = finish, [pair]
                elif finish == end:
                    ending.append(pair)
            waiting = [(pieces[head[pair]].release, pair) for pair, pieces in queues.items()
                       if pair not in serving and head[pair] < len(pieces)]
            now = min(end, min(release for release, _ in waiting)) if waiting else end
            if now > until or now == math.inf:
                break
            starting = [pair for release, pair in waiting if release <= now]
            for pair in ending if end == now else ():
                pieces = queues[pair]
                pieces[head[pair]].done = now
                head[pair] += 1
                del serving[pair]
                if head[pair] < len(pieces) and pieces[head[pair]].release <= now:
                    starting.append(pair)
            if len(serving) + len(starting) != n:  # the share changes: those under way moved at 1 / n so far
                serving = {pair: _moved(state, now, n) for pair, state in serving.items()}
            for pair in starting:
                piece = queues[pair][head[pair]]
                serving[pair] = (now, piece.data_s, piece.bytes_s)
        if commit:
            for pair, landed in head.items():
                pieces = queues[pair]
                for _ in range(landed):
                    piece = pieces.popleft()
                    if self.last.get(piece.owner) is piece:
                        del self.last[piece.owner]
                if not pieces:
                    del queues[pair]
            self.serving = serving

    def _serve_one(self, until: float) -> None:
        """`_serve(until, commit=True)` when one pair has pieces: nothing shares from here on, so the
        pieces' times are the play's already (each starts at its release or when the one before it
        landed, and ends its data_s later) and the play comes down to taking the landed ones off."""
        (pair, pieces), = self.queues.items()
        landed = None
        while pieces and pieces[0].done <= until:
            piece = pieces.popleft()
            landed = piece.done
            if self.last.get(piece.owner) is piece:
                del self.last[piece.owner]
        if landed is not None:
            self.serving.pop(pair, None)
        if not pieces:
            del self.queues[pair]
        elif pair not in self.serving:
            piece = pieces[0]
            start = piece.release if landed is None else max(piece.release, landed)
            if start <= until:
                self.serving[pair] = (start, piece.data_s, piece.bytes_s)


def _moved(state: tuple[float, float, float], now: float, n: int) -> tuple[float, float, float]:
    """A transfer's (since, r, s) moved on to `now` at a share of 1 / n: its per-read time (r - s)
    at full speed first, then its bytes at the share."""
    since, r, s = state
    elapsed, reads = now - since, r - s
    if elapsed <= reads:
        return now, r - elapsed, s
    s = max(0.0, s - (elapsed - reads) / n)
    return now, s, s
