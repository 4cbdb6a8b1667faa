"""Channel-padded launches (issue 11, part 3) on the H200: the stem (3->64 7x7 s2) and the odd layer (7->33 3x3) in
fprop, dgrad and wgrad, every padding the planner offers and the unpadded twin where one exists, against the
float64 reference; plus padded launches on sm90 kernels (16-byte padded channels reach TMA) and the public ops with
the model's default. Outputs are poisoned (NaN) first; inputs are fresh random tensors.

Compiles 2.x kernels (~10-15 s each) and reuses the sm90 kernels of test_gpu_sm90.py / test_gpu_sm90_splitk.py
(a config never depends on the shape): no new 3.x kernel.
"""

from __future__ import annotations

import functools
import math

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.candidates import channel_pad_options, sm80_candidates  # noqa: E402
from cutlass_byoc.config import LaunchConfig, round_up  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.sm90 import sm90_config  # noqa: E402
from cutlass_byoc.types import ConvKind, IteratorAlgorithm, SourceKind, SplitKMode  # noqa: E402

import layers  # noqa: E402
from gpu_util import (  # noqa: E402
    TOLERANCE, TORCH, kernel_operands, module_kernels, operands, pick, poisoned_output, reference, rel_err,
)

pytestmark = pytest.mark.gpu

BATCH = 4


stem = functools.partial(layers.stem, n=BATCH)
odd = functools.partial(layers.odd, n=BATCH)


LAYERS = {"stem": stem, "odd": odd}


def padded_problem(p: Conv2dProblem, pad_c: int, pad_k: int) -> Conv2dProblem:
    return p.replace(c=round_up(p.c, pad_c), k=round_up(p.k, pad_k))


def launches(p: Conv2dProblem) -> list[LaunchConfig]:
    """The unpadded launch (if any kernel takes the problem) and one launch per padding the planner offers, each on
    the fixed 2.x pick for the problem the kernel computes."""
    out = []
    for pad_c, pad_k in channel_pad_options(p):
        big = padded_problem(p, pad_c, pad_k)
        if not list(sm80_candidates(big)):
            continue  # the narrow strided dgrad: no kernel unpadded
        out.append(LaunchConfig(pick(big), pad_c=pad_c, pad_k=pad_k))
        if p.kind is ConvKind.FPROP and (pad_c, pad_k) != (1, 1):
            # what padding the stem is for: the fixed-channels iterator (C == alignment, 4 or 8)
            fixed = [c for c in sm80_candidates(big) if c.iterator is IteratorAlgorithm.FIXED_CHANNELS
                     and c.split_k_mode is SplitKMode.SERIAL and c.tile == (128, 64, 32)]
            out += [LaunchConfig(c, pad_c=pad_c, pad_k=pad_k) for c in fixed[:1]]
    return out


def sm90_launches() -> list[tuple[Conv2dProblem, LaunchConfig]]:
    """Padded launches on the sm90 configs test_gpu_sm90.py and test_gpu_sm90_splitk.py compile already."""
    out = []
    for kind in ("fprop", "dgrad"):
        p = odd(kind)
        big = padded_problem(p, 8, 8)
        out.append((p, LaunchConfig(sm90_config(big, (128, 128, 64)), pad_c=8, pad_k=8)))
    for layer in (stem, odd):
        p = layer("wgrad")
        big = padded_problem(p, 8, 8)
        out.append((p, LaunchConfig(sm90_config(big, (64, 128, 64), (1, 1, 1), SplitKMode.PARALLEL), 8,
                                    pad_c=8, pad_k=8 if p.k % 8 else 1)))
    return out


def extra_launches() -> list[tuple[Conv2dProblem, LaunchConfig]]:
    """The padded launches with an epilogue source (fp32 and fp16 wgrad accumulate, fprop bias and residual)."""
    out = []
    for o in ("f16", "f32"):
        p = stem("wgrad", out_dtype=o, epilogue=Epilogue(source=SourceKind.RESIDUAL))
        out.append((p, LaunchConfig(pick(padded_problem(p, 4, 1)), pad_c=4)))
    pb = odd("fprop", epilogue=Epilogue(source=SourceKind.BIAS))
    out.append((pb, LaunchConfig(pick(padded_problem(pb, 8, 8)), pad_c=8, pad_k=8)))
    pr = odd("fprop", epilogue=Epilogue(source=SourceKind.RESIDUAL))
    out.append((pr, LaunchConfig(pick(padded_problem(pr, 1, 8)), pad_k=8)))
    return out


