"""The problems ready for timing, handed from the build to the timing threads while the build is still running.

`tune_workload` times a problem as soon as the last of its candidates' kernels is compiled (or found in the cache),
instead of after the whole workload's build: the GPU timing then runs beside the compiles that are still going. A
producer `put`s each problem once it is ready and `close`s the feed when the build has ended; each timing thread
`get`s the costliest ready problem (longest first spreads several GPUs evenly) and stops at None. `abort` ends the
feed at once (an interrupted build, a failed timing thread): waiting threads wake up and get None.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Callable, Generic, Iterable, Optional, TypeVar

P = TypeVar("P")


class ProblemFeed(Generic[P]):
    def __init__(self, cost: Optional[Callable[[P], float]] = None) -> None:
        """`cost(problem)` orders the ready problems, highest first; without it, first in, first out."""
        self._cost = cost
        self._cv = threading.Condition()
        self._heap: list = []
        self._order = itertools.count()
        self._closed = False
        self._aborted = False

    @classmethod
    def of(cls, problems: Iterable[P], cost: Optional[Callable[[P], float]] = None) -> "ProblemFeed[P]":
        """A closed feed holding `problems`: every one ready from the start."""
        feed = cls(cost)
        for p in problems:
            feed.put(p)
        feed.close()
        return feed

    def put(self, problem: P) -> None:
        """`problem` is ready to time (ignored once the feed is aborted)."""
        key = -self._cost(problem) if self._cost is not None else 0.0
        with self._cv:
            if self._aborted:
                return
            if self._closed:
                raise RuntimeError("a problem was put into a closed feed")
            heapq.heappush(self._heap, (key, next(self._order), problem))
            self._cv.notify()

    def close(self) -> None:
        """No more problems will come; `get` returns None once the ready ones are taken."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def abort(self) -> None:
        """Drop what is still waiting and end the feed now."""
        with self._cv:
            self._closed = self._aborted = True
            self._heap.clear()
            self._cv.notify_all()

    @property
    def aborted(self) -> bool:
        return self._aborted

    def get(self) -> Optional[P]:
        """The costliest ready problem, waiting for one if none is ready yet; None when the feed has ended."""
        with self._cv:
            while not self._heap and not self._closed:
                self._cv.wait()
            if not self._heap:
                return None
            return heapq.heappop(self._heap)[2]
