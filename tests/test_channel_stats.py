"""CPU tests of the channel-statistics epilogue (KernelConfig.channel_stats): which kernels have it, its name and
serialisation, that every other kernel's source (and so its cache key) is unchanged, what the rendered source does,
and the Python launch path's checks of the statistics buffer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cutlass_byoc.config import KernelConfig, LaunchConfig
from cutlass_byoc.ops import UnsupportedConvError, _stats_pointer, run_problem
from cutlass_byoc.problem import Conv2dProblem, Epilogue
from cutlass_byoc.render import render
from cutlass_byoc.runtime import CbConv2dArgs, make_args
from cutlass_byoc.sm90 import CHANNEL_STATS_SLOTS, sm90_config
from cutlass_byoc.types import Activation, SourceKind

P = Conv2dProblem.make("fprop", 4, 64, 30, 30, 72, 3, padding=1)
PLAIN = sm90_config(P, (128, 64, 64))
TWIN = PLAIN.with_channel_stats()


def test_the_twin_is_the_same_kernel_with_the_statistics_epilogue():
    assert TWIN is not None and TWIN.channel_stats is True
    assert dataclasses.replace(TWIN, channel_stats=None) == PLAIN
    assert TWIN.name == PLAIN.name[: -len("_sm90")] + "_chstats_sm90"
    assert KernelConfig.from_dict(TWIN.to_dict()) == TWIN
    # the field is left out of every other kernel's dict: their JSON, source and cache key are what they were
    assert "channel_stats" not in PLAIN.to_dict() and TWIN.to_dict()["channel_stats"] is True
    assert TWIN.with_channel_stats() == TWIN
    # the project's persistent ping-pong kernel has the epilogue too
    assert sm90_config(P, (128, 64, 64), schedule="pingpong").with_channel_stats() is not None


def test_a_wide_tile_twins_on_128x64():
    # a 128 x 128 tile's 128 accumulators per thread and the two row reductions exceed the consumer warp group's
    # registers (ptxas: a 688-byte stack frame; the H200: the epilogue up to 3x the kernel), so its twin is 128 x 64
    for schedule in ("implicit_tma_ws", "pingpong"):
        wide = sm90_config(P, (128, 128, 64), cluster=(2, 1, 1), schedule=schedule)
        twin = wide.with_channel_stats()
        assert twin.tile == (128, 64, 64) and twin.schedule == schedule and twin.cluster == (2, 1, 1)
        assert twin == sm90_config(P, (128, 64, 64), cluster=(2, 1, 1), schedule=schedule).with_channel_stats()
        with pytest.raises(ValueError, match="at most 128 x 64 outputs, got 128 x 128"):
            dataclasses.replace(wide, channel_stats=True)
    assert sm90_config(P, (64, 128, 64)).with_channel_stats().tile == (64, 128, 64)  # 64 accumulators: kept


@pytest.mark.parametrize("why, make", [
    ("fprop", lambda: sm90_config(Conv2dProblem.make("dgrad", 4, 64, 30, 30, 72, 3, padding=1), (128, 64, 64))),
    ("fprop", lambda: sm90_config(Conv2dProblem.make("wgrad", 4, 64, 30, 30, 72, 3, padding=1), (128, 64, 64))),
    ("plain", lambda: sm90_config(P.replace(epilogue=Epilogue(Activation.RELU)), (128, 64, 64))),
])
def test_kernels_without_the_epilogue_have_no_twin(why, make):
    cfg = make()
    assert cfg.with_channel_stats() is None
    with pytest.raises(ValueError, match=why):
        dataclasses.replace(cfg, channel_stats=True)


def test_other_families_and_false_are_refused():
    from cutlass_byoc.candidates import sm80_candidates
    from cutlass_byoc.depthwise import depthwise_candidates
    from cutlass_byoc.smem_im2col import smem_im2col_candidates as im2col_candidates

    sm80 = next(sm80_candidates(P))
    assert sm80.with_channel_stats() is None
    # the families whose rules return early are refused too (a twin that ignored the buffer would be a wrong result)
    stem = Conv2dProblem.make("fprop", 4, 3, 32, 32, 64, 7, padding=3, stride=2)
    assert next(iter(im2col_candidates(stem))).with_channel_stats() is None
    dw = Conv2dProblem.make("fprop", 4, 32, 16, 16, 32, 3, padding=1, groups=32)
    assert next(iter(depthwise_candidates(dw))).with_channel_stats() is None
    with pytest.raises(ValueError, match="channel_stats: True or None"):
        dataclasses.replace(PLAIN, channel_stats=False)


def test_a_problem_with_a_source_is_rejected():
    assert TWIN.reject_reason(P) is None
    residual = P.replace(epilogue=Epilogue(source=SourceKind.RESIDUAL))
    assert "channel_stats" in TWIN.reject_reason(residual)
    assert PLAIN.reject_reason(residual) is None


def test_the_ping_pong_twin_zeroes_its_slots_before_and_sums_them_after_each_launch():
    pp = sm90_config(P, (128, 64, 64), schedule="pingpong")
    src, plain = render(pp.with_channel_stats(), "nvcc ..."), render(pp, "nvcc ...")
    steps = ("zero_slots(x, workspace, workspace_bytes, &xs, list, msg, len)", "cb_pingpong::prepare(&xs, list, msg, len)",
             "fold_slots(x, xs, list);")
    at = [src.index(step, src.index("int cb_prepare(")) for step in steps]
    assert at == sorted(at)  # zero the slots, then the kernel on them, then their sum into the caller's buffer
    assert "cudaMemsetAsync(slots, 0, size_t(bytes), s)" in src
    assert "return slots_offset(*x) + slots_bytes(*x);" in src  # the workspace holds the slots
    assert "zero_slots" not in plain and "to_underlying_arguments(xf, args.epilogue, nullptr)" in plain


def test_rendered_source_reduces_rows_and_takes_the_buffer():
    src = render(TWIN, "nvcc ...")
    assert src.startswith(f"// {TWIN.name}\n")
    assert src.count("Sm90RowReduction<") == 2 and "CbPlusSquare" in src and src.count("cutlass::atomic_add") == 2
    assert "void* stats;" in src and "const void* bias;" in src  # the struct's layout matches runtime.py's
    assert "slots ? slots + x.k : nullptr" in src and f"constexpr int kStatsSlots = {CHANNEL_STATS_SLOTS};" in src
    assert src.count("CbSlotted<cutlass::epilogue::fusion::Sm90RowReduction<") == 2
    assert "make_arguments(xs)" in src and "fold_slots(x, xs, list);" in src
    assert "the channel-statistics kernel stores round(acc)" in src
    plain = render(PLAIN, "nvcc ...")
    for needle in ("Sm90RowReduction", "void* stats", "const void* bias", "chstats", "channel-statistics"):
        assert needle not in plain
    assert "args.epilogue.thread.alpha" in plain and "args.epilogue.thread.alpha" not in src


def test_the_python_struct_carries_the_pointer_after_bias():
    names = [f for f, _ in CbConv2dArgs._fields_]
    assert names[-2:] == ["bias", "stats"]
    assert make_args(P, stats=0x1000).stats == 0x1000 and make_args(P).stats is None


def test_the_statistics_buffer_is_checked_before_any_launch():
    stats = torch.empty(2, P.k, dtype=torch.float32)
    assert _stats_pointer(TWIN, P, stats) == stats.data_ptr()
    for bad, match in ((None, "needs a stats tensor"), (torch.empty(2, P.k, dtype=torch.float16), "float32"),
                       (torch.empty(P.k, 2).t(), "contiguous"), (torch.empty(3, P.k), r"\(2, 72\)")):
        with pytest.raises(UnsupportedConvError, match=match):
            _stats_pointer(TWIN, P, bad)
    with pytest.raises(UnsupportedConvError, match="no channel-statistics epilogue"):
        _stats_pointer(PLAIN, P, stats)
    # run_problem checks the pairing first: nothing is loaded or compiled for a wrong one
    x = torch.empty(4, 64, 30, 30, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.empty(72, 64, 3, 3, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    y = torch.empty(4, 72, 30, 30, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    with pytest.raises(UnsupportedConvError, match="stats"):
        run_problem(P, x, w, y, config=LaunchConfig(PLAIN), stats=stats)
    with pytest.raises(UnsupportedConvError, match="stats"):
        run_problem(P, x, w, y, config=LaunchConfig(TWIN))
