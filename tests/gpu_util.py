"""Helpers of the GPU tests: each module's kernel build, fixed kernel picks, random channels_last operands, float64
references."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Callable, Iterable, Optional

import pytest
import torch

from cutlass_byoc.build import build
from cutlass_byoc.candidates import sm80_candidates
from cutlass_byoc.config import KernelConfig
from cutlass_byoc.problem import Conv2dProblem
from cutlass_byoc.types import ConvKind, DType, IteratorAlgorithm, SplitKMode

TORCH = {DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.F32: torch.float32}
#: ||out - ref|| / ||ref|| bounds by output type (and fp32 inputs, which run as TF32)
TOLERANCE = {DType.F16: 1e-2, DType.BF16: 2e-2, DType.F32: 5e-3}

#: pytestmark of the modules whose kernels are sm90 (TMA + wgmma, built for sm_90a): a CUDA device of compute
#: capability 9.0, else skipped with the reason
SM90_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the sm90 kernels need an H100/H200"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
        reason="the sm90 TMA + wgmma kernels are built for sm_90a and run only on compute capability 9.0",
    ),
]

_ITER_ORDER = [IteratorAlgorithm.OPTIMIZED, IteratorAlgorithm.FEW_CHANNELS, IteratorAlgorithm.ANALYTIC,
               IteratorAlgorithm.FIXED_CHANNELS]


@contextlib.contextmanager
def module_kernels(shared_cache, configs: Callable[[], Iterable[KernelConfig]]):
    """A GPU test module's kernels, compiled in one parallel build before its first test (unless
    CUTLASS_BYOC_TEST_NO_PREBUILD says a carried, warm cache holds them: a missing one then compiles when launched),
    and ops reading that cache while the module runs. A kernel that fails to compile fails the tests that launch it,
    with nvcc's errors. For a module's autouse fixture: ``with module_kernels(shared_cache, all_configs): yield``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CUTLASS_BYOC_CACHE_DIR", str(shared_cache.root))
    try:
        if not os.environ.get("CUTLASS_BYOC_TEST_NO_PREBUILD"):
            build(list(configs()), cache=shared_cache, progress=True)
        yield
    finally:
        mp.undo()


def depthwise_rows_config(problem: Conv2dProblem, vec: int, steps: int, schedule: str = "rows") -> KernelConfig:
    """The depthwise tests' "rows" (or "taprows") wgrad config for the problem's types, filter and stride: vector
    `vec`, `steps` columns per step; "rows": 32 segment threads x 4 vectors at vector 8 and 16 x 8 vectors below;
    "taprows": R x 8 x 4 threads at vector 8 and R x 4 x 8 below (from the C=96 twin)."""
    from cutlass_byoc.depthwise import depthwise_candidates  # noqa: PLC0415

    wide = problem.replace(c=96, k=96, groups=96)
    shape = {"rows": (32, 16) if vec == 8 else (16, 16), "taprows": (8, 16) if vec == 8 else (4, 16)}[schedule]
    return next(c for c in depthwise_candidates(wide)
                if c.schedule == schedule and c.align_a == vec and c.stages == steps and c.tile[:2] == shape)


def depthwise_cols_config(problem: Conv2dProblem, vec: int, run: int, shape=(32, 2),
                          prefetch: Optional[int] = None) -> KernelConfig:
    """The depthwise tests' "cols" config for the problem's kind, types, filter and stride: vector `vec`, strips of
    `run` rows, `shape` = (slots, strip columns) (from the C=96 twin, or the problem's own candidates), loads
    `prefetch` rows ahead (None: one)."""
    import itertools  # noqa: PLC0415

    from cutlass_byoc.depthwise import COLS, depthwise_candidates  # noqa: PLC0415

    wide = problem.replace(c=96, k=96, groups=96)
    cfg = next(c for c in itertools.chain(depthwise_candidates(wide), depthwise_candidates(problem))
               if c.schedule == COLS and c.align_a == vec and c.tile[:2] == tuple(shape) and c.prefetch is None)
    # any run, also one the candidates leave out for this image
    return dataclasses.replace(cfg, stages=run, prefetch=prefetch)


