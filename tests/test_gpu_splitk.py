"""Split-k for wgrad, serial and parallel, fp32 through the reduction (issue 3): every slice count against the
float64 reference on ResNet-50 wgrad shapes at batch 32 and 128, fp16 and fp32 outputs; the error must not grow
with the batch or the slice count."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.build import build  # noqa: E402
from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem  # noqa: E402
from cutlass_byoc.types import SplitKMode  # noqa: E402

from gpu_util import TOLERANCE, kernel_operands, operands, pick, poisoned_output, reference, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

SLICES = (1, 2, 4, 8, 16)
# ResNet-50 wgrad layers: C -> K, R, stride, H
LAYERS = [(64, 64, 3, 1, 56), (64, 256, 1, 1, 56), (256, 256, 3, 1, 14), (512, 512, 3, 1, 7), (128, 128, 3, 2, 56)]
TILE = (128, 128, 32)


def problem(layer, batch, out):
    c, k, r, s, h = layer
    return Conv2dProblem.make("wgrad", batch, c, h, h, k, r, stride=s, padding=r // 2, dtype="f16", out_dtype=out)


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("CUTLASS_BYOC_CACHE_DIR", str(shared_cache.root))
    cfgs = [pick(problem(LAYERS[0], 32, out), mode, TILE) for out in ("f16", "f32")
            for mode in (SplitKMode.SERIAL, SplitKMode.PARALLEL)]
    build(cfgs, cache=shared_cache, progress=True)  # compile errors surface in the tests that load the kernel
    yield
    mp.undo()


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
            assert launch.reject_reason(p) is None, launch.reject_reason(p)
            out_t = poisoned_output(p)
            ops.run_problem(p, a, b, out_t, config=launch)
            torch.cuda.synchronize()
            err = rel_err(out_t, ref)
            assert not math.isnan(err), f"NaN: {launch.name} batch {batch}"
            assert err < TOLERANCE[p.element_out], f"{launch.name} batch {batch}: {err:.3e}"
            errors[(batch, slices)] = err
    # Splitting the reduction must not degrade accuracy: fp32 partials and one final conversion.
    floor = 1e-6 if out == "f32" else 1e-4
    for (batch, slices), err in errors.items():
        assert err <= 2 * errors[(32, 1)] + floor, f"error grows: batch {batch} slices {slices}: {errors}"
