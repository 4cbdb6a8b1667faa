"""The channel-statistics epilogue on a GPU (KernelConfig.channel_stats): the sm90 conv fprop kernels that store y and,
per output channel, the fp32 sum and sum of squares of the stored (rounded) y over every output pixel: the statistics
a training batch norm after the conv needs.

Against float64: y against the float64 conv as every fprop test; the two sums against float64 sums of the kernel's own
y (what a batch norm reading y would see), and against the float64 conv's. Outputs and the statistics are poisoned
(NaN) first, so a channel or a tail of pixels the kernel fails to cover shows. Each warp adds its partial sums with
atomicAdd, so two runs agree to within the rounding of a different summation order (y itself bit for bit).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")

from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.ops import UnsupportedConvError, conv2d_channel_stats, run_problem  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem  # noqa: E402
from cutlass_byoc.sm90 import sm90_config  # noqa: E402

from gpu_util import SM90_GPU, TOLERANCE, module_kernels, operands, poisoned_output, reference, rel_err  # noqa: E402

pytestmark = SM90_GPU

#: (problem, tile, cluster): M and K tails (pixels not a multiple of the tile's M, channels not of its N), a strided
#: conv, a 1x1 conv, bf16, an fp32 output, a two-CTA cluster along M
CASES = {
    "3x3_f16_tails": (Conv2dProblem.make("fprop", 4, 64, 30, 30, 72, 3, padding=1), (128, 64, 64), (1, 1, 1)),
    "1x1_bf16_k200": (Conv2dProblem.make("fprop", 3, 128, 17, 17, 200, 1, dtype="bf16"), (128, 128, 64), (1, 1, 1)),
    "3x3_s2_f16_cluster": (Conv2dProblem.make("fprop", 2, 32, 33, 33, 96, 3, padding=1, stride=2), (64, 64, 64),
                           (2, 1, 1)),
    "3x3_f16_to_f32": (Conv2dProblem.make("fprop", 2, 64, 20, 20, 64, 3, padding=1, out_dtype="f32"), (128, 64, 64),
                       (1, 1, 1)),
    "1x1_f16_big": (Conv2dProblem.make("fprop", 8, 256, 28, 28, 128, 1), (128, 128, 64), (1, 1, 1)),
    # the persistent ping-pong kernel: one CTA per SM walking the tiles, its two consumer groups' epilogues in turn
    "3x3_f16_pingpong": (Conv2dProblem.make("fprop", 4, 64, 30, 30, 72, 3, padding=1), (128, 64, 64), (1, 1, 1),
                         "pingpong"),
    "1x1_bf16_pingpong_cluster": (Conv2dProblem.make("fprop", 8, 128, 28, 28, 256, 1, dtype="bf16"), (128, 128, 64),
                                  (2, 1, 1), "pingpong"),
}


def case(name: str):
    problem, tile, cluster, *schedule = CASES[name]
    return problem, tile, cluster, (schedule or ["implicit_tma_ws"])[0]


def stats_config(name: str):
    problem, tile, cluster, schedule = case(name)
    plain = sm90_config(problem, tile, cluster, schedule=schedule)
    twin = plain.with_channel_stats()
    # the twin keeps the schedule and cluster; a 128 x 128 tile is narrowed to 128 x 64 (KernelConfig.with_channel_stats)
    narrowed = plain.tile if plain.tile[0] * plain.tile[1] <= 128 * 64 else (128, 64, plain.tile[2])
    assert twin is not None and twin.channel_stats and twin.tile == narrowed and twin.cluster == plain.cluster
    return twin


def used_configs():
    return [stats_config(name) for name in CASES]


@pytest.fixture(scope="module", autouse=True)
def _kernels(shared_cache):
    with module_kernels(shared_cache, used_configs):
        yield


def run_stats(problem, config, x, w):
    out = poisoned_output(problem)
    stats = torch.full((2, problem.k), float("nan"), dtype=torch.float32, device="cuda")
    run_problem(problem, x, w, out, config=LaunchConfig(config), stats=stats)
    torch.cuda.synchronize()
    return out, stats


@pytest.mark.parametrize("name", list(CASES))
def test_channel_stats_match_float64(name):
    problem = case(name)[0]
    config = stats_config(name)
    x, w, _ = operands(problem, seed=sum(map(ord, name)))
    out, stats = run_stats(problem, config, x, w)
    ref = reference(problem, x, w, None)
    assert rel_err(out, ref) < TOLERANCE[problem.element_out], name
    assert not torch.isnan(stats).any(), "a channel's statistics were never written"
    y = out.double()
    own = torch.stack([y.sum((0, 2, 3)), (y * y).sum((0, 2, 3))])
    # fp32 sums of up to N*P*Q terms, in tile partials: a few ulps of fp32 per term relative to the magnitudes summed
    scale = torch.stack([y.abs().sum((0, 2, 3)), (y * y).sum((0, 2, 3))])
    err = ((stats.double() - own).abs() / scale.clamp_min(1e-30)).max().item()
    assert err < 1e-5, (name, err)
    # and as a batch norm would use them: mean and biased variance against the float64 conv's
    npq = problem.n * problem.p * problem.q
    mean, var = stats[0].double() / npq, stats[1].double() / npq - (stats[0].double() / npq) ** 2
    tol = {"f16": 2e-3, "bf16": 1.5e-2, "f32": 1e-4}[problem.element_out.value]
    assert torch.allclose(mean, ref.mean((0, 2, 3)), rtol=tol, atol=tol * ref.std().item()), name
    assert torch.allclose(var, ref.var((0, 2, 3), unbiased=False), rtol=2 * tol, atol=tol * ref.var().item()), name


def test_channel_stats_repeat_to_the_rounding_of_their_order():
    name = "1x1_f16_big"
    problem = case(name)[0]
    config = stats_config(name)
    x, w, _ = operands(problem, seed=7)
    out1, s1 = run_stats(problem, config, x, w)
    scale = torch.stack([out1.double().abs().sum((0, 2, 3)), out1.double().square().sum((0, 2, 3))])
    for _ in range(3):  # the sums start from zero on every launch (nothing accumulates across calls)
        out2, s2 = run_stats(problem, config, x, w)
        assert torch.equal(out1, out2)
        assert ((s1.double() - s2.double()).abs() / scale).max().item() < 1e-6


def test_the_public_op_returns_y_and_its_statistics():
    name = "3x3_f16_tails"
    problem = case(name)[0]
    x, w, _ = operands(problem, seed=11)
    y, stats = conv2d_channel_stats(x, w, padding=1, config=LaunchConfig(stats_config(name)))
    torch.cuda.synchronize()
    assert y.shape == (problem.n, problem.k, problem.p, problem.q) and y.is_contiguous(memory_format=torch.channels_last)
    yd = y.double()
    assert torch.allclose(stats[0].double(), yd.sum((0, 2, 3)), rtol=1e-5, atol=1e-3)
    # a plain kernel asked for statistics, or a statistics kernel without a buffer: errors naming the parameter
    plain = sm90_config(problem, (128, 64, 64))
    with pytest.raises(UnsupportedConvError, match="stats"):
        run_problem(problem, x, w, torch.empty_like(y), config=LaunchConfig(plain), stats=stats)
    with pytest.raises(UnsupportedConvError, match="stats"):
        run_problem(problem, x, w, torch.empty_like(y), config=LaunchConfig(stats_config(name)))