def depthwise_pipelined_wgrad_config(problem: Conv2dProblem, vec: int, tile=(4, 16), strip_cols: int = 4) -> KernelConfig:
    """The depthwise tests' pipelined wgrad config for the problem's types, filter and stride: vector `vec`, a dy tile
    of `tile` pixels x 4 channel vectors, strips of `strip_cols` columns (from the C=96 twin, or the problem's own
    candidates for the narrow vectors its channels allow)."""
    import itertools  # noqa: PLC0415

    from cutlass_byoc.depthwise import depthwise_candidates, is_pipelined_wgrad, lanes, strip  # noqa: PLC0415

    wide = problem.replace(c=96, k=96, groups=96)
    return next(c for c in itertools.chain(depthwise_candidates(wide), depthwise_candidates(problem))
                if is_pipelined_wgrad(c) and c.align_a == vec and c.tile[:2] == tuple(tile) and lanes(c) == 4
                and strip(c) == strip_cols and c.min_blocks is None)


def pick(problem: Conv2dProblem, mode: SplitKMode = SplitKMode.SERIAL, tile=None) -> KernelConfig:
    """A fixed, mid-size kernel for the problem, so the test suite compiles few kernels."""
    preferred = tile or ((128, 128, 16) if problem.element_a is DType.F32 else (128, 128, 32))
    cands = [c for c in sm80_candidates(problem) if c.split_k_mode is mode]
    cands.sort(key=lambda c: (c.tile != preferred, c.tile != (128, 64, 32), _ITER_ORDER.index(c.iterator), c.stages))
    assert cands, f"no candidate for {problem.name}"
    return cands[0]


def operands(problem: Conv2dProblem, seed: int):
    """Fresh random x, w, dy in the problem's input type, channels_last, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = TORCH[problem.element_a]
    cl = torch.channels_last
    n, c, h, w, k = problem.n, problem.c, problem.h, problem.w, problem.k
    x = torch.randn((n, c, h, w), generator=g, device="cuda").to(dt).contiguous(memory_format=cl)
    wt = torch.randn((k, c // problem.groups, problem.r, problem.s), generator=g, device="cuda").to(dt).contiguous(memory_format=cl)
    dy = torch.randn((n, k, problem.p, problem.q), generator=g, device="cuda").to(dt).contiguous(memory_format=cl)
    return x, wt, dy


def kernel_operands(problem: Conv2dProblem, x, w, dy):
    return {ConvKind.FPROP: (x, w), ConvKind.DGRAD: (dy, w), ConvKind.WGRAD: (dy, x)}[problem.kind]


def poisoned_output(problem: Conv2dProblem):
    n, h, w, c = problem.out_shape
    shape = (n, c, h, w)  # NCHW logical, NHWC memory (KRSC for wgrad)
    return torch.full(shape, float("nan"), dtype=TORCH[problem.element_out], device="cuda").contiguous(
        memory_format=torch.channels_last)


def reference(problem: Conv2dProblem, x, w, dy):
    """float64 result of the problem's kind (no epilogue)."""
    st, pd, dl = (problem.stride_h, problem.stride_w), (problem.pad_h, problem.pad_w), (problem.dilation_h, problem.dilation_w)
    if problem.kind is ConvKind.FPROP:
        return torch.nn.functional.conv2d(x.double(), w.double(), None, st, pd, dl, problem.groups)
    if problem.kind is ConvKind.DGRAD:
        return torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), st, pd, dl, problem.groups)
    return torch.nn.grad.conv2d_weight(x.double(), w.shape, dy.double(), st, pd, dl, problem.groups)


def rel_err(out, ref) -> float:
    out = out.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def epilogue_operands(problem: Conv2dProblem, seed: int, source_scale: float = 1.0):
    """(A, B, source, bias, float64 reference) of `problem` with its epilogue: fresh operands; a random residual
    (output-shaped, channels_last, the output's type) and a random bias (one value per output channel, in its own type:
    `problem.element_bias`) as the problem's source asks, both times `source_scale`, added to the reference, and the
    activation applied to it. The source is the bias (BIAS) or the residual (RESIDUAL, BIAS_RESIDUAL); `bias` is the
    bias of BIAS_RESIDUAL (ops.run_problem's `bias`), else None."""
    from cutlass_byoc.ops import _apply_activation  # noqa: PLC0415
    from cutlass_byoc.types import SourceKind  # noqa: PLC0415

    x, w, dy = operands(problem, seed)
    a, b = kernel_operands(problem, x, w, dy)
    ref = reference(problem, x, w, dy)
    source = bias = None
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    kind = problem.epilogue.source
    if kind.has_residual:
        source = (torch.randn(ref.shape, device="cuda", generator=gen) * source_scale).to(
            TORCH[problem.element_out]).contiguous(memory_format=torch.channels_last)
        ref = ref + source.double()
    if kind.has_bias:
        bias = (torch.randn(ref.shape[1], device="cuda", generator=gen) * source_scale).to(TORCH[problem.element_bias])
        ref = ref + bias.double().view(1, -1, 1, 1)
        if kind is SourceKind.BIAS:
            source, bias = bias, None
    return a, b, source, bias, _apply_activation(ref, problem.epilogue.activation)


