"""GPU correctness of the depthwise kernels (issue 12) against float64 PyTorch on fresh random inputs, outputs
poisoned with NaN first: fprop, dgrad and wgrad; 3x3, 5x5 and 7x7; stride 1 and 2; odd H and W; C not a multiple
of 8; fp16 and bf16; fp32 wgrad output; fused epilogues; wgrad split counts; the public ops.

Filter size, stride, types and activation are compile-time, so the matrix is chosen to need few kernels (one CTA
shape per kind and schedule, compiled in one parallel build): each kernel is reused over several shapes. The "rows"
wgrad schedule has its own cases (test_wgrad_rows_schedule*), the "cols" ones test_cols_wgrad,
test_cols_fprop_and_dgrad, test_cols_strided_dgrad and (loads more rows ahead) test_cols_loads_rows_ahead."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.config import KernelConfig, LaunchConfig  # noqa: E402
from cutlass_byoc.depthwise import (  # noqa: E402
    depthwise_candidates, is_wide_strip, min_blocks_variant, pixel_tiles, strip, with_alignments,
)
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.types import Activation, SourceKind  # noqa: E402

from gpu_util import (  # noqa: E402
    TOLERANCE, check_launch, depthwise_cols_config, depthwise_odd_cases, depthwise_pipelined_wgrad_config,
    depthwise_random_cases, depthwise_rows_config, epilogue_case, kernel_operands, module_kernels, operands,
    poisoned_output, random_case_id, random_case_launch, reference, rel_err,
)

pytestmark = pytest.mark.gpu

SHAPE = (4, 8, 8)  # the CTA shape of every kernel here: 4x8 pixels x 8 channel vectors (128 threads, strips of 2)


def problem_of(kind, c, h, w, r, stride, dt=("f16", "f16"), n=3, pad=None, epilogue=Epilogue()):
    return Conv2dProblem.make(kind, n, c, h, w, c, r, stride=stride, padding=r // 2 if pad is None else pad,
                              groups=c, dtype=dt[0], out_dtype=dt[1], epilogue=epilogue)


def kernel(problem: Conv2dProblem, vec: int, halo: bool) -> KernelConfig:
    """The config of the fixed CTA shape with this vector width and halo staging for the problem's kind, types,
    activation, filter and stride (the widest vector C=96 admits, narrowed where `vec` is narrower)."""
    wide = problem.replace(c=96, k=96, groups=96)
    for c in depthwise_candidates(wide):  # widest vector first
        if c.halo_smem == halo and c.tile[:2] == SHAPE[:2] and c.tile[2] == SHAPE[2] * c.align_a:
            assert c.align_a >= vec, (c.name, vec)
            return c if c.align_a == vec else with_alignments(c, vec, vec, vec)
    raise AssertionError(f"no {SHAPE} config for {wide.name}")


# (kind, dtypes, R, stride, vector, halo in smem): the kernels, each run on every shape of SHAPES below that its
# vector width divides C of.
KERNELS = [
    ("fprop", ("f16", "f16"), 3, 1, 8, False),
    ("fprop", ("f16", "f16"), 3, 2, 4, True),
    ("fprop", ("f16", "f16"), 5, 2, 8, True),
    ("fprop", ("f16", "f16"), 7, 1, 4, False),
    ("fprop", ("bf16", "bf16"), 3, 1, 4, True),
    ("dgrad", ("f16", "f16"), 3, 1, 8, True),
    ("dgrad", ("f16", "f16"), 3, 2, 4, False),
    ("dgrad", ("f16", "f16"), 5, 1, 4, False),
    ("dgrad", ("f16", "f16"), 7, 2, 8, False),
    ("dgrad", ("bf16", "bf16"), 3, 2, 8, False),
    ("wgrad", ("f16", "f16"), 3, 1, 8, False),
    ("wgrad", ("f16", "f32"), 3, 2, 4, True),
    ("wgrad", ("f16", "f16"), 5, 2, 4, False),
    ("wgrad", ("f16", "f32"), 7, 1, 2, True),
    ("wgrad", ("bf16", "f32"), 3, 1, 4, False),
    ("fprop", ("f16", "f16"), 3, 1, 1, True),   # 2-byte halo accesses: loaded through registers, not cp.async
    ("wgrad", ("f16", "f16"), 3, 1, 1, True),
    ("fprop", ("f32", "f32"), 5, 1, 1, True),   # 4-byte cp.async of the halo
]
# (C, H, W): odd sizes, C a multiple of 8 and not, a tile-sized and a one-pixel-wide image
SHAPES = [(96, 15, 13), (36, 17, 9), (20, 6, 31), (64, 1, 11)]

EPI_KERNEL_DT = ("f16", "f16")
EPILOGUES = [Epilogue(Activation.RELU, SourceKind.BIAS), Epilogue(Activation.RELU, SourceKind.RESIDUAL),
             Epilogue(Activation.RELU6, SourceKind.BIAS), Epilogue(Activation.RELU6),
             Epilogue(Activation.SILU, SourceKind.BIAS), Epilogue(Activation.GELU), Epilogue(Activation.HARDSWISH),
             Epilogue(Activation.SIGMOID), Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL)]


def cases():
    return [(kind, dt, r, stride, vec, halo, c, h, w)
            for kind, dt, r, stride, vec, halo in KERNELS for c, h, w in SHAPES if c % vec == 0]


CASES = cases()


def epilogue_problems(epilogue):
    """fp16 3x3 stride 1; and for SiLU + bias also fp16 in, fp32 out, stride 2."""
    out = [problem_of("fprop", 96, 15, 13, 3, 1, ("f16", "f16"), epilogue=epilogue)]
    if epilogue == EPILOGUES[2]:
        out.append(problem_of("fprop", 96, 15, 13, 3, 2, ("f16", "f32"), epilogue=epilogue))
    return out


def epilogue_kernel(problem):
    return kernel(problem, 8, problem.epilogue.source is SourceKind.RESIDUAL and problem.stride_h == 1)


def epilogue_kernels():
    return [epilogue_kernel(p) for e in EPILOGUES for p in epilogue_problems(e)]


# The "rows" wgrad schedule (dy row segments, several loads in flight per thread): (dtypes, R, stride, vector, columns
# per step), each run on every shape of SHAPES its vector divides C of, with 1, a few and the most splits.
# The "taprows" variant splits the filter rows over R groups of threads: (..., "taprows").
ROWS_KERNELS = [
    (("f16", "f16"), 3, 1, 8, 4, "rows"),
    (("f16", "f32"), 3, 2, 8, 2, "rows"),
    (("bf16", "f32"), 5, 1, 4, 2, "rows"),
    (("f16", "f16"), 7, 2, 2, 2, "rows"),
    (("f16", "f16"), 5, 1, 8, 4, "taprows"),
    (("bf16", "f32"), 5, 2, 8, 2, "taprows"),
    (("f16", "f32"), 7, 1, 8, 2, "taprows"),
    (("f16", "f16"), 3, 2, 4, 4, "taprows"),
]
ROWS_CASES = [(dt, r, stride, vec, steps, sched, c, h, w)
              for dt, r, stride, vec, steps, sched in ROWS_KERNELS for c, h, w in SHAPES if c % vec == 0]


def rows_kernels():
    return [depthwise_rows_config(problem_of("wgrad", 96, 15, 13, r, stride, dt), vec, steps, sched)
            for dt, r, stride, vec, steps, sched in ROWS_KERNELS]


# Channel tiles of a non-power-of-two vector count (6 vectors of 8: C=48 in one block, 96 and 144 in 2 and 3): (kind,
# stride, halo in smem), each run on C = 48, 96, 144.
EXACT_KERNELS = [("fprop", 1, False), ("fprop", 2, True), ("dgrad", 1, True), ("dgrad", 2, False)]


def exact_kernel(kind, stride, halo):
    p = problem_of(kind, 48, 15, 13, 3, stride)
    return next(c for c in depthwise_candidates(p) if c.tile[2] == 48 and c.align_a == 8 and c.halo_smem == halo)


# Wide strips (8 columns per thread, the CTA 8x16 pixels x 8 vectors): (kind, dtypes, R, stride, vector, halo in
# smem, epilogue), each run on every shape of SHAPES its vector divides C of (images narrower than a strip included).
WIDE_KERNELS = [
    ("fprop", ("f16", "f16"), 5, 1, 4, False, Epilogue(Activation.RELU, SourceKind.BIAS)),
    ("fprop", ("f16", "f16"), 5, 1, 4, True, Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL)),
    ("fprop", ("bf16", "f32"), 3, 2, 4, True, Epilogue(Activation.SILU)),
    ("fprop", ("f16", "f16"), 7, 1, 8, False, Epilogue()),
    ("dgrad", ("f16", "f16"), 5, 1, 8, True, Epilogue()),
    ("dgrad", ("f16", "f32"), 3, 1, 4, False, Epilogue()),
]


def wide_kernel(kind, dt, r, stride, vec, halo, epi):
    p = problem_of(kind, 96, 15, 13, r, stride, dt, epilogue=epi)
    cfg = next(c for c in depthwise_candidates(p) if is_wide_strip(c) and c.tile[:2] == (8, 16) and
               c.tile[2] // c.align_a == 8 and c.halo_smem == halo and c.align_a >= vec and not c.min_blocks)
    return cfg if cfg.align_a == vec else with_alignments(cfg, vec, vec, vec)


# Pipelined kernels (resident CTAs walking the pixel tiles, double-buffered halo; CTA 4x8 pixels x 8 vectors):
# (kind, dtypes, R, stride, vector, epilogue), each run on every shape of SHAPES its vector divides C of, and on one
# problem of many more tiles than the GPU holds CTAs (each CTA then takes several, in both halo buffers).
PIPELINED_KERNELS = [
    ("fprop", ("f16", "f16"), 3, 1, 8, Epilogue(Activation.RELU, SourceKind.BIAS)),
    ("fprop", ("f16", "f16"), 5, 2, 4, Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL)),
    ("fprop", ("bf16", "bf16"), 7, 1, 4, Epilogue(Activation.HARDSWISH)),
    ("dgrad", ("f16", "f16"), 3, 1, 8, Epilogue()),
    ("dgrad", ("f16", "f32"), 5, 1, 4, Epilogue()),
]


def pipelined_kernel(kind, dt, r, stride, vec, epi):
    p = problem_of(kind, 96, 15, 13, r, stride, dt, epilogue=epi)
    cfg = next(c for c in depthwise_candidates(p) if c.stages == 2 and c.tile[:2] == (4, 8) and
               c.tile[2] // c.align_a == 8 and c.align_a >= vec and not c.min_blocks)
    return cfg if cfg.align_a == vec else with_alignments(cfg, vec, vec, vec)


# The pipelined wgrad (filter rows over thread groups, halo and dy tiles double-buffered): (dtypes, R, stride, vector,
# strip columns, epilogue); a 4x16-pixel dy tile of 4 channel vectors, narrowed to the vector C needs.
PIPELINED_WGRAD_KERNELS = [
    (("f16", "f16"), 3, 1, 8, 4, Epilogue()),
    (("f16", "f32"), 3, 2, 8, 2, Epilogue()),
    (("bf16", "f32"), 5, 1, 4, 4, Epilogue()),
    (("f16", "f16"), 5, 2, 4, 4, Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL)),
    (("f16", "f16"), 7, 1, 2, 4, Epilogue()),
]


def pipelined_wgrad_kernel(dt, r, stride, vec, strip_cols, epi):
    cfg = depthwise_pipelined_wgrad_config(problem_of("wgrad", 96, 15, 13, r, stride, dt), 8 if vec == 8 else 4,
                                           strip_cols=strip_cols)
    return cfg if cfg.align_a == vec else with_alignments(cfg, vec, vec, vec)


# The "rows" schedule of fprop and stride-1 dgrad (one output row segment per thread, kStep columns per step):
# (kind, dtypes, R, stride, columns per step, segment columns, epilogue), the widest vector that fits (C=96 twin),
# narrowed to 4 where C needs it.
ROWS_FPROP_KERNELS = [
    ("fprop", ("f16", "f16"), 3, 1, 4, 16, Epilogue(Activation.RELU, SourceKind.BIAS)),
    ("fprop", ("bf16", "bf16"), 3, 2, 2, 8, Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL)),
    ("fprop", ("f16", "f32"), 5, 1, 2, 8, Epilogue(Activation.SILU)),
    ("fprop", ("f16", "f16"), 7, 2, 2, 16, Epilogue()),
    ("dgrad", ("f16", "f16"), 3, 1, 4, 16, Epilogue()),
    ("dgrad", ("bf16", "f32"), 5, 1, 2, 8, Epilogue()),
]


def rows_fprop_kernel(kind, dt, r, stride, steps, cols, epi):
    p = problem_of(kind, 96, 15, 13, r, stride, dt, epilogue=epi)
    return max((k for k in depthwise_candidates(p) if k.schedule == "rows" and k.stages == steps and k.tile[1] == cols
                and k.tile[2] // k.align_a in (4, 8, 16)), key=lambda k: (k.align_a, k.tile[2]))


def capped_kernels():
    """Register-capped twins (min_blocks) of one kernel of each schedule: pixel tiles through L1 and staged, strided
    dgrad, the fprop and stride-1 dgrad "rows" kernels, and the wgrad "rows" and "taprows" kernels."""
    base = [kernel(problem_of(kind, 96, 15, 13, r, stride, dt), vec, halo)
            for kind, dt, r, stride, vec, halo in KERNELS[:1] + KERNELS[1:2] + KERNELS[6:7]]
    base += [rows_fprop_kernel(*k) for k in ROWS_FPROP_KERNELS[:1] + ROWS_FPROP_KERNELS[4:5]]
    base += rows_kernels()[:1] + rows_kernels()[4:5]
    base += [kernel(problem_of("wgrad", 96, 15, 13, 3, 1), 8, False)]
    out = [min_blocks_variant(k) for k in base]
    assert all(k is not None and k.min_blocks >= 2 for k in out)
    return out


# The bias-vector fprop kernels (element_bias): a bias with a residual, or a bias typed unlike the output, on the
# pixel-tile schedule (halo staged), "cols" and the pipelined one: (schedule, dtypes, epilogue, C, H, W, stride)
BIAS_VECTOR_CASES = [
    ("halo", ("f16", "f16"), Epilogue(Activation.RELU, SourceKind.BIAS_RESIDUAL), 96, 15, 13, 1),
    ("cols", ("f16", "f16"), Epilogue(Activation.RELU6, SourceKind.BIAS_RESIDUAL, "f32"), 144, 14, 14, 1),
    ("cols", ("bf16", "bf16"), Epilogue(Activation.SILU, SourceKind.BIAS, "f32"), 40, 17, 9, 2),
    ("piped", ("f16", "f32"), Epilogue(Activation.HARDSWISH, SourceKind.BIAS_RESIDUAL, "f16"), 96, 15, 13, 1),
    ("halo", ("f16", "f32"), Epilogue(source=SourceKind.BIAS, bias_dtype="f16"), 24, 9, 21, 2),  # trailing cast
]


def bias_vector_case(schedule, dt, epilogue, c, h, w, stride):
    """(problem, config) of a BIAS_VECTOR_CASES row: the first candidate of that schedule."""
    from cutlass_byoc.depthwise import COLS, is_pipelined  # noqa: PLC0415

    problem = problem_of("fprop", c, h, w, 3, stride, dt, n=4, epilogue=epilogue)
    want = {"halo": lambda k: k.schedule is None and k.halo_smem and k.stages == 1 and k.min_blocks is None,
            "cols": lambda k: k.schedule == COLS and k.prefetch is None and k.min_blocks is None,
            "piped": is_pipelined}[schedule]
    return problem, next(k for k in depthwise_candidates(problem) if want(k))


@pytest.mark.parametrize("case", BIAS_VECTOR_CASES, ids=lambda k: f"{k[0]}-{k[2].tag}-{k[1][0]}_{k[1][1]}-c{k[3]}")
def test_bias_vector_epilogues(case):
    """act(conv + residual + bias) with the bias in its own type, against float64, fresh operands, poisoned output;
    the bias scaled x100 where the output is fp32 (a bias rounded to 16 bits on the way would show)."""
    problem, cfg = bias_vector_case(*case)
    assert cfg.element_bias is problem.element_bias and "_vbias" in cfg.name
    check_epilogue(problem, cfg, 1, case[3] + case[4])


def check_epilogue(problem, cfg, splits, seed):
    """`cfg` on `problem` with every epilogue source it has (a bias in its own type, a residual, both), against
    float64 on fresh operands, the output poisoned; the sources scaled x100 where 16-bit inputs give an fp32 output,
    against a tighter bound (a bias rounded to 16 bits on the way would show)."""
    tight = problem.element_out.value == "f32" and problem.element_a.bits == 16
    check_launch(problem, LaunchConfig(cfg, splits), seed, source_scale=100.0 if tight else 1.0,
                 bound=1e-4 if tight else None)


@pytest.mark.parametrize("case", depthwise_random_cases(), ids=random_case_id)
def test_random_problems_against_float64(case):
    """The seeded random problems of tests/test_depthwise_emulated.py on the GPU: each through the untuned default
    launch or one random candidate of its plan, every epilogue source, against float64."""
    problem, cfg, splits, seed = random_case_launch(case)
    check_epilogue(problem, cfg, splits, seed % 1000)


@pytest.mark.parametrize("case", depthwise_odd_cases(), ids=random_case_id)
def test_odd_shapes_against_float64(case):
    """tests/test_depthwise_emulated.py's odd shapes (strides 3-4, unequal strides, non-square and even filters) on
    the GPU."""
    problem, cfg, splits, seed = random_case_launch(case)
    check_epilogue(problem, cfg, splits, seed % 1000)


def all_kernels():
    ks = [kernel(problem_of(kind, 96, 15, 13, r, stride, dt), vec, halo) for kind, dt, r, stride, vec, halo in KERNELS]
    ks += capped_kernels()
    ks += [exact_kernel(*k) for k in EXACT_KERNELS]
    for k in ROWS_FPROP_KERNELS:
        cfg = rows_fprop_kernel(*k)
        ks += [cfg] + ([with_alignments(cfg, 4, 4, 4)] if cfg.align_a > 4 else [])
    ks += [wide_kernel(*k) for k in WIDE_KERNELS] + [pipelined_kernel(*k) for k in PIPELINED_KERNELS]
    ks += [pipelined_wgrad_kernel(*k) for k in PIPELINED_WGRAD_KERNELS]
    ks += [cols_kernel(*k) for k in COLS_KERNELS]
    ks += [cols_fprop_kernel(*k) for k in COLS_FPROP_KERNELS]
    ks += [cols_ahead_kernel(*k) for k in COLS_AHEAD_KERNELS]
    ks += [cols_strided_dgrad_kernel(*k) for k in COLS_STRIDED_DGRAD_KERNELS]
    ks += cols_capped_kernels()
    ks += [graph_kernel()]
    ks += [cluster_kernel(*k) for k in CLUSTER_KERNELS]
    ks += [bias_vector_case(*k)[1] for k in BIAS_VECTOR_CASES]
    ks += [random_case_launch(k)[1] for k in depthwise_random_cases()]
    return list(dict.fromkeys(ks + epilogue_kernels() + rows_kernels()))


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, all_kernels):
        yield


def run_checked(problem, cfg, seed, splits=1, source=None, ref=None, x=None, w=None, dy=None):
    if x is None:
        x, w, dy = operands(problem, seed)
    a, b = kernel_operands(problem, x, w, dy)
    out = poisoned_output(problem)
    ops.run_problem(problem, a, b, out, source, config=LaunchConfig(cfg, splits))
    torch.cuda.synchronize()
    if ref is None:
        ref = reference(problem, x, w, dy)
    err = rel_err(out, ref)
    bound = TOLERANCE[problem.element_out]
    assert not math.isnan(err), f"{cfg.name}: NaN in output (unwritten or invalid) for {problem.name}"
    assert err < bound, f"{cfg.name} on {problem.name} ({splits} splits): relative error {err:.3e} >= {bound}"
    return err


@pytest.mark.parametrize("kind, dt, r, stride, vec, halo, c, h, w", CASES,
                         ids=[f"{k}-{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-{'smem' if hl else 'l1'}-c{c}-{h}x{w}"
                              for k, d, r, s, v, hl, c, h, w in CASES])
def test_kind_filter_stride_shape(kind, dt, r, stride, vec, halo, c, h, w):
    problem = problem_of(kind, c, h, w, r, stride, dt)
    cfg = kernel(problem_of(kind, 96, 15, 13, r, stride, dt), vec, halo)
    assert cfg.reject_reason(problem) is None
    splits = 1
    if kind == "wgrad":  # a few splits of N*P*Q, never more than there are pixel tiles
        splits = min(5, pixel_tiles(cfg, problem))
    run_checked(problem, cfg, seed=hash((kind, dt, r, stride, c, h, w)) % 2**31, splits=splits)


@pytest.mark.parametrize("dt, r, stride, vec, steps, sched, c, h, w", ROWS_CASES,
                         ids=[f"{sc}-{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-step{st}-c{c}-{h}x{w}"
                              for d, r, s, v, st, sc, c, h, w in ROWS_CASES])
def test_wgrad_rows_schedule(dt, r, stride, vec, steps, sched, c, h, w):
    problem = problem_of("wgrad", c, h, w, r, stride, dt)
    cfg = depthwise_rows_config(problem, vec, steps, sched)
    assert cfg.reject_reason(problem) is None
    x, w_, dy = operands(problem, seed=hash((r, stride, c, h, w)) % 2**31)
    ref = reference(problem, x, w_, dy)
    most = pixel_tiles(cfg, problem)
    for splits in sorted({1, min(3, most), most}):
        run_checked(problem, cfg, 0, splits=splits, ref=ref, x=x, w=w_, dy=dy)


def test_wgrad_rows_schedule_split_counts_on_a_mobilenet_layer():
    problem = problem_of("wgrad", 96, 28, 28, 3, 1, ("f16", "f16"), n=32)
    cfg = depthwise_rows_config(problem, 8, 4)
    x, w, dy = operands(problem, 6)
    ref = reference(problem, x, w, dy)
    most = pixel_tiles(cfg, problem)  # 14 here: 8 * 28 * 2 segments of 16 columns over 32 segment threads
    for splits in sorted({1, 2, 7, most} | ({64} if most >= 64 else set())):
        run_checked(problem, cfg, 6, splits=splits, ref=ref, x=x, w=w, dy=dy)


@pytest.mark.parametrize("kind, dt, r, stride, steps, cols, epi", ROWS_FPROP_KERNELS,
                         ids=[f"{k}-{d[0]}to{d[1]}-{r}x{r}-s{s}-step{st}-cols{co}-{e.tag}"
                              for k, d, r, s, st, co, e in ROWS_FPROP_KERNELS])
def test_fprop_and_dgrad_rows_schedule(kind, dt, r, stride, steps, cols, epi):
    wide = rows_fprop_kernel(kind, dt, r, stride, steps, cols, epi)
    for c, h, w in SHAPES:
        cfg = wide if c % wide.align_a == 0 else with_alignments(wide, 4, 4, 4)
        problem = problem_of(kind, c, h, w, r, stride, dt, epilogue=epi)
        assert cfg.reject_reason(problem) is None, cfg.name
        check_launch(problem, LaunchConfig(cfg, 1), seed=c + h + r)


@pytest.mark.parametrize("index", range(8))
def test_register_capped_kernels(index):
    """min_blocks twins (__launch_bounds__ with a CTA count: registers capped, spills allowed) compute the same."""
    cfg = capped_kernels()[index]
    kind = cfg.kind.value
    r, stride = cfg.filter_rs[0], cfg.conv_stride[0]
    dt = (cfg.element_a.value, cfg.element_out.value)
    epi = Epilogue(cfg.activation, SourceKind.BIAS) if kind == "fprop" and cfg.activation is not Activation.IDENTITY \
        else Epilogue()
    for c, h, w in SHAPES[:2]:
        k = cfg if c % cfg.align_a == 0 else with_alignments(cfg, 4, 4, 4)
        problem = problem_of(kind, c, h, w, r, stride, dt, epilogue=epi)
        if k.reject_reason(problem) is not None:
            continue
        splits = min(3, pixel_tiles(k, problem)) if kind == "wgrad" else 1
        check_launch(problem, LaunchConfig(k, splits), seed=c + h + index)


@pytest.mark.parametrize("kind, stride, halo", EXACT_KERNELS)
def test_exact_channel_tiles(kind, stride, halo):
    cfg = exact_kernel(kind, stride, halo)
    assert cfg.threads == 192 and cfg.tile[2] == 48
    for c in (48, 96, 144):
        problem = problem_of(kind, c, 17, 11, 3, stride)
        run_checked(problem, cfg, seed=c + stride)


@pytest.mark.parametrize("kind, dt, r, stride, vec, halo, epi", WIDE_KERNELS,
                         ids=[f"{k}-{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-{'smem' if hl else 'l1'}-{e.tag}"
                              for k, d, r, s, v, hl, e in WIDE_KERNELS])
def test_wide_strips(kind, dt, r, stride, vec, halo, epi):
    cfg = wide_kernel(kind, dt, r, stride, vec, halo, epi)
    assert strip(cfg) == 8 and cfg.align_a == vec
    for c, h, w in SHAPES:
        if c % vec:
            continue
        problem = problem_of(kind, c, h, w, r, stride, dt, epilogue=epi)
        assert cfg.reject_reason(problem) is None
        check_launch(problem, LaunchConfig(cfg, 1), seed=c * 7 + h)


@pytest.mark.parametrize("kind, dt, r, stride, vec, epi", PIPELINED_KERNELS,
                         ids=[f"{k}-{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-{e.tag}"
                              for k, d, r, s, v, e in PIPELINED_KERNELS])
def test_pipelined(kind, dt, r, stride, vec, epi):
    cfg = pipelined_kernel(kind, dt, r, stride, vec, epi)
    assert cfg.stages == 2 and cfg.halo_smem and "_smem2_" in cfg.name
    # (C, H, W, N): SHAPES, then C=72 (2 or 3 channel blocks, the last part-idle) over 32 images of 64x64: 1,024
    # (stride 2) or 4,096 tiles per channel block, several per resident CTA
    for c, h, w, n in [(c, h, w, 3) for c, h, w in SHAPES] + [(72, 64, 64, 32)]:
        if c % vec:
            continue
        problem = problem_of(kind, c, h, w, r, stride, dt, n=n, epilogue=epi)
        assert cfg.reject_reason(problem) is None
        check_launch(problem, LaunchConfig(cfg, 1), seed=c * 3 + h + n)


@pytest.mark.parametrize("dt, r, stride, vec, strip_cols, epi", PIPELINED_WGRAD_KERNELS,
                         ids=[f"{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-strip{j}-{e.tag}"
                              for d, r, s, v, j, e in PIPELINED_WGRAD_KERNELS])
def test_pipelined_wgrad(dt, r, stride, vec, strip_cols, epi):
    cfg = pipelined_wgrad_kernel(dt, r, stride, vec, strip_cols, epi)
    assert cfg.stages == 2 and cfg.halo_smem and "_smem2_" in cfg.name and strip(cfg) == strip_cols
    # SHAPES at 1 split (every tile through both buffer pairs), 3 and one tile per split; then C=72 over 32 images of
    # 64x64 (2 or 3 channel blocks, the last part-idle) at 64 splits: 16 or 64 tiles per CTA
    for c, h, w, n in [(c, h, w, 3) for c, h, w in SHAPES] + [(72, 64, 64, 32)]:
        if c % vec:
            continue
        problem = problem_of("wgrad", c, h, w, r, stride, dt, n=n, epilogue=epi)
        assert cfg.reject_reason(problem) is None
        tiles = pixel_tiles(cfg, problem)
        for splits in ([1, 3, tiles] if n == 3 else [64]):
            check_launch(problem, LaunchConfig(cfg, min(splits, tiles)), seed=c * 3 + h + n + splits)


# The "cols" wgrad (each thread walks column strips down, its input rows in registers): (dtypes, R, stride, vector,
# strip rows, (slots, strip columns), epilogue, register-capped twin).
COLS_KERNELS = [
    (("f16", "f16"), 3, 1, 4, 7, (32, 2), Epilogue(), False),
    (("f16", "f32"), 3, 2, 4, 4, (16, 2), Epilogue(), False),
    (("bf16", "bf16"), 3, 1, 2, 8, (32, 4), Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL), False),
    (("f16", "f16"), 5, 1, 2, 7, (32, 2), Epilogue(), False),
    (("bf16", "f32"), 5, 2, 2, 4, (32, 1), Epilogue(), False),
    (("f16", "f16"), 3, 1, 4, 14, (64, 2), Epilogue(), True),
    (("f16", "f16"), 5, 1, 2, 7, (32, 2), Epilogue(), True),
]


def cols_kernel(dt, r, stride, vec, run, shape, epi, capped):
    cfg = depthwise_cols_config(problem_of("wgrad", 96, 15, 13, r, stride, dt), vec, run, shape)
    return min_blocks_variant(cfg) if capped else cfg


@pytest.mark.parametrize("dt, r, stride, vec, run, shape, epi, capped", COLS_KERNELS,
                         ids=[f"{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-run{n}-{sh[0]}x{sh[1]}-{e.tag}{'-mb' if cp else ''}"
                              for d, r, s, v, n, sh, e, cp in COLS_KERNELS])
def test_cols_wgrad(dt, r, stride, vec, run, shape, epi, capped):
    cfg = cols_kernel(dt, r, stride, vec, run, shape, epi, capped)
    assert f"_cols{run}_" in cfg.name and (cfg.min_blocks is not None) == capped
    # SHAPES at 1 split (every strip through one CTA), 3 and one slot's strips per split; then C=144 over 32 images
    # of 56x56 (a MobileNetV2 layer's size: 9 or more channel blocks) at 1, 64 and the most splits
    for c, h, w, n in [(c, h, w, 3) for c, h, w in SHAPES] + [(144, 56, 56, 32)]:
        if c % vec:
            continue
        problem = problem_of("wgrad", c, h, w, r, stride, dt, n=n, epilogue=epi)
        assert cfg.reject_reason(problem) is None
        most = pixel_tiles(cfg, problem)
        for splits in sorted({1, min(3, most) if n == 3 else min(64, most), most}):
            check_launch(problem, LaunchConfig(cfg, splits), seed=c * 3 + h + n + splits)


# The "cols" schedule of fprop and stride-1 dgrad (one output column strip per thread, its input rows in registers):
# (kind, dtypes, R, stride, vector, strip rows, (slots, strip columns), epilogue).
COLS_FPROP_KERNELS = [
    ("fprop", ("f16", "f16"), 3, 1, 4, 7, (32, 2), Epilogue(Activation.RELU6, SourceKind.BIAS)),
    ("fprop", ("bf16", "f32"), 3, 2, 4, 8, (16, 2), Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL)),
    ("fprop", ("f16", "f16"), 5, 1, 2, 14, (64, 2), Epilogue(Activation.SILU)),
    ("fprop", ("f16", "f16"), 5, 2, 2, 4, (32, 1), Epilogue()),
    ("dgrad", ("f16", "f16"), 3, 1, 4, 7, (32, 2), Epilogue()),
    ("dgrad", ("f16", "f32"), 5, 1, 2, 4, (32, 2), Epilogue()),
]


def cols_fprop_kernel(kind, dt, r, stride, vec, run, shape, epi):
    return depthwise_cols_config(problem_of(kind, 96, 15, 13, r, stride, dt, epilogue=epi), vec, run, shape)


@pytest.mark.parametrize("kind, dt, r, stride, vec, run, shape, epi", COLS_FPROP_KERNELS,
                         ids=[f"{k}-{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-run{n}-{sh[0]}x{sh[1]}-{e.tag}"
                              for k, d, r, s, v, n, sh, e in COLS_FPROP_KERNELS])
def test_cols_fprop_and_dgrad(kind, dt, r, stride, vec, run, shape, epi):
    cfg = cols_fprop_kernel(kind, dt, r, stride, vec, run, shape, epi)
    assert f"_cols{run}_" in cfg.name and cfg.min_blocks is None
    # SHAPES (odd sizes, a one-row image, strips and runs past the edges), then a MobileNetV2 layer's size
    for c, h, w, n in [(c, h, w, 3) for c, h, w in SHAPES] + [(144, 56, 56, 32)]:
        if c % vec:
            continue
        problem = problem_of(kind, c, h, w, r, stride, dt, n=n, epilogue=epi)
        assert cfg.reject_reason(problem) is None
        check_launch(problem, LaunchConfig(cfg, 1), seed=c * 5 + h + n)


# The "cols" kernels loading `prefetch` rows ahead (the prefetch twins the planner times beside their kernels):
# (kind, dtypes, R, stride, vector, strip rows, (slots, strip columns), epilogue, rows ahead).
COLS_AHEAD_KERNELS = [
    ("fprop", ("f16", "f16"), 3, 1, 4, 7, (32, 2), Epilogue(Activation.RELU6, SourceKind.BIAS), 2),
    ("fprop", ("bf16", "f32"), 3, 2, 2, 8, (16, 2), Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL), 3),
    ("dgrad", ("f16", "f16"), 3, 1, 4, 7, (32, 2), Epilogue(), 2),
    ("dgrad", ("f16", "f32"), 5, 1, 2, 4, (32, 1), Epilogue(), 2),
    ("wgrad", ("f16", "f16"), 3, 1, 4, 7, (32, 2), Epilogue(), 2),
    ("wgrad", ("f16", "f32"), 3, 2, 2, 4, (16, 2), Epilogue(), 3),
    # every load of the strip ahead (prefetch = rows - 1: the deep twins of depthwise.prefetch_variants)
    ("fprop", ("f16", "f16"), 3, 1, 4, 7, (32, 1), Epilogue(Activation.SILU, SourceKind.BIAS), 6),
    ("dgrad", ("bf16", "bf16"), 3, 1, 2, 8, (16, 2), Epilogue(), 7),
    ("wgrad", ("f16", "f32"), 3, 1, 2, 7, (32, 2), Epilogue(), 6),
]


def cols_ahead_kernel(kind, dt, r, stride, vec, run, shape, epi, prefetch):
    return depthwise_cols_config(problem_of(kind, 96, 15, 13, r, stride, dt, epilogue=epi), vec, run, shape,
                                 prefetch=prefetch)


@pytest.mark.parametrize("kind, dt, r, stride, vec, run, shape, epi, prefetch", COLS_AHEAD_KERNELS,
                         ids=[f"{k}-{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-run{n}-{sh[0]}x{sh[1]}-{e.tag}-pf{pf}"
                              for k, d, r, s, v, n, sh, e, pf in COLS_AHEAD_KERNELS])
def test_cols_loads_rows_ahead(kind, dt, r, stride, vec, run, shape, epi, prefetch):
    cfg = cols_ahead_kernel(kind, dt, r, stride, vec, run, shape, epi, prefetch)
    assert f"_cols{run}pf{prefetch}_" in cfg.name
    # SHAPES (odd sizes, a one-row image, strips and runs past the edges), then a MobileNetV2 layer's size; wgrad at
    # 1, 3 or 64, and the most splits
    for c, h, w, n in [(c, h, w, 3) for c, h, w in SHAPES] + [(144, 56, 56, 32)]:
        if c % vec:
            continue
        problem = problem_of(kind, c, h, w, r, stride, dt, n=n, epilogue=epi)
        assert cfg.reject_reason(problem) is None
        most = pixel_tiles(cfg, problem) if kind == "wgrad" else 1
        for splits in sorted({1, min(3 if n == 3 else 64, most), most}):
            check_launch(problem, LaunchConfig(cfg, splits), seed=c * 7 + h + n + splits + prefetch)


# The strided dgrad's "cols" schedule (dx column strips aligned to the stride, each dx row's valid taps fixed at
# compile time): (dtypes, R, stride, vector, strip rows, (slots, strip columns), epilogue, rows ahead).
COLS_STRIDED_DGRAD_KERNELS = [
    (("f16", "f16"), 3, 2, 8, 8, (16, 2), Epilogue(), None),
    (("f16", "f16"), 3, 2, 4, 4, (32, 4), Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL), 2),
    (("bf16", "f32"), 3, 2, 8, 14, (16, 2), Epilogue(), None),
    (("f16", "f16"), 5, 2, 2, 8, (32, 2), Epilogue(), 2),
    (("f16", "f16"), 3, 2, 4, 8, (32, 2), Epilogue(), 7),  # every dy row ahead
]


def cols_strided_dgrad_kernel(dt, r, stride, vec, run, shape, epi, prefetch):
    return depthwise_cols_config(problem_of("dgrad", 96, 15, 13, r, stride, dt, epilogue=epi), vec, run, shape,
                                 prefetch=prefetch)


@pytest.mark.parametrize("dt, r, stride, vec, run, shape, epi, prefetch", COLS_STRIDED_DGRAD_KERNELS,
                         ids=[f"{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-run{n}-{sh[0]}x{sh[1]}-{e.tag}-pf{pf or 1}"
                              for d, r, s, v, n, sh, e, pf in COLS_STRIDED_DGRAD_KERNELS])
def test_cols_strided_dgrad(dt, r, stride, vec, run, shape, epi, prefetch):
    """The strided dgrad "cols" kernel on SHAPES (odd sizes, a one-row image, strips past the edges), at paddings
    R // 2 (the first strip a row above dx for 3x3), 0 and R // 2 + 1, then MobileNetV2's 144-channel 56x56 layer."""
    cfg = cols_strided_dgrad_kernel(dt, r, stride, vec, run, shape, epi, prefetch)
    assert f"_cols{run}" in cfg.name and cfg.conv_stride == (stride, stride)
    cases = [(c, h, w, 3, pad) for c, h, w in SHAPES for pad in (r // 2, 0, r // 2 + 1)] + [(144, 56, 56, 32, r // 2)]
    for c, h, w, n, pad in cases:
        if c % vec or min(h, w) + 2 * pad < r:  # (the one-row image has no output without padding)
            continue
        problem = problem_of("dgrad", c, h, w, r, stride, dt, n=n, pad=pad, epilogue=epi)
        assert cfg.reject_reason(problem) is None
        check_launch(problem, LaunchConfig(cfg, 1), seed=c * 3 + h + n + pad)


def cols_capped_kernels():
    """The register-capped twins (taps read from shared memory) of a "cols" fprop with a bias and ReLU6, a stride-1
    dgrad, and a strided dgrad with a residual."""
    strided = cols_strided_dgrad_kernel(*COLS_STRIDED_DGRAD_KERNELS[1][:-1], None)  # (its plain twin: no rows ahead)
    return [min_blocks_variant(k) for k in (cols_fprop_kernel(*COLS_FPROP_KERNELS[0]),
                                            cols_fprop_kernel(*COLS_FPROP_KERNELS[4]), strided)]


@pytest.mark.parametrize("index", range(3))
def test_cols_register_capped_twins(index):
    """The capped "cols" fprop / dgrad twins on SHAPES (odd sizes, a one-row image, strips past the edges) and
    MobileNetV2's 144-channel 56x56 layer."""
    cfg = cols_capped_kernels()[index]
    assert cfg.min_blocks and cfg.schedule == "cols"
    r, (stride, _) = cfg.filter_rs[0], cfg.conv_stride
    epi = Epilogue(cfg.activation, SourceKind.BIAS if index == 0 else SourceKind.RESIDUAL if index == 2 else
                   SourceKind.NONE)
    dt = (cfg.element_a.value, cfg.element_out.value)
    for c, h, w, n in [(c, h, w, 3) for c, h, w in SHAPES] + [(144, 56, 56, 32)]:
        if c % cfg.align_a:
            continue
        problem = problem_of(cfg.kind.value, c, h, w, r, stride, dt, n=n, epilogue=epi)
        assert cfg.reject_reason(problem) is None
        check_launch(problem, LaunchConfig(cfg, 1), seed=c + h + n + index)


def graph_kernel():
    """A pipelined kernel no other test launches (the register-capped twin of the first): its library's first launch,
    which asks the device for the resident CTA count, happens inside a CUDA graph capture."""
    return min_blocks_variant(pipelined_kernel(*PIPELINED_KERNELS[3]))


def test_pipelined_kernel_captured_in_a_cuda_graph():
    cfg = graph_kernel()
    problem = problem_of("dgrad", 72, 64, 64, 3, 1, n=8)
    x, w, dy = operands(problem, 21)
    out = poisoned_output(problem)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.run_problem(problem, dy, w, out, None, config=LaunchConfig(cfg, 1))
    for seed in (22, 23):  # new inputs in the captured buffers, then a replay
        _, w_new, dy_new = operands(problem, seed)
        dy.copy_(dy_new)
        w.copy_(w_new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(out, reference(problem, x, w, dy))
        assert err < TOLERANCE[problem.element_out], f"{cfg.name} replayed: relative error {err:.3e}"


@pytest.mark.parametrize("which, splits", [(0, 64), (2, 5)])
def test_wgrad_reduction_dependent_launch_captured_in_a_cuda_graph(which, splits):
    """wgrad's reduction kernel is the partials kernel's programmatic dependent launch (it may start before the
    partials are done and waits for them): captured in a CUDA graph and replayed with new dy and x (and residual), the
    weight gradient matches the float64 reference each time, also with an uncaptured launch just before the replay."""
    dt, r, stride, _, _, _, epi, _ = COLS_KERNELS[which]
    cfg = cols_kernel(*COLS_KERNELS[which])
    problem = problem_of("wgrad", 144, 56, 56, r, stride, dt, n=8, epilogue=epi)
    splits = min(splits, pixel_tiles(cfg, problem))  # (n=8: 56 strips of 7 rows per slot at the first kernel)
    launch = LaunchConfig(cfg, splits)
    a, b, source, _ = epilogue_case(problem, 31)
    out = poisoned_output(problem)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.run_problem(problem, a, b, out, source, config=launch)
    for seed in (32, 33):
        a_new, b_new, source_new, ref = epilogue_case(problem, seed)
        a.copy_(a_new)
        b.copy_(b_new)
        if source is not None:
            source.copy_(source_new)
        eager = poisoned_output(problem)
        out.fill_(float("nan"))
        ops.run_problem(problem, a, b, eager, source, config=launch)
        graph.replay()
        torch.cuda.synchronize()
        for name, result in (("replayed", out), ("uncaptured", eager)):
            err = rel_err(result, ref)
            assert err < TOLERANCE[problem.element_out], f"{cfg.name} {name} ({splits} splits): error {err:.3e}"


@pytest.mark.parametrize("pad", [0, 2, 3])
def test_other_paddings(pad):
    """Padding other than R // 2 (stride-1 dgrad then runs with padding R-1-pad, negative for pad 3)."""
    for kind, stride in (("fprop", 1), ("dgrad", 1), ("dgrad", 2), ("wgrad", 2)):
        vec = 4 if (kind, stride) in (("dgrad", 2), ("wgrad", 2)) else 8
        halo = (kind, stride) in (("dgrad", 1), ("wgrad", 2))
        dt = ("f16", "f32") if kind == "wgrad" else ("f16", "f16")
        problem = problem_of(kind, 96, 15, 13, 3, stride, dt, pad=pad)
        run_checked(problem, kernel(problem, vec, halo), seed=pad, splits=3 if kind == "wgrad" else 1)


def test_wgrad_split_counts():
    problem = problem_of("wgrad", 96, 28, 28, 3, 1, ("f16", "f16"), n=8)
    cfg = kernel(problem, 8, False)
    x, w, dy = operands(problem, 5)
    ref = reference(problem, x, w, dy)
    tiles = pixel_tiles(cfg, problem)
    for splits in (1, 2, 7, 64, tiles):
        run_checked(problem, cfg, 5, splits=splits, ref=ref, x=x, w=w, dy=dy)


def test_wgrad_accumulates_into_a_residual():
    problem = problem_of("wgrad", 96, 15, 13, 3, 1, ("f16", "f16"), epilogue=Epilogue(source=SourceKind.RESIDUAL))
    cfg = kernel(problem_of("wgrad", 96, 15, 13, 3, 1), 8, False)
    x, w, dy = operands(problem, 9)
    prev = torch.randn(w.shape, device="cuda").to(w.dtype).contiguous(memory_format=torch.channels_last)
    ref = reference(problem, x, w, dy) + prev.double()
    run_checked(problem, cfg, 9, splits=4, source=prev, ref=ref, x=x, w=w, dy=dy)


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: e.tag)
def test_fused_epilogues(epilogue):
    for problem in epilogue_problems(epilogue):
        check_launch(problem, LaunchConfig(epilogue_kernel(problem), 1), seed=7)


def test_public_ops_run_depthwise_on_the_depthwise_kernels():
    """ops.conv2d / convolution_backward with groups == C through the model's default launch."""
    problem = problem_of("fprop", 32, 20, 20, 3, 2, n=4)
    x, w, dy = operands(problem, seed=3)
    bias = torch.randn(32, device="cuda", dtype=torch.float16)
    y = ops.conv2d(x, w, bias, stride=2, padding=1, groups=32, activation="silu", select="heuristic")
    ref = torch.nn.functional.silu(torch.nn.functional.conv2d(x.double(), w.double(), bias.double(), 2, 1, 1, 32))
    assert rel_err(y, ref) < 1e-2 and y.is_contiguous(memory_format=torch.channels_last)
    gi, gw, _ = ops.convolution_backward(dy, x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 32,
                                         [True, True, False], select="heuristic")
    assert rel_err(gi, torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), 2, 1, 1, 32)) < 1e-2
    assert rel_err(gw, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), 2, 1, 1, 32)) < 1e-2
    gw32 = ops.conv2d_wgrad(dy, x, w.shape, 2, 1, 1, 32, out_dtype=torch.float32, select="heuristic")
    assert gw32.dtype == torch.float32
    assert rel_err(gw32, torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), 2, 1, 1, 32)) < 5e-3


