"""Tuning on the GPU: a cold tune records checked winners, a second tune compiles and times nothing, a wrong
output never passes the check, and bench compares against cuDNN in the same process.

Kernels come from the session's shared kernel cache (CUTLASS_BYOC_TEST_CACHE_DIR reuses a warm one); decisions go
to a private store per test, so each test starts from a cold decision cache."""

from __future__ import annotations

import json

import pytest

from conftest import gpu_skip_reason
from cutlass_byoc.decisions import DecisionStore
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.profiler import worker as W
from cutlass_byoc.profiler.tune import CACHED, TUNED, tune_workload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_skip_reason() is not None, reason=gpu_skip_reason() or "")]

PROBLEMS = [
    Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1),
    Conv2dProblem.make("wgrad", 8, 64, 28, 28, 64, 3, padding=1),
]

#: the training step compiled with select="tune" (test_backend_tunes_a_graphs_problems_as_it_compiles)
BACKEND_BATCH, BACKEND_CHANNELS, BACKEND_IMAGE = 8, 16, 32


def backend_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(BACKEND_CHANNELS, 48, 3, padding=1, bias=False), torch.nn.ReLU())


def backend_kernels():
    """What select="tune" plans for backend_model's training step (its problems traced on fake tensors, as the
    backend partitions them; the default budget): scripts/warm_cache.py compiles them ahead of the GPU round."""
    from cutlass_byoc.offload.trace import model_problems
    from cutlass_byoc.profiler.plan import DEFAULT_MAX_CANDIDATES, plan_workload

    problems, _ = model_problems(backend_model(), BACKEND_BATCH, training=True, image=BACKEND_IMAGE,
                                 in_channels=BACKEND_CHANNELS)
    return list(plan_workload(problems, DEFAULT_MAX_CANDIDATES).kernels)


@pytest.fixture
def env(shared_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(shared_cache.root))
    return shared_cache, DecisionStore(tmp_path / "decisions-root")


def test_cold_tune_then_nothing_to_do(env):
    cache, store = env
    rep = tune_workload(PROBLEMS, max_candidates=2, cache=cache, store=store)
    assert rep.timed and rep.gpu is not None and rep.gpu.arch == 90
    for o in rep.outcomes:
        assert o.status == TUNED, (o.problem.name, o.message, [r.to_dict() for r in o.results])
        assert o.time_us and o.time_us > 0
        win = [r for r in o.results if r.launch == o.launch][0]
        assert win.status == W.OK and win.max_error is not None and win.max_error < 1e-2
        assert win.iters >= 20 and win.rotations >= 1
        ok_times = [r.median_us for r in o.results if r.ok]
        assert o.time_us == min(ok_times)
    records = [json.loads(l) for l in rep.log_path.read_text().splitlines()]
    assert sum(1 for r in records if r["event"] == "candidate") == sum(len(o.results) for o in rep.outcomes)

    again = tune_workload(PROBLEMS, max_candidates=2, cache=cache, store=store)
    assert [o.status for o in again.outcomes] == [CACHED, CACHED]
    assert again.kernels_compiled == 0 and again.launches_timed == 0 and again.log_path is None
    assert [o.launch for o in again.outcomes] == [o.launch for o in rep.outcomes]


def test_wrong_output_never_passes(env):
    import torch

    from cutlass_byoc.heuristics import default_launch
    from cutlass_byoc.profiler.verify import make_operand_set, reference

    p = PROBLEMS[0]
    launch = default_launch(p)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    sets = [make_operand_set(p, dev, g)]
    other = make_operand_set(p, dev, g)
    right = W.evaluate_candidate(p, launch, sets, reference(p, sets[0]), W.TimingSettings(min_iters=5, max_iters=5))
    assert right.status == W.OK, right.message
    wrong = W.evaluate_candidate(p, launch, sets, reference(p, other), W.TimingSettings(min_iters=5, max_iters=5))
    assert wrong.status == W.WRONG and wrong.median_us is None


