"""Requests' views for a policy, each built when the policy first reads it. A step hands the admission
policy every running request's view, and FCFS reads none of them: built on demand, they cost only the
policies that read them (LayerKV's Eq. 1), and each policy still sees the requests as they are at
its call, since it reads them during the call."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..views import RequestView
from .seams import Schedulable


class ViewList(Sequence[RequestView]):
    __slots__ = ("_requests", "_views")

    def __init__(self, requests: Sequence[Schedulable]):
        self._requests = tuple(requests)
        self._views: list[RequestView | None] = [None] * len(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        view = self._views[index]
        if view is None:
            view = self._views[index] = self._requests[index].view()
        return view

    def __iter__(self) -> Iterator[RequestView]:
        return (self[i] for i in range(len(self)))
