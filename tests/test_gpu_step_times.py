"""GPU test of the in-step measurement (tune --model --in-step, offload.step_times): a ResNet-50 training step's
offloaded passes, each timed inside the compiled step on its kernel and on cuDNN, and the times recorded where the
decision's launch is the one that ran."""

from __future__ import annotations

import pytest
import torch

from models import MODELS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU tests run on the H200)"),
]


def test_every_pass_is_timed_on_both_sides_and_recorded():
    from cutlass_byoc import decisions, select
    from cutlass_byoc.offload import library, step_times

    torch._dynamo.reset()
    torch.manual_seed(0)
    passes, offload = step_times.measure(MODELS["resnet50"](), 16, steps=2, rounds=2)
    assert library.use_kernels  # the kernels are on again afterwards
    assert passes and all(p.ours_us > 0 and p.cudnn_us > 0 for p in passes), passes
    # every site ran its bound launch, or took the general path, whose launch is the problem's choice (ran_launch)
    assert all(p.launch is not None for p in passes), [p for p in passes if p.launch is None]
    for p in passes:
        if library.site(p.site).state is False:
            assert p.launch == select.choose(p.problem, "cached").name
    # fprop, dgrad and wgrad of every conv but the stem's dgrad (no input gradient)
    kinds = {k: sum(p.calls_per_step for p in passes if p.kind == k) for k in ("fprop", "dgrad", "wgrad")}
    assert kinds == {"fprop": 53, "dgrad": 52, "wgrad": 53}, (kinds, offload)
    problems = step_times.per_problem(passes)
    # the first problem gets a decision for the launch its sites ran if the cache (the test cache: untuned launches
    # unless a tune ran before) has none; it is removed again afterwards
    first = problems[0]
    site = library.site(next(p.site for p in passes if p.problem == first.problem))  # this compile's site
    launch = step_times.ran_launch(site, bool(library.RUNTIME.fallbacks))
    assert first.launch is not None
    assert launch.name == first.launch
    made = decisions.lookup(first.problem) is None
    if made:
        decisions.record_decision(first.problem, launch, 50.0, cudnn_us=40.0)
    try:
        written, skipped = step_times.record(problems, "resnet50 b16 training fp16")
        assert written >= 1 and written + len(skipped) == len(problems)
        dec = decisions.lookup(first.problem)
        if dec.launch.name == first.launch:
            assert (dec.step_us, dec.step_cudnn_us) == (pytest.approx(first.ours_us), pytest.approx(first.cudnn_us))
            assert select.decision_times(dec) == (dec.step_us, dec.step_cudnn_us)
    finally:
        if made:
            st = decisions.default_store()
            st.path(decisions.DecisionKey.for_problem(first.problem, decisions.current_gpu()).digest).unlink()
            decisions._bump()  # the choices memoised on the decision are stale
