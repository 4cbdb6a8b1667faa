"""The depthwise kernels' own source, run on the CPU (tests/emulate_cuda.py: g++ and an emulation of the CUDA
launch model) against float64 PyTorch, outputs poisoned with NaN: every kind, the rotated and the valid-tap dgrad,
halo staging and L1 reads, odd sizes, C not a multiple of 8, fp16/bf16 in, fp32 out, wgrad splits and residual,
fused epilogues, and the model's default launches. Checks the index arithmetic without a GPU (the GPU tests in
test_gpu_depthwise.py check the real thing on the H200)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import emulate_cuda  # noqa: E402
from cutlass_byoc.depthwise import (depthwise_candidates, is_pipelined, lanes, min_blocks_variant, pad_groups,  # noqa: E402
                                    pixel_tiles)
from cutlass_byoc.heuristics import default_launch  # noqa: E402
from cutlass_byoc.ops import _apply_activation  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.types import Activation, SourceKind  # noqa: E402

from gpu_util import (  # noqa: E402
    TOLERANCE, TORCH, depthwise_cols_config, depthwise_pipelined_wgrad_config, depthwise_odd_cases,
    depthwise_random_cases, depthwise_rows_config, random_case_id, random_case_launch)

pytestmark = [pytest.mark.compile,
              pytest.mark.skipif(emulate_cuda.skip_reason() is not None, reason=str(emulate_cuda.skip_reason()))]


def problem_of(kind, c, h, w, r, stride, dt=("f16", "f16"), n=2, pad=None, epilogue=Epilogue()):
    return Conv2dProblem.make(kind, n, c, h, w, c, r, stride=stride, padding=r // 2 if pad is None else pad,
                              groups=c, dtype=dt[0], out_dtype=dt[1], epilogue=epilogue)


def config(problem, vec, halo, tile=(4, 8)):
    wide = problem.replace(c=96, k=96, groups=96)
    return next(c for c in depthwise_candidates(wide)
                if c.align_a == vec and c.halo_smem == halo and c.tile[:2] == tile and c.tile[2] == 8 * vec)


def check(problem, cfg, splits=1, seed=0, alpha=1.0):
    g = torch.Generator().manual_seed(seed)
    p, cl = problem, torch.channels_last
    dt, ot = TORCH[p.element_a], TORCH[p.element_out]
    x = torch.randn(p.n, p.c, p.h, p.w, generator=g).to(dt).contiguous(memory_format=cl)
    w = torch.randn(p.k, 1, p.r, p.s, generator=g).to(dt).contiguous(memory_format=cl)
    dy = torch.randn(p.n, p.k, p.p, p.q, generator=g).to(dt).contiguous(memory_format=cl)
    st, pd = (p.stride_h, p.stride_w), (p.pad_h, p.pad_w)
    if p.kind.value == "fprop":
        a, b, ref = x, w, torch.nn.functional.conv2d(x.double(), w.double(), None, st, pd, 1, p.c)
    elif p.kind.value == "dgrad":
        a, b, ref = dy, w, torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), st, pd, 1, p.c)
    else:
        a, b, ref = dy, x, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), st, pd, 1, p.c)
    ref = alpha * ref
    source = bias = None
    if p.epilogue.source.has_residual:
        source = torch.randn(ref.shape, generator=g).to(ot).contiguous(memory_format=cl)
        ref = ref + source.double()
    if p.epilogue.source.has_bias:  # in its own type (bias_dtype), else the output's
        bias = torch.randn(p.k, generator=g).to(TORCH[p.element_bias])
        ref = ref + bias.double().view(1, -1, 1, 1)
        if p.epilogue.source is SourceKind.BIAS:
            source, bias = bias, None  # a lone bias is the epilogue source
    ref = _apply_activation(ref, p.epilogue.activation)
    out = torch.full(ref.shape, float("nan"), dtype=ot).contiguous(memory_format=cl)
    emulate_cuda.run(cfg, p, a, b, out, source, splits, alpha, bias=bias)
    err = float((out.double() - ref).norm() / ref.norm())
    assert not math.isnan(err), f"{cfg.name}: NaN in the output of {p.name} (unwritten)"
    assert err < TOLERANCE[p.element_out], f"{cfg.name} on {p.name} ({splits} splits): relative error {err:.2e}"


def test_fprop_halo_strided_with_bias_and_silu_on_odd_channels():
    p = problem_of("fprop", 36, 17, 9, 3, 2, epilogue=Epilogue(Activation.SILU, SourceKind.BIAS))
    check(p, config(p, 4, True))


def test_fprop_relu6_clamp_with_bias():
    p = problem_of("fprop", 24, 9, 10, 3, 1, epilogue=Epilogue(Activation.RELU6, SourceKind.BIAS))
    check(p, config(p, 8, False), 1, seed=6)


def test_fprop_bf16_to_fp32_5x5_with_residual_relu():
    p = problem_of("fprop", 24, 11, 7, 5, 1, ("bf16", "f32"), epilogue=Epilogue(Activation.RELU, SourceKind.RESIDUAL))
    check(p, config(p, 8, False))


@pytest.mark.parametrize("schedule", ["tile", "halo", "rows", "cols", "cols_capped", "piped"])
@pytest.mark.parametrize("epi, dt", [
    (Epilogue(Activation.RELU, SourceKind.BIAS_RESIDUAL), ("f16", "f16")),   # a bias and a residual
    (Epilogue(Activation.SILU, SourceKind.BIAS, bias_dtype="f32"), ("f16", "f16")),  # an fp32 bias, fp16 out
    (Epilogue(source=SourceKind.BIAS_RESIDUAL, bias_dtype="bf16"), ("bf16", "f32")),  # 16-bit bias, trailing cast
])
def test_fprop_bias_vector_epilogues(schedule, epi, dt):
    """The bias-vector kernels (element_bias, name `vbias<type>`): a bias with a residual, or a bias typed unlike the
    output, on every fprop schedule (pixel tiles through L1 and staged, "rows", "cols" and its register-capped twin,
    pipelined); C=20 is not a multiple of 8 (narrower vectors)."""
    p = problem_of("fprop", 20, 11, 13, 3, 1 if schedule in ("rows", "piped") else 2, dt, epilogue=epi)
    assert p.epilogue.bias_vector
    if schedule.startswith("cols"):
        cfg = depthwise_cols_config(p, 4, 4)
        cfg = min_blocks_variant(cfg) if schedule == "cols_capped" else cfg
    else:
        cfg = next(c for c in depthwise_candidates(p) if {
            "tile": c.schedule is None and not c.halo_smem, "halo": c.schedule is None and c.halo_smem and c.stages == 1,
            "rows": c.schedule == "rows", "piped": is_pipelined(c)}[schedule])
    assert cfg.element_bias is p.element_bias and f"_vbias{p.element_bias.value}_" in cfg.name
    check(p, cfg, 1, seed=len(schedule), alpha=0.75)


@pytest.mark.parametrize("pad", [1, 0, 3])
def test_dgrad_stride_1_rotated_filter_with_halo(pad):
    p = problem_of("dgrad", 16, 9, 13, 3, 1, pad=pad)
    check(p, config(p, 8, True), seed=pad)


def test_dgrad_strided_5x5_valid_taps_only():
    p = problem_of("dgrad", 20, 13, 10, 5, 2)
    check(p, config(p, 4, False))


@pytest.mark.parametrize("splits", [1, 3, None])
def test_wgrad_7x7_fp32_out_over_splits(splits):
    p = problem_of("wgrad", 10, 9, 12, 7, 1, ("f16", "f32"))
    cfg = config(p, 2, True)
    check(p, cfg, splits or pixel_tiles(cfg, p), seed=7)


def test_wgrad_strided_bf16_accumulates_into_a_residual():
    p = problem_of("wgrad", 16, 11, 11, 3, 2, ("bf16", "bf16"), epilogue=Epilogue(source=SourceKind.RESIDUAL))
    check(p, config(p.replace(epilogue=Epilogue()), 8, False), splits=2)


@pytest.mark.parametrize("kind, stride", [("fprop", 1), ("fprop", 2), ("dgrad", 1)])
def test_exact_channel_tile_of_a_non_power_of_two_vector_count(kind, stride):
    p = problem_of(kind, 48, 9, 19, 3, stride, epilogue=Epilogue(Activation.RELU, SourceKind.BIAS) if kind == "fprop"
                   else Epilogue())
    cfg = next(c for c in depthwise_candidates(p) if c.tile[2] == 48 and c.align_a == 8 and not c.halo_smem)
    assert cfg.threads == 192 and cfg.tile[:2] == (4, 16)  # 6 channel vectors x 32 pixel threads, strips of 2
    check(p, cfg, 1, seed=stride)


@pytest.mark.parametrize("kind, r, stride, steps, cols, dt, c, h, w, epi", [
    ("fprop", 3, 1, 4, 16, ("f16", "f16"), 24, 9, 21, Epilogue(Activation.RELU, SourceKind.BIAS)),  # ragged tail
    ("fprop", 3, 2, 2, 8, ("bf16", "f32"), 16, 13, 11, Epilogue(source=SourceKind.RESIDUAL)),
    ("fprop", 5, 1, 2, 8, ("f16", "f16"), 12, 7, 6, Epilogue(Activation.SILU)),  # C not a multiple of 8
    ("dgrad", 3, 1, 4, 16, ("f16", "f16"), 32, 11, 19, Epilogue()),                # rotated filter
    ("dgrad", 7, 1, 2, 8, ("f16", "f32"), 16, 10, 9, Epilogue()),
])
def test_fprop_and_dgrad_rows_schedule(kind, r, stride, steps, cols, dt, c, h, w, epi):
    p = problem_of(kind, c, h, w, r, stride, dt, epilogue=epi)
    _check_rows(p, steps, cols, seed=r + stride + steps)


@pytest.mark.parametrize("kind, pad", [("fprop", 0), ("dgrad", 0), ("dgrad", 3)])  # dgrad pad 3: rotated pad -1
def test_fprop_and_dgrad_rows_schedule_other_paddings(kind, pad):
    _check_rows(problem_of(kind, 16, 10, 13, 3, 1, pad=pad), 4, 8, seed=pad)


def _check_rows(p, steps, cols, seed):
    cfg = max((k for k in depthwise_candidates(p) if k.schedule == "rows" and k.stages == steps and k.tile[1] == cols),
              key=lambda k: k.align_a)  # the widest vector whose windows fit the registers (7x7: 4)
    check(p, cfg, 1, seed=seed)


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_default_launches_of_a_mobilenet_layer(kind):
    p = problem_of(kind, 32, 14, 14, 3, 2)
    launch = default_launch(p)
    check(p, launch.kernel, launch.split_k_slices)


@pytest.mark.parametrize("r, stride, steps, dt, c, h, w", [
    (3, 1, 4, ("f16", "f16"), 24, 9, 21),     # segments of 16 and a ragged 5-column tail, steps of 4
    (3, 2, 2, ("f16", "f32"), 16, 13, 11),    # stride 2, odd image, fp32 out
    (5, 1, 2, ("bf16", "bf16"), 12, 7, 6),    # 5x5 on a small image (C not a multiple of 8)
    (7, 2, 2, ("f16", "f32"), 8, 10, 17),     # 7x7 stride 2
])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_wgrad_rows_schedule(r, stride, steps, dt, c, h, w, splits):
    p = problem_of("wgrad", c, h, w, r, stride, dt)
    vec = max(v for v in (8, 4, 2) if c % v == 0 and r * r * v <= 128)
    cfg = depthwise_rows_config(p, vec, steps)
    check(p, cfg, splits or pixel_tiles(cfg, p), seed=r + stride)


@pytest.mark.parametrize("r, stride, steps, vec, dt, c, h, w", [
    (3, 1, 4, 8, ("f16", "f16"), 24, 9, 21),   # three filter-row groups, a ragged segment tail
    (5, 2, 2, 4, ("bf16", "f32"), 12, 13, 11),  # 5x5 stride 2, C not a multiple of 8, fp32 out
    (7, 1, 2, 8, ("f16", "f16"), 16, 8, 7),    # 7x7: 7 groups of 32 threads on a small image
])
@pytest.mark.parametrize("splits", [1, None])
def test_wgrad_taprows_schedule(r, stride, steps, vec, dt, c, h, w, splits):
    p = problem_of("wgrad", c, h, w, r, stride, dt)
    cfg = depthwise_rows_config(p, vec, steps, "taprows")
    assert cfg.threads == r * cfg.tile[0] * cfg.tile[2] // vec
    check(p, cfg, splits or pixel_tiles(cfg, p), seed=r + stride + 1)


def test_wgrad_rows_schedule_accumulates_into_a_residual_with_padding_0():
    p = problem_of("wgrad", 16, 11, 9, 3, 1, ("f16", "f16"), pad=0, epilogue=Epilogue(source=SourceKind.RESIDUAL))
    cfg = depthwise_rows_config(p.replace(epilogue=Epilogue()), 8, 4)
    check(p, cfg, splits=2, seed=3)


@pytest.mark.parametrize("r, stride, vec, run, shape, dt, c, h, w", [
    (3, 1, 4, 7, (32, 2), ("f16", "f16"), 24, 9, 21),    # a ragged last strip (21 columns) and run (9 rows)
    (3, 2, 4, 4, (16, 2), ("f16", "f32"), 16, 13, 11),   # stride 2: two new input rows per dy row, fp32 out
    (3, 1, 2, 8, (32, 4), ("bf16", "bf16"), 12, 7, 6),   # strips of 4, C not a multiple of 8, run past the image
    (5, 1, 2, 7, (32, 2), ("f16", "f16"), 10, 14, 9),    # 5x5
    (5, 2, 2, 4, (32, 1), ("bf16", "f32"), 6, 13, 12),   # 5x5 stride 2, strips of 1 column
    (7, 1, 1, 4, (32, 1), ("f16", "f16"), 5, 8, 7),      # 7x7, vector 1 (2-byte accesses)
])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_wgrad_cols_schedule(r, stride, vec, run, shape, dt, c, h, w, splits):
    """The "cols" wgrad: each thread walks column strips down, its input rows kept in registers (1 split: every
    strip through one CTA's slots; None: one strip per slot)."""
    p = problem_of("wgrad", c, h, w, r, stride, dt)
    cfg = depthwise_cols_config(p, vec, run, shape)
    assert "_cols%d_" % run in cfg.name and cfg.min_blocks is None
    check(p, cfg, splits or pixel_tiles(cfg, p), seed=r + stride + run)


@pytest.mark.parametrize("kind, r, stride, vec, run, shape, dt, c, h, w, epi", [
    ("fprop", 3, 1, 4, 7, (32, 2), ("f16", "f16"), 24, 9, 21, Epilogue(Activation.RELU, SourceKind.BIAS)),  # ragged
    ("fprop", 3, 2, 4, 4, (16, 2), ("bf16", "f32"), 16, 13, 11, Epilogue(source=SourceKind.RESIDUAL)),
    ("fprop", 5, 1, 2, 8, (32, 2), ("f16", "f16"), 12, 7, 6, Epilogue(Activation.SILU)),  # run past the image
    ("fprop", 5, 2, 2, 7, (32, 1), ("f16", "f16"), 10, 15, 12, Epilogue(Activation.RELU6, SourceKind.BIAS)),
    ("dgrad", 3, 1, 2, 7, (32, 4), ("f16", "f16"), 32, 11, 19, Epilogue()),  # rotated filter, strips of 4
    ("dgrad", 5, 1, 2, 4, (32, 2), ("f16", "f32"), 16, 10, 9, Epilogue()),
])
def test_fprop_and_dgrad_cols_schedule(kind, r, stride, vec, run, shape, dt, c, h, w, epi):
    p = problem_of(kind, c, h, w, r, stride, dt, epilogue=epi)
    cfg = depthwise_cols_config(p, vec, run, shape)
    assert "_cols%d_" % run in cfg.name and cfg.min_blocks is None
    check(p, cfg, 1, seed=r + stride + run)


@pytest.mark.parametrize("kind, r, stride, vec, run, prefetch, shape, dt, c, h, w, splits", [
    ("fprop", 3, 1, 4, 7, 2, (32, 2), ("f16", "f16"), 24, 9, 21, 1),    # a ragged last strip and run
    ("fprop", 3, 2, 2, 4, 3, (16, 2), ("bf16", "f32"), 16, 13, 11, 1),  # stride 2: two new rows per row, 3 ahead
    ("dgrad", 3, 1, 2, 7, 2, (32, 4), ("f16", "f16"), 32, 11, 19, 1),   # rotated filter, strips of 4
    ("wgrad", 3, 1, 4, 7, 2, (32, 2), ("f16", "f16"), 24, 9, 21, 3),
    ("wgrad", 3, 2, 2, 8, 3, (16, 2), ("f16", "f32"), 16, 13, 11, None),  # a run past the image's bottom edge
    ("dgrad", 5, 1, 2, 4, 2, (32, 1), ("bf16", "bf16"), 10, 14, 9, 1),  # 5x5, strips of 1 column
    # every load of the strip ahead (prefetch = rows - 1: the deep twin, depthwise.prefetch_variants)
    ("fprop", 3, 1, 2, 7, 6, (32, 2), ("f16", "f16"), 24, 9, 21, 1),
    ("dgrad", 5, 1, 2, 4, 3, (32, 1), ("bf16", "bf16"), 10, 14, 9, 1),
    ("wgrad", 3, 1, 2, 7, 6, (32, 2), ("f16", "f32"), 16, 9, 11, 2),
])
def test_cols_schedule_with_loads_rows_ahead(kind, r, stride, vec, run, prefetch, shape, dt, c, h, w, splits):
    """The "cols" kernels issuing their loads `prefetch` rows ahead (the prologue loads the first rows, each row the
    loads of row k + prefetch): the same results as one row ahead."""
    p = problem_of(kind, c, h, w, r, stride, dt)
    cfg = depthwise_cols_config(p, vec, run, shape, prefetch=prefetch)
    assert f"_cols{run}pf{prefetch}_" in cfg.name
    check(p, cfg, splits or pixel_tiles(cfg, p), seed=r + stride + run + prefetch)


@pytest.mark.parametrize("r, stride, pad, vec, run, shape, prefetch, dt, c, h, w, epi", [
    (3, 2, 1, 4, 4, (32, 2), None, ("f16", "f16"), 24, 13, 11, Epilogue()),  # odd pad: the first strip starts above dx
    (3, 2, 0, 8, 8, (16, 2), None, ("f16", "f16"), 16, 12, 10, Epilogue()),  # even pad; a run past dx's bottom edge
    (3, 2, 1, 4, 4, (32, 4), 2, ("bf16", "f32"), 16, 14, 15, Epilogue(source=SourceKind.RESIDUAL)),  # rows ahead
    (5, 2, 2, 2, 4, (32, 2), None, ("f16", "f16"), 10, 15, 12, Epilogue()),  # 5x5: up to 3 dy rows per dx row
    (5, 2, 3, 2, 8, (32, 2), 2, ("f16", "f16"), 12, 9, 13, Epilogue()),       # pad 3 (odd, past R // 2)
    (3, 2, 1, 4, 8, (32, 2), 7, ("f16", "f16"), 16, 14, 15, Epilogue()),      # every dy row ahead
    (3, (1, 2), 1, 4, 7, (32, 2), None, ("f16", "f16"), 16, 9, 11, Epilogue()),  # stride 1 x 2: rows as fprop's
    (5, (2, 1), 1, 2, 4, (32, 1), None, ("f16", "bf16"), 10, 11, 9, Epilogue()),  # stride 2 x 1, strips of 1 column
])
def test_strided_dgrad_cols_schedule(r, stride, pad, vec, run, shape, prefetch, dt, c, h, w, epi):
    """The strided dgrad "cols" kernel: strips aligned to the stride (the first one above / left of dx where the
    padding is odd), each dx row summing only its valid taps, known at compile time."""
    p = problem_of("dgrad", c, h, w, r, stride, dt, pad=pad, epilogue=epi)
    cfg = depthwise_cols_config(p, vec, run, shape, prefetch=prefetch)
    assert cfg.schedule == "cols" and cfg.kind.value == "dgrad" and cfg.conv_stride != (1, 1)
    check(p, cfg, 1, seed=r + pad + run)


@pytest.mark.parametrize("kind, stride, epi", [("fprop", 1, Epilogue(Activation.RELU, SourceKind.BIAS)),
                                              ("dgrad", 1, Epilogue()), ("dgrad", 2, Epilogue(source=SourceKind.RESIDUAL))])
def test_cols_register_capped_twin_reads_taps_from_shared_memory(kind, stride, epi):
    """The capped "cols" fprop / dgrad twin (min_blocks) keeps no taps in registers: it reads each filter row's taps
    from shared memory per output row (volatile shared loads on the GPU; plain loads in this CPU build)."""
    p = problem_of(kind, 16, 9, 11, 3, stride, epilogue=epi)
    plain = depthwise_cols_config(p, 4, 4)
    capped = min_blocks_variant(plain)
    assert capped is not None and capped.min_blocks and f"_mb{capped.min_blocks}_" in capped.name
    src = emulate_cuda.emulated_source(capped)
    assert "fresh_filter_row(filter, r, lane, wr);" in src and "float w[kR][kS][kVec];" not in src
    check(p, capped, 1, seed=11 + stride, alpha=0.5)


@pytest.mark.parametrize("kind, epi", [("fprop", Epilogue(Activation.RELU, SourceKind.BIAS)),
                                      ("fprop", Epilogue(source=SourceKind.RESIDUAL)), ("dgrad", Epilogue())])
def test_cols_schedule_scales_by_alpha(kind, epi):
    """The "cols" fprop / dgrad kernels fold alpha into their filter taps (y = act(conv(x, alpha * w) + beta * src)),
    one kernel instantiation per epilogue source: each gives act(alpha * conv + source)."""
    p = problem_of(kind, 16, 9, 11, 3, 1, epilogue=epi)
    check(p, depthwise_cols_config(p, 4, 4), 1, seed=7, alpha=0.375)


@pytest.mark.parametrize("kind, pad", [("fprop", 0), ("dgrad", 0), ("dgrad", 3)])  # dgrad pad 3: rotated pad -1
def test_fprop_and_dgrad_cols_schedule_other_paddings(kind, pad):
    p = problem_of(kind, 16, 10, 13, 3, 1, pad=pad)
    check(p, depthwise_cols_config(p, 4, 4), 1, seed=pad)


def test_wgrad_cols_accumulates_into_a_residual_with_padding_0():
    p = problem_of("wgrad", 16, 11, 9, 3, 1, ("f16", "f16"), pad=0, epilogue=Epilogue(source=SourceKind.RESIDUAL))
    check(p, depthwise_cols_config(p.replace(epilogue=Epilogue()), 4, 7), splits=2, seed=9)


@pytest.mark.parametrize("r, stride, vec, strip_cols, dt, c, h, w", [
    (3, 1, 8, 4, ("f16", "f16"), 24, 9, 21),    # three filter-row groups, C below the channel tile, ragged tiles
    (3, 1, 8, 2, ("f16", "f16"), 16, 7, 18),    # strips of 2
    (5, 2, 4, 4, ("bf16", "f32"), 12, 13, 11),  # 5x5 stride 2, C not a multiple of 8, fp32 out
    (7, 1, 2, 4, ("f16", "f16"), 10, 8, 7),     # 7x7, vector 2 (4-byte copies), a 7x7 image
    (3, 2, 1, 4, ("f16", "f16"), 5, 10, 9),     # vector 1: 2-byte accesses through registers
])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_wgrad_pipelined_tiles(r, stride, vec, strip_cols, dt, c, h, w, splits):
    """The pipelined wgrad: each split walks its tiles through both halo and dy buffers (1 split: every tile; None:
    one tile per split, nothing to prefetch)."""
    p = problem_of("wgrad", c, h, w, r, stride, dt)
    cfg = depthwise_pipelined_wgrad_config(p, vec, strip_cols=strip_cols)
    assert cfg.threads == r * 4 * 16 // strip_cols * 4 and cfg.stages == 2 and "_smem2_" in cfg.name
    check(p, cfg, splits or pixel_tiles(cfg, p), seed=r + stride + vec)


def test_wgrad_pipelined_accumulates_into_a_residual_with_padding_0():
    p = problem_of("wgrad", 16, 11, 9, 3, 1, ("f16", "f16"), pad=0, epilogue=Epilogue(source=SourceKind.RESIDUAL))
    cfg = depthwise_pipelined_wgrad_config(p.replace(epilogue=Epilogue()), 8)
    check(p, cfg, splits=2, seed=5)


@pytest.mark.parametrize("kind, stride, r, vectors, piped", [
    ("fprop", 1, 3, 4, False), ("fprop", 2, 5, 4, False), ("dgrad", 1, 3, 4, False), ("wgrad", 1, 3, 4, False),
    ("wgrad", 2, 3, 4, False), ("fprop", 1, 3, 4, True), ("fprop", 2, 3, 4, True), ("dgrad", 1, 5, 4, True),
    ("fprop", 1, 5, 4, True), ("fprop", 1, 3, 8, True), ("dgrad", 1, 3, 8, True),
])
def test_staged_halo_layouts(kind, stride, r, vectors, piped):
    """Staged halos of fewer than 8 channel vectors per pixel are stored with a pad column per strip window step
    (depthwise.pad_groups, against shared-memory bank conflicts); 8 vectors unpadded. Pipelined fprop/dgrad: two
    resident CTAs here (emulate_cuda), each walking many tiles through both buffers."""
    p = problem_of(kind, 40, 13, 19, r, stride, epilogue=Epilogue(Activation.RELU, SourceKind.BIAS) if kind == "fprop"
                   else Epilogue())
    cfg = next(c for c in depthwise_candidates(p) if c.halo_smem and not c.min_blocks and is_pipelined(c) == piped
               and lanes(c) == vectors)
    assert (pad_groups(cfg)[0] > 0) == (vectors < 8), (cfg.name, pad_groups(cfg))
    check(p, cfg, splits=3 if kind == "wgrad" else 1, seed=r + stride + vectors)


@pytest.mark.parametrize("case", depthwise_random_cases(), ids=random_case_id)
def test_random_problems_against_float64(case):
    """Seeded random problems: each through the untuned default launch (what a model gets without tuning) or one
    random candidate of its plan (a few splits for wgrad), on fresh operands with the output poisoned (the same
    cases as test_gpu_depthwise.py's, gpu_util.depthwise_random_cases)."""
    p, cfg, splits, seed = random_case_launch(case)
    check(p, cfg, splits, seed=seed % 1000)


@pytest.mark.parametrize("case", depthwise_odd_cases(), ids=random_case_id)
def test_odd_shapes_against_float64(case):
    """Strides 3-4, unequal strides, non-square and even filters: what models rarely have and the kernels accept
    (depthwise_problem_error), each through the default launch or a random candidate (gpu_util.depthwise_odd_cases,
    also on the GPU in test_gpu_depthwise.py)."""
    p, cfg, splits, seed = random_case_launch(case)
    check(p, cfg, splits, seed=seed % 1000)
