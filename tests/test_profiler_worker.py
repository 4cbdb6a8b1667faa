"""The candidate runner survives crashing and hanging candidates; the checks and the winner rule (CPU only: the
GPU side of the worker is exercised in test_gpu_tune.py)."""

from __future__ import annotations

import math
import os
import time

import pytest

from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.config import LaunchConfig
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.profiler import worker as W
from cutlass_byoc.profiler.tune import pick_winner

from fake_profiler import serve_fake_worker  # noqa: E402

PROBLEM = Conv2dProblem.make("wgrad", 8, 64, 16, 16, 64, 3, padding=1)


def _launches(n: int) -> list[LaunchConfig]:
    ks = list(sm80_candidates(PROBLEM))[:n]
    return [LaunchConfig(k, 1) for k in ks]


def fake_gpu_worker(tasks, results, settings) -> None:
    """Stands in for the GPU worker: candidate i behaves as its index says (1: crashes the process, 3: hangs,
    4: wrong result, others: ok with time 10 + i; cuDNN's baseline, when asked for, 12.5)."""

    def answer(idx: int, launch: LaunchConfig) -> W.CandidateResult:
        if idx == 1:
            os._exit(7)  # a kernel that takes the process down
        if idx == 3:
            time.sleep(3600)
        if idx == 4:
            return W.CandidateResult(launch, W.WRONG, max_error=0.5, message="max error 0.5")
        return W.CandidateResult(launch, W.OK, 10.0 + idx, 10.0 + idx, 20, 2, 1e-4)

    serve_fake_worker(tasks, results, "Fake GPU", 12.5, answer)


def test_runner_survives_crash_and_hang():
    launches = _launches(6)
    settings = W.WorkerSettings(candidate_timeout_s=2.0, setup_timeout_s=20.0, start_timeout_s=60.0)
    with W.CandidateRunner(settings, target=fake_gpu_worker) as runner:
        assert runner.gpu == ("Fake GPU", 90)
        res = runner.evaluate(PROBLEM, launches)
        assert [r.status for r in res] == [W.OK, W.CRASHED, W.OK, W.TIMEOUT, W.WRONG, W.OK]
        assert [r.launch for r in res] == launches
        assert runner.restarts == 2
        assert "exited with code 7" in res[1].message
        assert runner.baseline_us is None  # not asked for
        # the worker is healthy again for the next problem
        again = runner.evaluate(PROBLEM, launches[:1])
        assert again[0].status == W.OK
        # cuDNN's time comes with the candidates when asked for, once, even across a restart
        res = runner.evaluate(PROBLEM, launches[:3], baseline=True)
        assert [r.status for r in res] == [W.OK, W.CRASHED, W.OK] and runner.baseline_us == 12.5
    win = pick_winner(res)
    assert win is res[0]


def test_winner_is_never_a_failed_or_zero_time_candidate():
    ls = _launches(5)
    res = [
        W.CandidateResult(ls[0], W.WRONG, 1.0),
        W.CandidateResult(ls[1], W.CRASHED),
        W.CandidateResult(ls[2], W.OK, 0.0),  # AITemplate's TIME:0 case
        W.CandidateResult(ls[3], W.OK, 9.0),
        W.CandidateResult(ls[4], W.BAD_TIMING, -1.0),
    ]
    assert pick_winner(res) is res[3]
    assert pick_winner(res[:3]) is None
    assert pick_winner([]) is None


def test_worker_start_failure_is_reported(monkeypatch):
    """Without a GPU the real worker cannot start; the error says so instead of hanging."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(W.WorkerError, match="CUDA"):
        with W.CandidateRunner(W.WorkerSettings(start_timeout_s=120)):
            pass


# ---------------------------------------------------------------------------------------------- verification
# (torch is imported inside the tests: the spawned fake worker imports this module and should start fast)


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_reference_and_compare_on_cpu(kind):
    torch = pytest.importorskip("torch")
    from cutlass_byoc.profiler.verify import compare, make_operand_set, poison, reference

    p = Conv2dProblem.make(kind, 2, 8, 9, 9, 16, 3, stride=2, padding=1, dtype="f32")
    gen = torch.Generator().manual_seed(0)
    ops = make_operand_set(p, "cpu", gen)
    assert ops.out.is_contiguous(memory_format=torch.channels_last)
    assert tuple(ops.out.shape) == {"fprop": (2, 16, 5, 5), "dgrad": (2, 8, 9, 9), "wgrad": (16, 8, 3, 3)}[kind]
    ref = reference(p, ops)
    # an independent computation through autograd
    x = ops.x.detach().double().requires_grad_(kind == "dgrad")
    w = ops.w.detach().double().requires_grad_(kind == "wgrad")
    y = torch.nn.functional.conv2d(x, w, None, 2, 1)
    if kind == "fprop":
        exact = y
    else:
        y.backward(ops.y.double())
        exact = x.grad if kind == "dgrad" else w.grad
    assert torch.allclose(ref.double(), exact, atol=1e-4, rtol=1e-4)

    ops.out.copy_(exact)
    assert compare(p, ops.out, ref).ok
    poison(ops.out)
    r = compare(p, ops.out, ref)
    assert not r.ok and "NaN" in r.message  # an unwritten output never passes
    ops.out.copy_(exact)
    ops.out[0, 0, 0, 0] += 10 * float(exact.abs().max())
    r = compare(p, ops.out, ref)
    assert not r.ok and r.max_error > 1


def test_fp16_tolerance_accepts_rounding_only():
    torch = pytest.importorskip("torch")
    from cutlass_byoc.profiler.verify import compare

    p = Conv2dProblem.make("fprop", 1, 8, 4, 4, 8, 1)
    ref = torch.randn(1, 8, 4, 4)
    assert compare(p, ref.half(), ref).ok
    wrong = ref.clone()
    wrong[0, 3] = 0  # one output channel missing
    assert not compare(p, wrong.half(), ref).ok
    assert math.isinf(compare(p, torch.full_like(ref, float("inf")).half(), ref).max_error)
