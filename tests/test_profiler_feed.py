"""The feed of problems ready to time (profiler/feed.py): costliest ready problem first, a blocked taker woken by a
put, a close or an abort, and nothing handed out twice or after an abort."""

from __future__ import annotations

import threading
import time

import pytest

from cutlass_byoc.profiler.feed import ProblemFeed


def test_costliest_ready_first_then_none_once_closed():
    feed = ProblemFeed(cost=len)
    for p in ("bb", "a", "dddd", "ccc"):
        feed.put(p)
    feed.close()
    assert [feed.get() for _ in range(5)] == ["dddd", "ccc", "bb", "a", None]


def test_without_a_cost_first_in_first_out():
    feed = ProblemFeed.of(["x", "y", "z"])
    assert [feed.get(), feed.get(), feed.get(), feed.get()] == ["x", "y", "z", None]


def test_a_waiting_taker_gets_what_is_put_later():
    feed = ProblemFeed()
    got = []
    t = threading.Thread(target=lambda: got.extend(iter(feed.get, None)))
    t.start()
    time.sleep(0.05)
    assert t.is_alive() and not got  # waiting: nothing ready, not closed
    feed.put("p1")
    feed.put("p2")
    feed.close()
    t.join(5)
    assert not t.is_alive() and got == ["p1", "p2"]


def test_several_takers_share_the_problems_once():
    feed = ProblemFeed()
    got: list = []
    lock = threading.Lock()

    def take():
        while (p := feed.get()) is not None:
            with lock:
                got.append(p)

    takers = [threading.Thread(target=take) for _ in range(3)]
    for t in takers:
        t.start()
    for i in range(100):
        feed.put(i)
    feed.close()
    for t in takers:
        t.join(5)
    assert sorted(got) == list(range(100))


def test_abort_drops_the_rest_and_wakes_the_takers():
    feed = ProblemFeed()
    feed.put("left behind")
    feed.abort()
    assert feed.aborted and feed.get() is None
    feed.put("after the abort")  # ignored: the build may still be finishing
    assert feed.get() is None

    waiting = ProblemFeed()
    t = threading.Thread(target=waiting.get)
    t.start()
    time.sleep(0.05)
    waiting.abort()
    t.join(5)
    assert not t.is_alive()


def test_put_after_close_is_a_bug():
    feed = ProblemFeed()
    feed.close()
    with pytest.raises(RuntimeError, match="closed"):
        feed.put("late")
