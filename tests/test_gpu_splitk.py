"""Split-k for wgrad, serial and parallel, fp32 through the reduction (issue 3): every slice count against the
float64 reference on ResNet-50 wgrad shapes at batch 32 and 128, fp16 and fp32 outputs; the error must not grow
with the slice count, nor with the batch at a fixed reduction length per slice."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem  # noqa: E402
from cutlass_byoc.types import SplitKMode  # noqa: E402

from gpu_util import (  # noqa: E402
    TOLERANCE, kernel_operands, module_kernels, operands, pick, poisoned_output, reference, rel_err,
)

pytestmark = pytest.mark.gpu

SLICES = (1, 2, 4, 8, 16, 64, 256)  # the planner goes up to 256 slices for one output tile
# ResNet-50 wgrad layers: C -> K, R, stride, H
LAYERS = [(64, 64, 3, 1, 56), (64, 256, 1, 1, 56), (256, 256, 3, 1, 14), (512, 512, 3, 1, 7), (128, 128, 3, 2, 56)]
TILE = (128, 128, 32)


def problem(layer, batch, out):
    c, k, r, s, h = layer
    return Conv2dProblem.make("wgrad", batch, c, h, h, k, r, stride=s, padding=r // 2, dtype="f16", out_dtype=out)


def used_configs():
    """The module's kernels (one per output type and mode: a config never depends on the shape)."""
    return [pick(problem(LAYERS[0], 32, out), mode, TILE) for out in ("f16", "f32")
            for mode in (SplitKMode.SERIAL, SplitKMode.PARALLEL)]


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, used_configs):
        yield


@pytest.mark.parametrize("out", ["f16", "f32"])
@pytest.mark.parametrize("mode", [SplitKMode.SERIAL, SplitKMode.PARALLEL], ids=lambda m: m.value)
@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: f"{l[0]}to{l[1]}_{l[2]}x{l[2]}_s{l[3]}_{l[4]}")
def test_wgrad_split_k(layer, mode, out):
    errors = {}
    for batch in (32, 128):
        p = problem(layer, batch, out)
        cfg = pick(p, mode, TILE)
        x, w, dy = operands(p, seed=batch + layer[0])
        a, b = kernel_operands(p, x, w, dy)
        ref = reference(p, x, w, dy)
        for slices in SLICES:
            launch = LaunchConfig(cfg, slices)
            why = launch.reject_reason(p)
            if why and "exceed the reduction extent" in why:  # 256 slices of a 7x7 layer's N*P*Q at batch 32
                assert slices * cfg.tile[2] > p.gemm_mnk[2]
                continue
            if mode is SplitKMode.SERIAL and out == "f16" and slices > 1:
                # serial slices would round partial sums to fp16 in the output between slices: refused
                assert why and "parallel split-k" in why
                continue
            assert why is None, why
            out_t = poisoned_output(p)
            ops.run_problem(p, a, b, out_t, config=launch)
            torch.cuda.synchronize()
            err = rel_err(out_t, ref)
            assert not math.isnan(err), f"NaN: {launch.name} batch {batch}"
            assert err < TOLERANCE[p.element_out], f"{launch.name} batch {batch}: {err:.3e}"
            errors[(batch, slices)] = err
    floor = 1e-6 if out == "f32" else 1e-4
    for (batch, slices), err in errors.items():
        # More slices never cost accuracy: fp32 partials, one final conversion.
        assert err <= 2 * errors[(batch, 1)] + floor, f"error grows with slices: {errors}"
        if out == "f16":
            # fp16 outputs: the output rounding dominates, flat in the batch (where batch 32 had that many slices)
            if (32, slices) in errors:
                assert err <= 2 * errors[(32, slices)] + floor, f"error grows with batch: {errors}"
        elif batch == 128 and (32, slices // 4) in errors:
            # fp32 outputs: the tensor cores' fp32 accumulation error grows with the length of each slice's
            # reduction (seen on the H200: exactly halved per doubling of slices), so 4x the batch on 4x the
            # slices must stay level.
            assert err <= 2 * errors[(32, slices // 4)] + floor, f"error drifts with batch: {errors}"