def epilogue_case(problem: Conv2dProblem, seed: int, source_scale: float = 1.0):
    """(A, B, source, float64 reference): epilogue_operands for a problem without a separate bias operand."""
    a, b, source, bias, ref = epilogue_operands(problem, seed, source_scale)
    assert bias is None, f"{problem.name}: a bias and a residual, use epilogue_operands"
    return a, b, source, ref


def run_launch(problem: Conv2dProblem, launch, seed: int, source_scale: float = 1.0):
    """(out, float64 reference) of `problem` run through ops with `launch` on fresh operands (epilogue_operands),
    the output filled with NaN first."""
    from cutlass_byoc import ops  # noqa: PLC0415

    a, b, source, bias, ref = epilogue_operands(problem, seed, source_scale)
    out = poisoned_output(problem)
    ops.run_problem(problem, a, b, out, source, config=launch, bias=bias)
    torch.cuda.synchronize()
    return out, ref


def check_launch(problem: Conv2dProblem, launch, seed: int, source_scale: float = 1.0,
                 bound: Optional[float] = None):
    """run_launch, asserting every element was written and the result is within `bound` (the output type's
    tolerance by default)."""
    out, ref = run_launch(problem, launch, seed, source_scale)
    err = rel_err(out, ref)
    bound = TOLERANCE[problem.element_out] if bound is None else bound
    assert not math.isnan(err), f"{launch.name}: NaN in the output (unwritten?) for {problem.name}"
    assert err < bound, f"{launch.name} on {problem.name}: {err:.3e} >= {bound}"
    return out


# ---------------------------------------------------------------------------------------------- training steps
#: A model's training step through the backend against an fp32 truth: its error at most STEP_SLACK times eager
#: autocast's, plus STEP_ABS (tests/test_gpu_families.py, tests/test_gpu_dynamic.py)
STEP_SLACK, STEP_ABS = 2.5, 1e-3


def training_step(model, x, autocast: bool):
    """One training step of `model` on `x` (fp16 autocast or fp32): the loss (the output's mean square, in fp32) and
    the gradients of the parameters that take one (a frozen one has none); the model's gradients are cleared."""
    with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
        out = model(x)
    loss = out.float().square().mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def sgd_steps(run, model, xs, lr: float = 0.1) -> list[float]:
    """An fp16-autocast SGD step of `run` (model, compiled) on each of `xs` (loss: the output's mean square, in fp32):
    the losses. Under CUDA graphs the third step replays the captured graph."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x in xs:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = run(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def fp32_truth(model, x):
    """training_step in fp32 with TF32 off (cuDNN and cuBLAS): the reference the fp16 steps are measured against."""
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return training_step(model, x, autocast=False)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def backend_step_vs_eager(base, x, options: dict):
    """One fp16-autocast training step of a copy of `base` on `x` compiled with the backend (`options`; the
    partitioned graphs run eagerly, ``make_backend(inductor=False)``), beside eager autocast's and the fp32 truth:
    (truth, eager, ours, backend), each step's (loss, gradients)."""
    import copy  # noqa: PLC0415

    from cutlass_byoc.offload import library, make_backend  # noqa: PLC0415

    truth = fp32_truth(copy.deepcopy(base), x)
    eager = training_step(copy.deepcopy(base), x, autocast=True)
    torch._dynamo.reset()
    library.RUNTIME.clear()
    backend = make_backend(options, inductor=False)
    ours = training_step(torch.compile(copy.deepcopy(base), backend=backend), x, autocast=True)
    torch.cuda.synchronize()
    return truth, eager, ours, backend


