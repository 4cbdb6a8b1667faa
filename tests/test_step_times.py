"""In-step times (tune --model --in-step): each offloaded pass timed inside the model's compiled step on its kernel and
on cuDNN, recorded in its decision, where both then decide which of the two the backend runs. CPU: the decision
fields, the choice they make, the profiler-event reading and the sums (the measurement itself needs the GPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cutlass_byoc import decisions as dec_mod
from cutlass_byoc import select as sel
from cutlass_byoc.decisions import Decision, GpuInfo, record_decision, record_step_times
from cutlass_byoc.heuristics import default_launch
from cutlass_byoc.offload import step_times as st
from cutlass_byoc.problem import Conv2dProblem

GPU = GpuInfo("NVIDIA H200", 90)
P = Conv2dProblem.make("fprop", 8, 64, 28, 28, 64, 3, padding=1)
Q = Conv2dProblem.make("wgrad", 8, 64, 28, 28, 64, 1)


@pytest.fixture
def gpu_here(tmp_cache, monkeypatch):
    monkeypatch.setattr(dec_mod, "current_gpu", lambda: GPU)
    return tmp_cache


def test_step_times_round_trip_and_stay_out_of_unmeasured_decisions(gpu_here):
    launch = default_launch(P)
    dec = record_decision(P, launch, 10.0, gpu=GPU, cudnn_us=12.0)
    assert not dec.in_step and "step_us" not in dec.to_dict()  # files of decisions without them are unchanged
    got = record_step_times(P, launch.name, 9.0, 7.5, "m b8 training fp16")
    assert got.in_step and (got.step_us, got.step_cudnn_us, got.step_model) == (9.0, 7.5, "m b8 training fp16")
    back = Decision.from_dict(json.loads(json.dumps(got.to_dict())))
    assert back == got
    d = dec_mod.lookup(P)
    assert (d.time_us, d.cudnn_us, d.step_us, d.step_cudnn_us) == (10.0, 12.0, 9.0, 7.5)  # the tune's times kept


def test_step_times_only_for_the_launch_that_ran(gpu_here):
    launch = default_launch(P)
    assert record_step_times(P, launch.name, 9.0, 7.5, "m") is None  # no decision
    record_decision(P, launch, 10.0, gpu=GPU, cudnn_us=12.0)
    assert record_step_times(P, launch.name + "_other", 9.0, 7.5, "m") is None
    assert not dec_mod.lookup(P).in_step
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step_"):
            record_step_times(P, launch.name, bad, 7.5, "m")
    # a decision recorded again (a new tune) drops the times measured with the old one
    record_step_times(P, launch.name, 9.0, 7.5, "m")
    record_decision(P, launch, 10.0, gpu=GPU, cudnn_us=12.0)
    assert not dec_mod.lookup(P).in_step


@pytest.mark.parametrize("tune_cudnn, step_ours, step_cudnn, faster", [
    (12.0, 9.0, 7.5, True),    # the tune: ours faster; in the step: cuDNN -> cuDNN
    (8.0, 7.0, 9.0, False),    # the tune: cuDNN faster; in the step: ours -> ours
    (8.0, None, None, True),   # not measured in a step: the tune decides
])
def test_in_step_times_decide(gpu_here, tune_cudnn, step_ours, step_cudnn, faster):
    launch = default_launch(P)
    record_decision(P, launch, 10.0, gpu=GPU, cudnn_us=tune_cudnn)
    if step_ours is not None:
        record_step_times(P, launch.name, step_ours, step_cudnn, "resnet50 b32 training fp16")
    why = sel.cudnn_faster(P)
    assert (why is not None) == faster
    if faster and step_ours is not None:
        assert why.startswith(f"cuDNN is faster: {step_cudnn:.1f} us vs {step_ours:.1f} us")
        assert "in the step of resnet50 b32 training fp16" in why
    # the host credit applies to the in-step times alike
    assert sel.cudnn_faster(P, host_credit_us=100.0) is None


def test_host_credit_note_names_the_in_step_times(gpu_here):
    launch = default_launch(P)
    record_decision(P, launch, 10.0, gpu=GPU, cudnn_us=20.0)
    record_step_times(P, launch.name, 9.0, 7.0, "m")
    note = sel.host_credit_note(P, 10.0)
    assert note is not None and "7.0 us vs 9.0 us" in note


class Ev:
    def __init__(self, name, inputs, us):
        self.name, self.concrete_inputs, self.device_time_total = name, inputs, us


def test_site_times_reads_the_site_argument_of_the_call_site_ops():
    events = [Ev("cutlass_byoc::fprop_site", [None, None, None, None, 3], 10.0),
              Ev("cutlass_byoc::fprop_site_py", [None, None, None, None, 3], 10.0),  # the twin inside: not again
              Ev("cutlass_byoc::dgrad_site", [None, None, 5], 4.0),
              Ev("cutlass_byoc::wgrad_site_async", [None, None, 7, 1, None], 6.0),
              Ev("cutlass_byoc::fprop_site", [None, None, None, None, 3], 12.0),
              Ev("cutlass_byoc::wgrad_site", [None, None], 1.0),  # no recorded argument: skipped
              Ev("aten::convolution", [None, None, None], 30.0)]
    assert st.site_times(events) == {3: [10.0, 12.0], 5: [4.0], 7: [6.0]}


def _pass(site, problem, launch, calls, ours, cudnn):
    return st.PassTime(site, problem.kind.value, problem, launch, calls, ours, cudnn)


def test_per_problem_weights_the_calls_and_the_sums_compare_the_choices():
    passes = [_pass(0, P, "a", 1, 10.0, 8.0), _pass(1, P, "a", 3, 6.0, 8.0), _pass(2, Q, "b", 2, 20.0, 10.0),
              _pass(3, Q, "c", 1, 20.0, 10.0)]
    probs = st.per_problem(passes)
    assert [p.problem for p in probs] == [P, Q]
    p, q = probs
    assert (p.launch, p.calls_per_step, p.ours_us, p.cudnn_us) == ("a", 4, 7.0, 8.0)
    assert q.launch is None  # two launches: no one kernel's time
    tune = {P: (10.0, 9.0), Q: (15.0, 16.0)}  # the tune: cuDNN for P, ours for Q
    sums = st.step_sums(probs, tune.get)
    assert sums["all_ours"] == pytest.approx((28 + 60) / 1e3)
    assert sums["all_cudnn"] == pytest.approx((32 + 30) / 1e3)
    assert sums["tune_choice"] == pytest.approx((32 + 60) / 1e3)
    assert sums["in_step_choice"] == pytest.approx((28 + 30) / 1e3)
    assert (sums["cudnn_by_tune"], sums["cudnn_in_step"], sums["problems"]) == (1, 1, 2)
    lines = st.table(probs, {P: "l1#0"}, tune.get)
    assert lines[1].startswith("l1#0") and lines[1].endswith("ours (tune: cuDNN)")
    assert lines[2].endswith("cuDNN (tune: ours)")


def test_record_writes_what_it_can_and_says_why_not(gpu_here):
    launch = default_launch(P)
    record_decision(P, launch, 10.0, gpu=GPU, cudnn_us=12.0)
    probs = [st.ProblemTime(P, launch.name, 2, 9.0, 7.0), st.ProblemTime(Q, None, 1, 5.0, 4.0),
             st.ProblemTime(dataclasses.replace(Q, n=16), "x", 1, 5.0, 4.0)]
    written, skipped = st.record(probs, "m b8")
    assert written == 1 and len(skipped) == 2
    assert "different launches" in skipped[0] and "no decision" in skipped[1]
    assert dec_mod.lookup(P).step_cudnn_us == 7.0


def test_cli_in_step_needs_a_model(capsys):
    from cutlass_byoc.cli import main

    rc = main(["tune", "--kind", "fprop", "--n", "1", "--c", "8", "--h", "8", "--w", "8", "--k", "8", "--r", "3",
               "--s", "3", "--in-step"])
    assert rc == 2 and "--in-step needs --model" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("stride, padding", [(1, 1), (2, 0)])
def test_cudnn_stand_ins_compute_what_the_reference_does(kind, stride, padding):
    """The measurement's cuDNN side must compute the pass (the training steps go on from its results): each stand-in
    against library's fp32 reference, on the CPU in fp32 (the same aten ops the GPU runs in 16 bits)."""
    import torch

    from cutlass_byoc.offload import library

    g = torch.Generator().manual_seed(0)
    CL = torch.channels_last
    x = torch.randn(2, 8, 9, 9, generator=g).contiguous(memory_format=CL)
    w = torch.randn(16, 8, 3, 3, generator=g).contiguous(memory_format=CL)
    y = torch.nn.functional.conv2d(x, w, None, stride, padding)
    dy = torch.randn(y.shape, generator=g).contiguous(memory_format=CL)
    fns = st.cudnn_fallbacks()
    conv = ([stride] * 2, [padding] * 2, [1, 1], 1)
    if kind == "fprop":
        b, res = torch.randn(16, generator=g), torch.randn(y.shape, generator=g).contiguous(memory_format=CL)
        got = fns["reference_fprop"](x, w, b, res, *conv, "relu", torch.float32)
        want = library.reference_fprop(x, w, b, res, *conv, "relu", torch.float32)
    elif kind == "dgrad":
        got = fns["reference_dgrad"](dy, w, list(x.shape), *conv, torch.float32)
        want = library.reference_dgrad(dy, w, list(x.shape), *conv, torch.float32)
    else:
        got = fns["reference_wgrad"](dy, x, list(w.shape), *conv, torch.float32)
        want = library.reference_wgrad(dy, x, list(w.shape), *conv, torch.float32)
    assert got.shape == want.shape and got.is_contiguous(memory_format=CL)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_loss_takes_any_output_of_tensors():
    import torch

    t = torch.ones(2, 3, dtype=torch.float16)
    assert st._loss(t).item() == 1.0 and st._loss(t).dtype == torch.float32
    assert st._loss((t, [2 * t], {"a": t})).item() == 6.0
    with pytest.raises(TypeError, match="output holds tensors"):
        st._loss("logits")


