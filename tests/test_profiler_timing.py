"""profiler.timing.time_gpu against a simulated GPU stream (no GPU needed): the spin that keeps the GPU busy while the
host enqueues the timed runs must outlast the enqueueing, or a run's events take in host time. The simulation keeps
one host clock and the time the GPU's queue is busy until; an event is reached when it has been recorded and the
work before it has run."""

from __future__ import annotations

import pytest
import torch

from cutlass_byoc.profiler import timing

EVENT_HOST_US = 4.0  # host time of one event record


class Stream:
    def __init__(self):
        self.host = 0.0  # us
        self.gpu = 0.0  # the queue is busy until then (us)

    def enqueue(self, gpu_us: float) -> float:
        start = max(self.gpu, self.host)
        self.gpu = start + gpu_us
        return start


@pytest.fixture
def stream(monkeypatch):
    s = Stream()

    class Event:
        def __init__(self, enable_timing: bool = False):
            self.at = None

        def record(self):
            s.host += EVENT_HOST_US
            self.at = s.enqueue(0.0)

        def query(self):
            return self.at is not None and self.at <= s.host

        def elapsed_time(self, end):
            return (end.at - self.at) / 1000.0

    def synchronize():
        s.host = max(s.host, s.gpu)

    def sleep(cycles):
        s.host += 1.0
        s.enqueue(cycles / timing.GPU_CYCLES_PER_US)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: s.host / 1e6)
    return s


def kernel(stream: Stream, gpu_us: float, host_us):
    """fn(i) for time_gpu: `host_us(call)` of host work, then one launch of `gpu_us` on the stream."""
    calls = []

    def fn(i: int) -> None:
        calls.append(i)
        stream.host += host_us(len(calls))
        stream.enqueue(gpu_us)

    return fn, calls


def test_a_cheap_launch_is_timed_on_the_gpu_alone(stream):
    """1 us of GPU time, 2 us of host work and 8 of event records a run: the GPU drains the queue ten times faster than
    the host fills it, so the spin must hold 9 us a run. Sized from the launch's host time alone (about 4 us a run, as
    before the warm-up recorded events) it ran out part-way and the later runs took in host time (a mean of 3 us here);
    sized from the warm-up's runs with their events (15 us a run), every run sees only its 1 us."""
    fn, _ = kernel(stream, 1.0, lambda n: 2.0)
    st = timing.time_gpu(fn, 4)
    assert st.median_us == pytest.approx(1.0) and st.min_us == pytest.approx(1.0) and st.mean_us == pytest.approx(1.0)
    assert st.spin_retries == 0 and not st.host_bound
    assert st.iters == timing.TimingSettings().max_iters


def test_a_spin_that_ran_out_is_doubled_and_the_runs_timed_again(stream):
    """The host slows down after the warm-up (3 -> 40 us a launch, against 12 us of GPU time): the first spin runs
    out, the query behind it says so, and the runs are timed again behind longer spins until one holds."""
    warm = 1 + timing.TimingSettings().warmup
    fn, calls = kernel(stream, 12.0, lambda n: 3.0 if n <= warm else 40.0)
    st = timing.time_gpu(fn, 4)
    # spins of 16.5, 33, then 66 us a run, against the 36 us a run by which the host now falls behind the GPU
    assert st.spin_retries == 2 and not st.host_bound
    assert st.median_us == pytest.approx(12.0) and st.mean_us == pytest.approx(12.0)
    assert len(calls) == warm + 3 * st.iters


def test_a_host_bound_run_says_so(stream):
    """A launch whose host time no spin can cover (MAX_SPIN_US) is timed at most MAX_SPIN_TRIES times and flagged:
    its runs took in host time."""
    fn, _ = kernel(stream, 12.0, lambda n: 20.0 if n <= 1 + timing.TimingSettings().warmup else 5000.0)
    st = timing.time_gpu(fn, 4)
    assert st.host_bound and 1 <= st.spin_retries <= timing.MAX_SPIN_TRIES - 1
    assert st.median_us > 12.0 + 1000.0
    assert st.to_dict()["host_bound"] is True