def depthwise_random_cases(count: int = 24, seed: int = 2026):
    """Seeded random depthwise problems (kind, C, H, W, filter, stride, padding, types, epilogue, which launch):
    the combinations the hand-picked cases of the depthwise tests do not name (tests/test_depthwise_emulated.py on the
    CPU, tests/test_gpu_depthwise.py on the GPU). A case: (index, kind, C, H, W, R, stride, padding, dtypes, epilogue,
    "default" or "candidate", seed)."""
    import random  # noqa: PLC0415

    from cutlass_byoc.problem import Epilogue  # noqa: PLC0415
    from cutlass_byoc.types import Activation, SourceKind  # noqa: PLC0415

    rng = random.Random(seed)
    fprop_epilogues = [Epilogue(), Epilogue(Activation.RELU6, SourceKind.BIAS), Epilogue(Activation.SILU),
                       Epilogue(Activation.HARDSWISH, SourceKind.RESIDUAL),
                       Epilogue(Activation.RELU, SourceKind.BIAS_RESIDUAL),
                       Epilogue(Activation.GELU, SourceKind.BIAS, bias_dtype="f32")]
    out = []
    for i in range(count):
        kind = rng.choice(["fprop", "fprop", "dgrad", "wgrad"])
        r = rng.choice([3, 3, 5, 7])
        stride = rng.choice([1, 2])
        c = rng.choice([4, 8, 12, 20, 24, 36, 40])
        h, w = rng.randint(r, 15), rng.randint(r, 15)
        pad = rng.randint(0, r // 2 + (1 if stride == 1 else 0))
        dt = rng.choice([("f16", "f16"), ("bf16", "bf16"), ("f16", "f32"), ("bf16", "f32")])
        epi = rng.choice(fprop_epilogues) if kind == "fprop" else Epilogue()
        pick = rng.choice(["default", "candidate"])
        out.append((i, kind, c, h, w, r, stride, pad, dt, epi, pick, rng.randint(0, 10**6)))
    return out


def depthwise_odd_cases(count: int = 24, seed: int = 2027):
    """Seeded random depthwise problems of the shapes models rarely have and the kernels take all the same: strides
    3 and 4, unequal strides, non-square, even, 1x1 and 9x9 filters (tuples where depthwise_random_cases has ints);
    the same case layout, for random_case_launch."""
    import random  # noqa: PLC0415

    from cutlass_byoc.problem import Epilogue  # noqa: PLC0415
    from cutlass_byoc.types import Activation, SourceKind  # noqa: PLC0415

    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = rng.choice(["fprop", "dgrad", "wgrad"])
        r, s = rng.choice([(1, 3), (3, 1), (2, 2), (4, 4), (9, 9), (1, 1), (1, 7), (3, 5)])
        stride = rng.choice([(3, 3), (4, 4), (1, 2), (2, 1), (2, 3)])
        c = rng.choice([8, 12, 16, 24])
        h, w = rng.randint(r, 15), rng.randint(s, 15)
        pad = (rng.randint(0, r // 2), rng.randint(0, s // 2))
        dt = rng.choice([("f16", "f16"), ("bf16", "f32")])
        epi = rng.choice([Epilogue(), Epilogue(Activation.RELU, SourceKind.BIAS)]) if kind == "fprop" else Epilogue()
        out.append((i, kind, c, h, w, (r, s), stride, pad, dt, epi, rng.choice(["default", "candidate"]),
                    rng.randint(0, 10**6)))
    return out


def random_case_id(case) -> str:
    i, kind, c, h, w, r, stride, pad, dt, epi, pick, _ = case
    rs = f"{r}x{r}" if isinstance(r, int) else f"{r[0]}x{r[1]}"
    st = stride if isinstance(stride, int) else f"{stride[0]}x{stride[1]}"
    pd = pad if isinstance(pad, int) else f"{pad[0]}x{pad[1]}"
    return f"{i}-{kind}-c{c}-{rs}s{st}p{pd}-{dt[0]}_{dt[1]}-{epi.tag}-{pick}"


def random_case_launch(case):
    """(problem, config, splits, seed) of a depthwise_random_cases or depthwise_odd_cases case: the untuned default
    launch, or a random candidate of the problem's plan but the cluster-split twins (the CPU emulation has no
    thread-block clusters; test_gpu_depthwise.py runs them on their own), wgrad over a few splits."""
    import random  # noqa: PLC0415

    from cutlass_byoc.depthwise import depthwise_candidates, pixel_tiles  # noqa: PLC0415
    from cutlass_byoc.heuristics import default_launch  # noqa: PLC0415

    _, kind, c, h, w, r, stride, pad, dt, epi, pick, seed = case
    r, s = (r, r) if isinstance(r, int) else r
    p = Conv2dProblem.make(kind, 2, c, h, w, c, r, s, stride=stride, padding=pad, groups=c, dtype=dt[0],
                           out_dtype=dt[1], epilogue=epi)
    if pick == "default":
        launch = default_launch(p)
        assert launch is not None and launch.kernel.family.value == "depthwise_direct", p.name
        cfg, splits = launch.kernel, launch.split_k_slices
    else:
        cands = [k for k in depthwise_candidates(p) if k.split_k_mode.value != "cluster"]
        cfg = random.Random(seed).choice(cands)
        splits = min(4, pixel_tiles(cfg, p)) if kind == "wgrad" else 1
    assert (cfg.element_bias is not None) == p.epilogue.bias_vector, cfg.name
    return p, cfg, splits, seed