def test_cli_in_step_failure_keeps_the_tune_and_says_so(monkeypatch, capsys):
    import argparse

    from cutlass_byoc import cli

    def boom(*a, **k):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(st, "measure", boom)
    import importlib

    monkeypatch.setattr(importlib.import_module("cutlass_byoc.offload.trace"), "load_model", lambda spec: object())
    args = argparse.Namespace(model="torchvision:resnet50", batch=8, training=True, amp="fp16", image=224)
    got = cli._tune_in_step(args, {})
    assert got == {"model": "torchvision:resnet50 b8 training fp16", "error": "RuntimeError: no GPU here"}
    assert "in-step measurement failed (RuntimeError: no GPU here)" in capsys.readouterr().err


def test_cache_list_shows_the_in_step_times(gpu_here, capsys):
    from cutlass_byoc import cli

    launch = default_launch(P)
    record_decision(P, launch, 10.0, gpu=GPU, cudnn_us=12.0)
    assert cli.main(["cache", "list"]) == 0
    assert "in the step" not in capsys.readouterr().out
    record_step_times(P, launch.name, 9.0, 7.5, "m")
    assert cli.main(["cache", "list"]) == 0
    assert f"{P.name}  10.00 us (in the step: 9.00 us, cuDNN 7.50)  {launch.name}" in capsys.readouterr().out


def test_ran_launch_of_a_bound_site_and_of_the_general_path(gpu_here, monkeypatch):
    import types

    from cutlass_byoc import select

    launch = default_launch(P)
    bound = types.SimpleNamespace(launch=launch)
    assert st.ran_launch(types.SimpleNamespace(state=bound, problem=P, select="cached"), False) is launch
    # the general path runs what select.choose gives the problem (here the untuned default), unless calls fell back
    general = types.SimpleNamespace(state=False, problem=P, select="cached")
    assert st.ran_launch(general, False) == select.choose(P, "cached") == launch
    assert st.ran_launch(general, True) is None
    assert st.ran_launch(types.SimpleNamespace(state=None, problem=P, select="cached"), False) is None
