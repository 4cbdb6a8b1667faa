import dataclasses

import pytest

from cutlass_byoc.candidates import sm80_candidates, sm80_tile_specs
from cutlass_byoc.config import KernelConfig, LaunchConfig
from cutlass_byoc.heuristics import default_launch, split_k_slice_candidates
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.types import ConvKind, DType, IteratorAlgorithm, KernelFamily, MathOp, SplitKMode, StrideSupport


def P(kind, n, c, h, k, r, **kw):
    return Conv2dProblem.make(kind, n, c, h, h, k, r, padding=r // 2, **kw)


def test_tiles_come_from_cutlass_library():
    specs = sm80_tile_specs(MathOp.F16)
    assert len(specs) == 22  # what GenerateSM80_TensorOp_16816 instantiates for conv2d (BRIEF.md)
    assert ((128, 128, 32), (2, 2, 1), 3) in specs
    assert all(t[2] in (32, 64) for t, _, _ in specs)
    assert {t[2] for t, _, _ in sm80_tile_specs(MathOp.TF32)} == {16, 32}


def test_config_is_frozen_hashable_and_round_trips():
    cfg = next(sm80_candidates(P("fprop", 32, 64, 56, 64, 3)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stages = 4
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(KernelConfig.from_dict(cfg.to_dict())) == hash(cfg)
    launch = LaunchConfig(cfg, 4)
    assert LaunchConfig.from_dict(launch.to_dict()) == launch


def test_names_are_derived_and_unique():
    problems = [P("fprop", 32, 64, 56, 64, 3), P("dgrad", 32, 64, 56, 64, 3, stride=2), P("wgrad", 32, 7, 56, 33, 3)]
    configs = [c for p in problems for c in sm80_candidates(p)]
    assert len({c.name for c in configs}) == len(set(configs)) == len(configs)


def test_odd_channels_get_alignment_one_on_the_two_stage_mainloop():
    p = P("fprop", 32, 7, 56, 33, 3)
    cands = list(sm80_candidates(p))
    assert cands, "C=7, K=33 must run, not be refused"
    for c in cands:
        assert (c.align_a, c.align_b, c.align_c) == (1, 1, 1)
        assert c.stages == 2
        assert c.iterator is not IteratorAlgorithm.OPTIMIZED


def test_stem_offers_few_channel_iterators():
    cands = list(sm80_candidates(P("fprop", 32, 3, 224, 64, 7, stride=2)))
    assert {c.iterator for c in cands} >= {IteratorAlgorithm.FEW_CHANNELS, IteratorAlgorithm.ANALYTIC}
    assert all(c.stride_support is StrideSupport.STRIDED for c in cands if c.iterator is IteratorAlgorithm.FEW_CHANNELS)


def test_dgrad_stride_support_and_split_k_rules():
    strided = list(sm80_candidates(P("dgrad", 32, 128, 56, 128, 3, stride=2)))
    assert strided and all(c.stride_support is StrideSupport.STRIDED for c in strided)
    assert all(c.split_k_mode is SplitKMode.SERIAL for c in strided)
    assert split_k_slice_candidates(P("dgrad", 32, 128, 56, 128, 3, stride=2), (128, 128, 32)) == [1]
    unity = list(sm80_candidates(P("dgrad", 32, 128, 56, 128, 3)))
    assert all(c.stride_support is StrideSupport.UNITY for c in unity)
    assert {c.split_k_mode for c in unity} == {SplitKMode.SERIAL, SplitKMode.PARALLEL}
    launch = LaunchConfig(strided[0], 2)
    assert "strided dgrad" in launch.reject_reason(P("dgrad", 32, 128, 56, 128, 3, stride=2))


def test_wgrad_candidates_accumulate_in_fp32_and_parallel_kernels_store_fp32_partials():
    p = P("wgrad", 32, 64, 56, 64, 3, out_dtype="f16")
    for c in sm80_candidates(p):
        assert c.element_acc is DType.F32
        assert c.element_out is DType.F16
        if c.split_k_mode is SplitKMode.PARALLEL:
            assert c.element_kernel_out is DType.F32 and c.align_c <= 4


def test_split_k_slice_candidates_follow_the_problem():
    early = split_k_slice_candidates(P("wgrad", 32, 64, 56, 64, 3), (128, 128, 32))
    late = split_k_slice_candidates(P("wgrad", 32, 512, 7, 512, 3), (128, 128, 32))
    assert max(early) >= 16  # 1 output tile for 132 SMs: split the N*P*Q reduction a lot
    assert max(late) < max(early)
    assert split_k_slice_candidates(P("fprop", 32, 64, 56, 64, 1), (128, 128, 32)) == [1]  # already 784 tiles


def test_static_rules_reject_impossible_kernels():
    good = next(sm80_candidates(P("fprop", 32, 64, 56, 64, 3)))
    with pytest.raises(ValueError, match="stages"):
        dataclasses.replace(good, align_a=1, align_b=1, stages=3)
    with pytest.raises(ValueError, match="align_c"):
        dataclasses.replace(good, element_out=DType.F32, align_c=8)
    with pytest.raises(ValueError, match="wgrad accumulates in f32"):
        dataclasses.replace(good, kind=ConvKind.WGRAD, element_acc=DType.F16)
    with pytest.raises(ValueError, match="splits wgrad only"):
        dataclasses.replace(good, family=KernelFamily.SM90_TMA_WGMMA, split_k_mode=SplitKMode.PARALLEL, align_c=4)


def test_reject_reason_names_what_does_not_fit():
    cfg = next(c for c in sm80_candidates(P("fprop", 32, 64, 56, 64, 3)) if c.align_a == 8)
    assert "alignment" in cfg.reject_reason(P("fprop", 32, 60, 56, 64, 3))
    assert "kind" in cfg.reject_reason(P("dgrad", 32, 64, 56, 64, 3))
    assert "groups" in cfg.reject_reason(P("fprop", 32, 64, 56, 64, 3, groups=2))
    assert "element_out" in cfg.reject_reason(P("fprop", 32, 64, 56, 64, 3, out_dtype="f32"))
    assert cfg.reject_reason(P("fprop", 1, 64, 9, 64, 3)) is None  # a kernel serves every shape it can implement


def test_with_alignments_narrows_to_what_pointers_allow():
    cfg = next(c for c in sm80_candidates(P("fprop", 32, 64, 56, 64, 3)) if c.iterator is IteratorAlgorithm.OPTIMIZED)
    narrow = cfg.with_alignments(1, 8, 8)
    assert (narrow.align_a, narrow.stages, narrow.iterator) == (1, 2, IteratorAlgorithm.ANALYTIC)


def test_default_launch_exists_for_every_supported_kind_and_dtype():
    for kind in ConvKind:
        for dt, out in (("f16", "f16"), ("f16", "f32"), ("bf16", "bf16"), ("f32", "f32")):
            p = P(kind.value, 8, 64, 28, 128, 3, dtype=dt, out_dtype=out)
            launch = default_launch(p)
            assert launch is not None and launch.reject_reason(p) is None
    assert default_launch(P("fprop", 8, 64, 28, 128, 3, groups=4)) is None


def test_serial_split_k_only_where_partials_stay_fp32():
    p16 = P("wgrad", 32, 64, 56, 64, 3, out_dtype="f16")
    p32 = P("wgrad", 32, 64, 56, 64, 3, out_dtype="f32")
    serial16 = next(c for c in sm80_candidates(p16) if c.split_k_mode is SplitKMode.SERIAL)
    serial32 = next(c for c in sm80_candidates(p32) if c.split_k_mode is SplitKMode.SERIAL)
    assert "parallel split-k" in LaunchConfig(serial16, 4).reject_reason(p16)
    assert LaunchConfig(serial16, 1).reject_reason(p16) is None
    assert LaunchConfig(serial32, 4).reject_reason(p32) is None
    from cutlass_byoc.problem import Epilogue
    from cutlass_byoc.types import SourceKind

    pb = P("fprop", 32, 256, 14, 256, 3, out_dtype="f32", epilogue=Epilogue(source=SourceKind.BIAS))
    sb = next(c for c in sm80_candidates(pb) if c.split_k_mode is SplitKMode.SERIAL)
    assert "bias" in LaunchConfig(sb, 2).reject_reason(pb)


def test_serial_split_k_never_carries_a_relu():
    """CUTLASS's LinearCombinationRelu skips the ReLU of every serial slice but the last with a NaN threshold, and
    its ReLu propagates NaN: those slices write NaN (the GPU fuzz's seeds 131 and 149, non-finite outputs). A serial
    split launch of a ReLU kernel is refused; parallel split-k (the ReLU in its reduction) and unsplit launches are
    not, and the untuned default of seed 131's problem no longer splits it serially."""
    from cutlass_byoc.problem import Epilogue
    from cutlass_byoc.types import Activation

    relu = Epilogue(activation=Activation.RELU)
    p = P("fprop", 2, 12, 2, 16, 5, out_dtype="f32", epilogue=relu)
    p = p.replace(w=1, pad_h=4, pad_w=4, dilation_h=2, dilation_w=2)
    serial = next(c for c in sm80_candidates(p) if c.split_k_mode is SplitKMode.SERIAL)
    assert serial.activation is Activation.RELU
    why = LaunchConfig(serial, 4).reject_reason(p)
    assert why.startswith("split_k_slices:") and "ReLU" in why
    assert LaunchConfig(serial, 1).reject_reason(p) is None
    parallel = next(c for c in sm80_candidates(p) if c.split_k_mode is SplitKMode.PARALLEL)
    assert LaunchConfig(parallel, 4).reject_reason(p) is None
    d = default_launch(p)
    assert d.reject_reason(p) is None
    assert d.split_k_slices == 1 or d.kernel.split_k_mode is not SplitKMode.SERIAL
    plain = p.replace(epilogue=Epilogue())
    assert LaunchConfig(next(c for c in sm80_candidates(plain) if c.split_k_mode is SplitKMode.SERIAL), 4) \
        .reject_reason(plain) is None  # no ReLU: serial slices stay allowed (fp32 output)


def test_strided_dgrad_of_odd_channels_is_padded_not_run_narrow():
    from cutlass_byoc.candidates import unsupported_reason

    stem = P("dgrad", 32, 3, 224, 64, 7, stride=2)
    assert not list(sm80_candidates(stem))
    assert unsupported_reason(stem) is None  # it runs channel-padded
    # the model's default: the space-to-depth fold (a unit-stride dgrad over C=12 padded to 16), which ran 156 us
    # on the H200 against 565 us for the model's channel-padded strided-dgrad pick
    d = default_launch(stem)
    assert d.padded and d.s2d == 2 and d.pad_k == 1 and d.kernel_problem(stem).c == 16
    assert d.reject_reason(stem) is None and d.unpadded.reject_reason(stem)  # the kernel cannot take C=3 itself


def test_unsupported_reason_names_the_parameter():
    from cutlass_byoc.candidates import unsupported_reason

    assert unsupported_reason(P("fprop", 2, 16, 8, 16, 3, groups=2)).startswith("groups:")
    assert unsupported_reason(P("fprop", 2, 16, 8, 16, 3, groups=16)) is None  # depthwise: the depthwise family
    assert unsupported_reason(P("fprop", 2, 16, 8, 16, 3, groups=16, dilation=2)).startswith("depthwise: dilation")
    assert unsupported_reason(P("dgrad", 2, 16, 8, 16, 3, stride=2, dilation=2)).startswith("dilation:")
    assert unsupported_reason(P("dgrad", 2, 16, 8, 16, 3, dilation=2)) is None  # unity-stride dgrad
    assert unsupported_reason(P("fprop", 2, 16, 8, 16, 3)) is None


def test_dilated_dgrad_rules():
    """Unity-stride dgrad kernels apply dilation (2.x analytic and optimized iterators, the 3.x collective);
    strided-dgrad kernels do not."""
    from cutlass_byoc.candidates import sm80_candidates
    from cutlass_byoc.sm90 import sm90_candidates

    p = Conv2dProblem.make("dgrad", 2, 16, 9, 9, 24, 3, padding=3, dilation=3)
    cands = list(sm80_candidates(p, split_k=False))
    assert cands and {c.stride_support.value for c in cands} == {"unity"}
    assert {c.iterator.value for c in cands} >= {"analytic", "optimized"}
    assert any(c.reject_reason(p) is None for c in sm90_candidates(p))
    strided = Conv2dProblem.make("dgrad", 2, 16, 9, 9, 24, 3, stride=2, padding=2, dilation=2)
    for c in list(sm80_candidates(strided.replace(dilation_h=1, dilation_w=1), split_k=False))[:20]:
        assert "dilation" in c.reject_reason(strided)


def test_default_launch_considers_the_3x_family():
    """Untuned, layers 3-4 ran 2-3x slower on a 2.x-only default than on the tuned 3.x winner (H200): the default
    ranks both families; early wgrad (few output tiles) gets a split-k launch (2.x, or the project's 3.x split)."""
    l3 = P("fprop", 32, 256, 14, 256, 3)
    assert default_launch(l3).kernel.family is KernelFamily.SM90_TMA_WGMMA
    assert default_launch(l3, sm90=False).kernel.family is KernelFamily.SM80_IMPLICIT_GEMM
    early_wgrad = P("wgrad", 32, 64, 56, 64, 3)
    launch = default_launch(early_wgrad)
    assert launch.split_k_slices > 1
    fp32 = P("fprop", 8, 64, 14, 64, 3, dtype="f32")  # the 3.x family is built for 16-bit inputs
    assert default_launch(fp32).kernel.family is KernelFamily.SM80_IMPLICIT_GEMM


def test_untuned_fp32_split_wgrad_adds_atomically_unless_deterministic():
    """A training step's wgrad stores fp32 (the cast fused): its untuned 3.x split-k launch is the atomic twin (the
    slices' sums added into the zeroed output, no partials or reduction; 1.11x its twin in the median of 359 pairs
    the H100's tunes timed), the same tile and slices. A 16-bit output, a channel-padded launch and deterministic
    algorithms keep the split-k kernel with partials."""
    torch = pytest.importorskip("torch")
    from cutlass_byoc import sm90  # noqa: PLC0415
    from cutlass_byoc.gemm1x1 import forced_determinism  # noqa: PLC0415
    from cutlass_byoc.heuristics import atomic_default  # noqa: PLC0415

    for c, hw, k, r in [(64, 56, 64, 3), (64, 56, 64, 1), (512, 28, 128, 1), (128, 28, 128, 3)]:
        p = P("wgrad", 32, c, hw, k, r, out_dtype="f32")
        launch = default_launch(p)
        assert launch.kernel.split_k_mode is SplitKMode.ATOMIC and launch.split_k_slices > 1, launch.name
        twin = dataclasses.replace(launch, kernel=sm90.deterministic_twin(launch.kernel))
        assert twin.kernel.split_k_mode is SplitKMode.PARALLEL and atomic_default(p, twin) == launch
        half = default_launch(P("wgrad", 32, c, hw, k, r))  # fp16 out: the twin would add into a workspace
        assert half.kernel.split_k_mode is not SplitKMode.ATOMIC
        with forced_determinism():
            assert default_launch(p) == twin
        torch.use_deterministic_algorithms(True)
        try:
            assert default_launch(p) == twin
        finally:
            torch.use_deterministic_algorithms(False)
        padded = dataclasses.replace(twin, pad_c=8)
        assert atomic_default(p, padded) is padded
    stem = P("wgrad", 32, 3, 224, 64, 7, stride=2, out_dtype="f32")  # runs folded or padded: no atomic twin
    assert default_launch(stem).kernel.split_k_mode is not SplitKMode.ATOMIC
    fprop = P("fprop", 32, 64, 56, 64, 3, out_dtype="f32")
    assert atomic_default(fprop, default_launch(fprop)) == default_launch(fprop)


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("c,hw,k", [(64, 56, 64), (256, 56, 64), (64, 56, 256), (1024, 14, 256), (256, 14, 1024)])
def test_default_launch_of_memory_bound_1x1_convs_is_3x(kind, c, hw, k):
    """ResNet-50's 1x1 convs are memory-bound, where the uncalibrated model tied the families and the 2.x kernel won the
    tie by its name; on the H200 the 2.x picks ran 1.3-3x slower than the 3.x kernels there (layer 3's 1x1 wgrads:
    53-54 us against 18). Calibrated (heuristics.CALIBRATION), the untuned default is a 3.x kernel, and never a GEMM
    stream-K one (the tuner's choice; its fast reduction order is nondeterministic)."""
    from cutlass_byoc.heuristics import H200_SMS, _model_us, calibration, estimate_us  # noqa: PLC0415

    p = P(kind, 32, c, hw, k, 1, out_dtype="f32" if kind == "wgrad" else None)
    launch = default_launch(p)
    assert launch.kernel.family in (KernelFamily.SM90_TMA_WGMMA, KernelFamily.SM90_GEMM_1X1), launch.name
    assert not (launch.kernel.family is KernelFamily.SM90_GEMM_1X1 and launch.kernel.splits_at_launch)
    assert estimate_us(p, launch) == pytest.approx(_model_us(p, launch, H200_SMS) * calibration(p, launch))
    assert calibration(p, launch) > 1.0  # the model's ceilings leave latency out: measured times run above them


@pytest.mark.parametrize("c, hw, k, stride, slices", [(128, 28, 128, 1, 8), (64, 56, 64, 1, 8), (128, 56, 128, 2, 8)])
def test_untuned_3x_split_wgrad_fits_one_wave(c, hw, k, stride, slices):
    """ResNet-50's early 3x3 wgrads: on the H200 the sm90 split ran fastest at the most slices whose CTAs fit one wave
    (layer 2's, 9 tiles of 128 x 128: 8 slices 25.9 us, 16 29.8, 32 32.0), where the model had picked 32. The untuned
    default takes only such counts (heuristics.one_wave_slices); the tuner's plans keep every count."""
    import math  # noqa: PLC0415

    from cutlass_byoc.heuristics import _sm90_tiled_mnk, launch_slices  # noqa: PLC0415
    from cutlass_byoc.types import SplitKMode  # noqa: PLC0415

    p = P("wgrad", 32, c, hw, k, 3, stride=stride, out_dtype="f32")
    launch = default_launch(p)
    kc = launch.kernel
    # (the atomic twin of the split-k kernel, with fp32 out: test_untuned_fp32_split_wgrad_adds_atomically_...)
    assert kc.family is KernelFamily.SM90_TMA_WGMMA and kc.split_k_mode is SplitKMode.ATOMIC, launch.name
    m, n, _ = _sm90_tiled_mnk(p, kc.tile)
    tiles = math.ceil(m / kc.tile[0]) * math.ceil(n / kc.tile[1])
    assert launch.split_k_slices == slices and tiles * slices <= 132 < tiles * 2 * slices
    assert max(launch_slices(p, kc)) > slices  # the tuner still times more
    assert max(launch_slices(p, kc, one_wave=True)) == slices


def test_calibration_groups():
    """heuristics.CALIBRATION's keys: family, schedule group (the GEMM family's by tile scheduler), fprop/dgrad or
    wgrad, split; the depthwise family (which competes with no other) is not calibrated."""
    from cutlass_byoc.depthwise import default_depthwise_launch  # noqa: PLC0415
    from cutlass_byoc.gemm1x1 import gemm1x1_candidates  # noqa: PLC0415
    from cutlass_byoc.heuristics import CALIBRATION, calibration, calibration_key  # noqa: PLC0415

    p = P("wgrad", 32, 256, 14, 1024, 1)
    keys = {calibration_key(p, LaunchConfig(kc)) for kc in gemm1x1_candidates(p)}
    assert {(KernelFamily.SM90_GEMM_1X1, g, "wgrad", False) for g in ("data-parallel", "stream-K")} <= keys
    assert all(k in CALIBRATION for k in keys)
    dw = P("fprop", 32, 96, 56, 96, 3, groups=96)
    assert calibration(dw, default_depthwise_launch(dw)) == 1.0
    assert all(f > 0.5 for f in CALIBRATION.values())