def test_misaligned_pointer_runs_a_narrower_vector():
    problem = problem_of("fprop", 64, 16, 16, 3, 1, n=2)
    x, w, _ = operands(problem, seed=11)
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    shifted = buf[1:].view(2, 16, 16, 64).permute(0, 3, 1, 2)  # channels_last, address 2 bytes off
    shifted.copy_(x)
    assert shifted.is_contiguous(memory_format=torch.channels_last) and shifted.data_ptr() % 16 == 2
    out = poisoned_output(problem)
    ops.run_problem(problem, shifted, w, out, select="heuristic")
    assert rel_err(out, reference(problem, x, w, None)) < 1e-2


# The cluster-split wgrad twins (depthwise.cluster_variant: a channel block's splits are one thread-block cluster,
# reduced through distributed shared memory by the same kernel): (schedule, dtypes, R, stride, vector, epilogue).
CLUSTER_KERNELS = [
    ("l1", ("f16", "f16"), 3, 1, 8, Epilogue()),
    ("smem", ("bf16", "f32"), 5, 2, 4, Epilogue()),
    ("l1", ("f16", "f32"), 7, 1, 2, Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL)),
    ("taprows", ("f16", "f16"), 3, 2, 8, Epilogue()),
    ("rows", ("bf16", "bf16"), 3, 1, 4, Epilogue(Activation.IDENTITY, SourceKind.RESIDUAL)),
    ("pipelined", ("f16", "f16"), 3, 1, 8, Epilogue()),
    ("cols", ("f16", "f16"), 5, 1, 2, Epilogue()),
    ("cols", ("f16", "f32"), 3, 2, 4, Epilogue()),
]