def used_configs():
    """Every kernel this module launches with a fixed config (scripts/warm_cache.py compiles them beforehand)."""
    kernels = [l.kernel for f in LAYERS.values() for kind in ConvKind for l in launches(f(kind.value))]
    kernels += [l.kernel for _, l in sm90_launches() + extra_launches()]
    return list(dict.fromkeys(kernels))


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, used_configs):
        yield


def check(p: Conv2dProblem, launch: LaunchConfig, seed: int, source=None, ref_extra=None):
    assert launch.reject_reason(p) is None, launch.reject_reason(p)
    x, w, dy = operands(p, seed=seed)
    a, b = kernel_operands(p, x, w, dy)
    ref = reference(p, x, w, dy)
    if ref_extra is not None:
        ref = ref + ref_extra
    out = poisoned_output(p)
    ops.run_problem(p, a, b, out, source, config=launch)
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    assert not math.isnan(err), f"{launch.name}: NaN in the output (a channel left unwritten)"
    assert err < TOLERANCE[p.element_out], f"{launch.name} on {p.name}: {err:.3e}"
    return err


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_padded_and_unpadded_launches(layer, kind):
    p = LAYERS[layer](kind)
    ls = launches(p)
    assert any(l.padded for l in ls)
    if not (kind == "dgrad" and layer == "stem"):
        assert any(not l.padded for l in ls), "the unpadded twin must run too"
    for i, launch in enumerate(ls):
        check(p, launch, seed=100 + i)


@pytest.mark.parametrize("case", [0, 1], ids=["f16", "f32"])
def test_padded_wgrad_fp32_output_and_accumulate(case):
    p, launch = extra_launches()[case]
    prev = torch.randn(p.k, p.c, p.r, p.s, device="cuda").to(TORCH[p.element_out]).contiguous(
        memory_format=torch.channels_last)
    check(p, launch, seed=5, source=prev, ref_extra=prev.double())


def test_padded_fprop_bias_and_residual_pad_k():
    """Padding K pads the bias (and a residual) with zeros; the padded output channels are dropped."""
    (pb, lb), (pr, lr) = extra_launches()[2:]
    bias = torch.randn(pb.k, device="cuda").to(torch.float16)
    check(pb, lb, seed=6, source=bias, ref_extra=bias.double().view(1, -1, 1, 1))
    res = torch.randn(pr.n, pr.k, pr.p, pr.q, device="cuda").to(torch.float16).contiguous(
        memory_format=torch.channels_last)
    check(pr, lr, seed=7, source=res, ref_extra=res.double())


@pytest.mark.parametrize("case", [0, 1, 2, 3],
                         ids=["odd_fprop_sm90", "odd_dgrad_sm90", "stem_wgrad_sm90_splitk", "odd_wgrad_sm90_splitk"])
def test_padded_launches_on_sm90(case):
    p, launch = sm90_launches()[case]
    check(p, launch, seed=200 + case)


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_public_ops_with_the_models_default(layer, kind):
    """conv2d / conv2d_dgrad / conv2d_wgrad without a config: the model's default launch, padded or not."""
    p = LAYERS[layer](kind)
    x, w, dy = operands(p, seed=300)
    ref = reference(p, x, w, dy)
    conv = dict(stride=(p.stride_h, p.stride_w), padding=(p.pad_h, p.pad_w))
    if kind == "fprop":
        got = ops.conv2d(x, w, select="heuristic", **conv)
    elif kind == "dgrad":
        got = ops.conv2d_dgrad(dy, w, x.shape, select="heuristic", **conv)
    else:
        got = ops.conv2d_wgrad(dy, x, w.shape, select="heuristic", **conv)
    torch.cuda.synchronize()
    assert rel_err(got, ref) < TOLERANCE[p.element_out]