def test_timing_is_positive_and_rotates():
    import torch

    from cutlass_byoc.profiler.timing import TimingSettings, l2_bytes, rotation_count, time_gpu

    assert l2_bytes() >= 40 * 2**20
    n = rotation_count(8 * 2**20, l2_bytes())
    assert n >= 10
    bufs = [torch.empty(2**20, device="cuda") for _ in range(n)]
    seen = set()

    def fn(i: int) -> None:
        seen.add(i)
        bufs[i].add_(1.0)

    st = time_gpu(fn, n, TimingSettings())
    assert st.valid and st.min_us <= st.median_us and st.iters >= 20
    assert seen == set(range(n))


def test_bench_row_against_cudnn(env):
    from cutlass_byoc.bench import bench_workload
    from cutlass_byoc.workloads import WorkloadItem

    rep = bench_workload([WorkloadItem("l", PROBLEMS[0], True)])
    row = rep.rows[0]
    assert row.status == "ok", row.status
    assert row.ours_us > 0 and row.cudnn_us > 0 and row.ratio == pytest.approx(row.cudnn_us / row.ours_us)
    assert rep.geomean_resnet50 == pytest.approx(row.ratio)
    assert "geometric mean" in rep.table()
    assert json.loads(rep.to_json())["rows"][0]["layer"] == "l"
    assert rep.to_csv().splitlines()[0].startswith("layer,")


def test_backend_tunes_a_graphs_problems_as_it_compiles(shared_cache, tmp_path, monkeypatch):
    """select="tune": compiling a training step tunes every conv problem of its graphs at compile time (one batch per
    graph, each problem timed as its kernels are ready), records the decisions, names them in the report, and the
    step computes what eager autocast does. The decisions start from an empty cache; the kernels are copied from
    the shared cache where they were compiled ahead (those missing compile here)."""
    import shutil

    import torch

    from cutlass_byoc.build import prepare
    from cutlass_byoc.cache import EntryState, KernelCache
    from cutlass_byoc.decisions import lookup
    from cutlass_byoc.offload import library
    from cutlass_byoc.offload.bench import relative_errors
    from gpu_util import STEP_ABS, STEP_SLACK, backend_step_vs_eager

    root = tmp_path / "cache"
    KernelCache(root)
    for k in backend_kernels():
        entry = shared_cache.lookup(prepare(k)[1])
        if entry.state is EntryState.OK:
            shutil.copytree(entry.path, root / entry.path.relative_to(shared_cache.root))
    monkeypatch.setenv("CUTLASS_BYOC_CACHE_DIR", str(root))

    cl = torch.channels_last
    base = backend_model().cuda().to(memory_format=cl).train()
    x = torch.randn(BACKEND_BATCH, BACKEND_CHANNELS, BACKEND_IMAGE, BACKEND_IMAGE, device="cuda").contiguous(
        memory_format=cl)
    truth, eager, ours, backend = backend_step_vs_eager(base, x, {"select": "tune", "strict": True})
    rep = backend.report()
    print(f"\n{rep.summary()}")
    assert rep.failure is None and len(rep.offloaded) >= 2  # the fprop (ReLU fused) and the wgrad
    assert not library.RUNTIME.fallbacks, library.RUNTIME.fallbacks
    for p in dict.fromkeys(rep.problems):
        dec = lookup(p)
        assert dec is not None and dec.time_us > 0, p.name  # decided on this GPU, in the fresh cache
    for e in rep.offloaded:
        assert "(tuned," in (e.kernel or ""), (e.problem, e.kernel, e.notes)
    e_eager, e_ours = relative_errors(*eager, *truth), relative_errors(*ours, *truth)
    print(f"relative errors vs fp32 (loss, grad, worst param): eager {e_eager}, backend {e_ours}")
    assert e_ours[0] <= STEP_SLACK * e_eager[0] + STEP_ABS, (e_ours, e_eager)
    assert e_ours[1] <= STEP_SLACK * e_eager[1] + STEP_ABS, (e_ours, e_eager)