def cluster_kernel(sched, dt, r, stride, vec, epi):
    from cutlass_byoc.depthwise import cluster_variant

    wide = problem_of("wgrad", 96, 15, 13, r, stride, dt, epilogue=epi)
    if sched in ("l1", "smem"):
        base = kernel(wide, vec, sched == "smem")
    elif sched in ("rows", "taprows"):
        base = depthwise_rows_config(wide, vec, 4, sched)
    elif sched == "pipelined":
        base = depthwise_pipelined_wgrad_config(wide, vec)
    else:
        base = depthwise_cols_config(wide, vec, 7 if stride == 1 else 8, (32, 2))
    return cluster_variant(base)


@pytest.mark.parametrize("sched, dt, r, stride, vec, epi", CLUSTER_KERNELS,
                         ids=[f"{sc}-{d[0]}to{d[1]}-{r}x{r}-s{s}-v{v}-{e.tag}" for sc, d, r, s, v, e in CLUSTER_KERNELS])
def test_cluster_split_wgrad(sched, dt, r, stride, vec, epi):
    """Splits 1, 2, 3 (a cluster of 3: any count up to 8, not only powers of two) and the most (8, or the pixel tiles
    there are) over SHAPES at 3 images (odd sizes, C not a multiple of 8), then a MobileNetV2-sized layer (C=576,
    14x14, 32 images) at 8: each against float64 on fresh inputs, the output poisoned first."""
    cfg = cluster_kernel(sched, dt, r, stride, vec, epi)
    assert "_splitk_cluster_" in cfg.name
    for c, h, w, n in [(c, h, w, 3) for c, h, w in SHAPES] + [(576, 14, 14, 32)]:
        if c % vec:
            continue
        problem = problem_of("wgrad", c, h, w, r, stride, dt, n=n, epilogue=epi)
        assert cfg.reject_reason(problem) is None, (cfg.name, problem.name)
        most = min(8, pixel_tiles(cfg, problem))
        for splits in sorted({1, min(2, most), min(3, most), most}):
            check_launch(problem, LaunchConfig(cfg, splits), seed=c * 7 + h + n + splits)
