"""The project's split-k for CUTLASS 3.x wgrad (issue 11, part 2) on the H200: the sm90 split-k kernel (grid z over
slices of the N*P*Q reduction's k tiles, fp32 partials, one reduction kernel) against the float64 reference, for
1..64 slices (batch 64 for 64) and 256, uneven slice sizes, fp16 and fp32 outputs, a cluster of two, accumulate-into,
and the reduction's programmatic dependent launch captured in a CUDA graph; and the atomic twin (split_k_mode
ATOMIC: the slices' sums added by TMA reduce-adds into the zeroed fp32 output, or into a workspace the reduction then
casts) likewise.

Every output is poisoned (NaN) first and the inputs are fresh random tensors. Compiles 8 sm90 kernels (~60-90 s
each): split wgrad 64x128x64 fp16 out, the same with fp32 out, 64x128x64 with a 2x1x1 cluster, fp16 out, the
64x64x64 kernel's deep-pipeline twin (11 stages), fp16 out, the atomic twins of the first two, and the untuned
default of layer 1's 3x3 wgrad with fp32 out (an atomic twin) with its split-k twin.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cutlass_byoc import ops  # noqa: E402
from cutlass_byoc.config import LaunchConfig  # noqa: E402
from cutlass_byoc.problem import Conv2dProblem, Epilogue  # noqa: E402
from cutlass_byoc.sm90 import atomic_twin, deep_twin, deterministic_twin, sm90_config  # noqa: E402
from cutlass_byoc.types import DType, SourceKind, SplitKMode  # noqa: E402

from gpu_util import (  # noqa: E402
    TOLERANCE, TORCH, kernel_operands, module_kernels, operands, poisoned_output, reference, rel_err,
)

pytestmark = pytest.mark.gpu

TILE = (64, 128, 64)
SLICES = (1, 2, 3, 4, 7, 8, 16, 32, 64, 256)  # 3 and 7 leave uneven slices of the k tiles; the planner offers up to 256
# ResNet-50 wgrad layers: C -> K, R, stride, H
LAYERS = [(64, 64, 3, 1, 56), (64, 256, 1, 1, 56), (128, 128, 3, 1, 28), (512, 512, 3, 1, 7), (128, 128, 3, 2, 56)]


def problem(layer, batch, out, epilogue=Epilogue()):
    c, k, r, s, h = layer
    return Conv2dProblem.make("wgrad", batch, c, h, h, k, r, stride=s, padding=r // 2, dtype="f16", out_dtype=out,
                              epilogue=epilogue)


def split_config(p: Conv2dProblem, cluster=(1, 1, 1)):
    return sm90_config(p, TILE, cluster, SplitKMode.PARALLEL)


def deep_config(p: Conv2dProblem):
    """The 64x64 split kernel's deep-pipeline twin (sm90.deep_twin: 11 stages), which the planner times beside it."""
    return deep_twin(sm90_config(p, (64, 64, 64), split_k_mode=SplitKMode.PARALLEL))


def untuned_launch():
    """The untuned default of layer 1's 3x3 wgrad with fp32 out (heuristics.atomic_default: the atomic twin)."""
    from cutlass_byoc.heuristics import default_launch  # noqa: PLC0415

    return default_launch(problem(LAYERS[0], 32, "f32"))


def used_configs():
    """The module's kernels: a config never depends on the shape, only on the output type and the cluster."""
    p16, p32 = problem(LAYERS[0], 32, "f16"), problem(LAYERS[0], 32, "f32")
    untuned = untuned_launch().kernel
    return [split_config(p16), split_config(p32), split_config(p16, (2, 1, 1)), deep_config(p16),
            atomic_twin(split_config(p16)), atomic_twin(split_config(p32)), untuned, deterministic_twin(untuned)]


@pytest.fixture(scope="module", autouse=True)
def prebuilt(shared_cache):
    with module_kernels(shared_cache, used_configs):
        yield


def run(p: Conv2dProblem, launch: LaunchConfig, a, b, source=None):
    out = poisoned_output(p)
    ops.run_problem(p, a, b, out, source, config=launch)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("out", ["f16", "f32"])
@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: f"{l[0]}to{l[1]}_{l[2]}x{l[2]}_s{l[3]}_{l[4]}")
def test_sm90_wgrad_split_k(layer, out):
    errors = {}
    for batch in (32, 64):
        p = problem(layer, batch, out)
        cfg = split_config(p)
        x, w, dy = operands(p, seed=batch + layer[0] + layer[1])
        a, b = kernel_operands(p, x, w, dy)
        ref = reference(p, x, w, dy)
        for slices in SLICES:
            launch = LaunchConfig(cfg, slices)
            why = launch.reject_reason(p)
            if why:  # only where the reduction has fewer k tiles than slices (512 channels at 7x7)
                assert "exceed the reduction extent" in why and slices * TILE[2] > p.gemm_mnk[2], why
                continue
            got = run(p, launch, a, b)
            err = rel_err(got, ref)
            assert not math.isnan(err), f"NaN (unwritten or corrupt output): {launch.name} batch {batch}"
            assert err < TOLERANCE[p.element_out], f"{launch.name} batch {batch}: {err:.3e}"
            errors[(batch, slices)] = err
    assert (64, 64) in errors or layer[4] == 7  # 64 slices run at batch 64 on every layer but the 7x7 one
    floor = 1e-6 if out == "f32" else 1e-4
    for (batch, slices), err in errors.items():
        # fp32 partials and one final conversion: more slices never cost accuracy
        assert err <= 2 * errors[(batch, 1)] + floor, f"error grows with slices: {errors}"


def test_sm90_split_k_matches_the_unsplit_kernel_and_cluster():
    """The same problem on the plain sm90 kernel, the split kernel and the split kernel with a 2x1x1 cluster (whose
    CTA pair shares multicast loads, so both must walk the same k range)."""
    p = problem(LAYERS[0], 32, "f16")
    x, w, dy = operands(p, seed=7)
    a, b = kernel_operands(p, x, w, dy)
    ref = reference(p, x, w, dy)
    for launch in (LaunchConfig(split_config(p, (2, 1, 1)), 16), LaunchConfig(split_config(p, (2, 1, 1)), 3),
                   LaunchConfig(split_config(p), 16)):
        err = rel_err(run(p, launch, a, b), ref)
        assert err < TOLERANCE[DType.F16], f"{launch.name}: {err:.3e}"


@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: f"{l[0]}to{l[1]}_{l[2]}x{l[2]}_s{l[3]}_{l[4]}")
def test_sm90_split_k_deep_pipeline_twin(layer):
    """The deep twin (11 stages, past the family's cap of 8) on every layer, unsplit and split into uneven slices."""
    p = problem(layer, 32, "f16")
    cfg = deep_config(p)
    assert cfg.stages == 11
    x, w, dy = operands(p, seed=layer[0] + 3 * layer[1])
    a, b = kernel_operands(p, x, w, dy)
    ref = reference(p, x, w, dy)
    for slices in (1, 3, 16):
        launch = LaunchConfig(cfg, slices)
        if launch.reject_reason(p):
            continue
        err = rel_err(run(p, launch, a, b), ref)
        assert err < TOLERANCE[DType.F16], f"{launch.name}: {err:.3e}"


@pytest.mark.parametrize("out", ["f16", "f32"])
def test_sm90_split_k_accumulates_into(out):
    """accumulate_into (the residual source): dw = sum of slices + the existing gradient, applied by the reduction."""
    p = problem(LAYERS[2], 32, out, Epilogue(source=SourceKind.RESIDUAL))
    x, w, dy = operands(p, seed=11)
    prev = torch.randn(p.k, p.c, p.r, p.s, device="cuda").to(TORCH[p.element_out]).contiguous(
        memory_format=torch.channels_last)
    ref = reference(p, x, w, dy) + prev.double()
    launch = LaunchConfig(split_config(p), 8)
    got = ops.conv2d_wgrad(dy, x, w.shape, 1, 1, out_dtype=TORCH[p.element_out], accumulate_into=prev, config=launch)
    torch.cuda.synchronize()
    assert rel_err(got, ref) < TOLERANCE[p.element_out]


def test_sm90_split_k_back_to_back_on_one_workspace():
    """Two split launches of different problems queued on one stream share ops' workspace: the second must not
    overwrite partials the first's reduction has not read (stream order guarantees it; this checks the wiring)."""
    p1, p2 = problem(LAYERS[0], 32, "f16"), problem(LAYERS[2], 32, "f16")
    ins = []
    for p, seed in ((p1, 1), (p2, 2)):
        x, w, dy = operands(p, seed=seed)
        ins.append((p, kernel_operands(p, x, w, dy), reference(p, x, w, dy)))
    outs = []
    for p, (a, b), _ in ins:
        out = poisoned_output(p)
        ops.run_problem(p, a, b, out, config=LaunchConfig(split_config(p), 16))
        outs.append(out)
    torch.cuda.synchronize()
    for (p, _, ref), out in zip(ins, outs):
        assert rel_err(out, ref) < TOLERANCE[DType.F16]


@pytest.mark.parametrize("out", ["f16", "f32"])
@pytest.mark.parametrize("slices", [1, 4])
def test_sm90_split_k_stages(out, slices):
    """The split-k launch in its two stages: the wgrad kernel's fp32 partials in a NaN-poisoned workspace (their sum
    over the slices must be the float64 reference to fp32 accuracy, every element written), then the reduction's
    output (the partials' sum cast once), and the same launch through ops. The 16-bit reduction once compiled to no
    stores at all (its output stayed NaN while the partials were right)."""
    from cutlass_byoc.runtime import load_kernel  # noqa: PLC0415

    p = problem(LAYERS[0], 32, out)
    launch = LaunchConfig(split_config(p), slices)
    lib = load_kernel(launch.kernel)
    x, w, dy = operands(p, seed=5)
    a, b = kernel_operands(p, x, w, dy)
    ref = reference(p, x, w, dy)  # (K, C, R, S)
    nbytes = lib.workspace_size(p, slices)
    per_slice = p.k * p.r * p.s * p.c
    assert nbytes >= slices * per_slice * 4, f"workspace {nbytes} bytes for {slices} slices of {per_slice} floats"
    ws = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")
    got = poisoned_output(p)
    lib.run(p, a=a.data_ptr(), b=b.data_ptr(), d=got.data_ptr(), split_k_slices=slices, workspace=ws.data_ptr(),
            workspace_bytes=nbytes, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    parts = ws[: slices * per_slice].view(slices, p.k, p.r, p.s, p.c)
    unwritten = int(torch.isnan(parts).sum())
    assert unwritten == 0, f"kernel stage: {unwritten} of {parts.numel()} partials unwritten (NaN) with {out} output"
    summed = parts.double().sum(0).permute(0, 3, 1, 2)  # KRSC -> (K, C, R, S)
    err = float((summed - ref).norm() / ref.norm())
    # fp32 accumulation of 100352 fp16 products in wgmma: ~1e-4 relative on the H200 (the same for every output type)
    assert err < 1e-3, f"kernel stage: partials' sum off the reference by {err:.3e} with {out} output"
    nan_out = int(torch.isnan(got).sum())
    assert nan_out == 0, (f"reduction stage: {nan_out} of {got.numel()} outputs NaN with {out} output (first at "
                          f"{torch.nonzero(torch.isnan(got.permute(0, 2, 3, 1).reshape(-1)))[:4].flatten().tolist()})")
    err = rel_err(got, summed)
    assert err < TOLERANCE[p.element_out], f"reduction stage: output off the partials' sum by {err:.3e}"
    # the same launch through ops (its own workspace from the caching allocator, the prepared argument block)
    again = run(p, launch, a, b)
    nan_ops = int(torch.isnan(again).sum())
    assert nan_ops == 0, f"ops.run_problem: {nan_ops} of {again.numel()} outputs NaN with {out} output"
    assert torch.equal(again, got), f"ops.run_problem: output differs from the direct launch by {rel_err(again, got):.3e}"


@pytest.mark.parametrize("slices", [4, 64])
def test_sm90_split_k_reduction_dependent_launch_in_a_cuda_graph(slices):
    """The reduction is the split kernel's programmatic dependent launch (it may be scheduled before the partials are
    done and waits for them): captured in a CUDA graph and replayed with new dy and x, back to back with an uncaptured
    launch on the same stream, the weight gradient matches the float64 reference each time."""
    p = problem(LAYERS[0], 64, "f16")
    check_graph_replays(p, LaunchConfig(split_config(p), slices), seed=40)


def check_graph_replays(p: Conv2dProblem, launch: LaunchConfig, seed: int):
    """`launch` captured in a CUDA graph, then twice: new dy and x copied into the captured operands, the graph's
    output poisoned, an uncaptured launch and a replay back to back on one stream; both match float64."""
    x, w, dy = operands(p, seed=seed)
    a, b = kernel_operands(p, x, w, dy)
    out = poisoned_output(p)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.run_problem(p, a, b, out, config=launch)
    for new_seed in (seed + 1, seed + 2):
        x_new, _, dy_new = operands(p, seed=new_seed)
        a_new, b_new = kernel_operands(p, x_new, w, dy_new)
        a.copy_(a_new)
        b.copy_(b_new)
        ref = reference(p, x_new, w, dy_new)
        eager = poisoned_output(p)
        out.fill_(float("nan"))
        ops.run_problem(p, a, b, eager, config=launch)
        graph.replay()
        torch.cuda.synchronize()
        for name, got in (("replayed", out), ("uncaptured", eager)):
            err = rel_err(got, ref)
            assert err < TOLERANCE[p.element_out], f"{launch.name} {name}: {err:.3e}"


# ------------------------------------------------------------------------------------------------ atomic twin
ATOMIC_SLICES = (1, 2, 3, 7, 16, 64, 256)


@pytest.mark.parametrize("out", ["f16", "f32"])
@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: f"{l[0]}to{l[1]}_{l[2]}x{l[2]}_s{l[3]}_{l[4]}")
def test_sm90_wgrad_atomic_split_k(layer, out):
    """The atomic twin against float64 on every layer and slice count: with an fp32 output the slices add straight
    into it (zeroed by the launch's own zeroing kernel, so the NaN poison must be gone), with fp16 into a workspace the
    reduction casts; and against its split-k twin (the same sums, added in another order: close, not bitwise)."""
    p = problem(layer, 32, out)
    twin = split_config(p)
    cfg = atomic_twin(twin)
    x, w, dy = operands(p, seed=3 + layer[0] + layer[1])
    a, b = kernel_operands(p, x, w, dy)
    ref = reference(p, x, w, dy)
    from cutlass_byoc.runtime import load_kernel  # noqa: PLC0415

    lib = load_kernel(cfg)
    assert (lib.workspace_size(p, 16) == 0) == (out == "f32")  # fp32 out, no source: the sums are the output
    ran = 0
    for slices in ATOMIC_SLICES:
        launch = LaunchConfig(cfg, slices)
        if launch.reject_reason(p):
            continue
        got = run(p, launch, a, b)
        err = rel_err(got, ref)
        assert not math.isnan(err), f"NaN (unwritten output): {launch.name}"
        assert err < TOLERANCE[p.element_out], f"{launch.name}: {err:.3e}"
        other = run(p, LaunchConfig(twin, slices), a, b)
        assert rel_err(got, other) < TOLERANCE[p.element_out], f"{launch.name} vs its split-k twin"
        ran += 1
    assert ran >= 5


@pytest.mark.parametrize("out", ["f16", "f32"])
def test_sm90_atomic_split_k_accumulates_into(out):
    """accumulate_into (the residual source): the sums go to the workspace and the reduction adds the existing
    gradient once, for an fp32 output too (its sums cannot go straight into an output that holds the source)."""
    p = problem(LAYERS[2], 32, out, Epilogue(source=SourceKind.RESIDUAL))
    x, w, dy = operands(p, seed=13)
    prev = torch.randn(p.k, p.c, p.r, p.s, device="cuda").to(TORCH[p.element_out]).contiguous(
        memory_format=torch.channels_last)
    ref = reference(p, x, w, dy) + prev.double()
    launch = LaunchConfig(atomic_twin(split_config(p)), 8)
    got = ops.conv2d_wgrad(dy, x, w.shape, 1, 1, out_dtype=TORCH[p.element_out], accumulate_into=prev, config=launch)
    torch.cuda.synchronize()
    assert rel_err(got, ref) < TOLERANCE[p.element_out]


@pytest.mark.parametrize("out", ["f16", "f32"])
def test_sm90_atomic_split_k_in_a_cuda_graph(out):
    """The zeroing kernel and the split kernel, its programmatic dependent, are captured together: a CUDA graph
    replayed with new dy and x (its output poisoned between replays), back to back with an uncaptured launch, matches
    float64 each time."""
    p = problem(LAYERS[0], 64, out)
    check_graph_replays(p, LaunchConfig(atomic_twin(split_config(p)), 16), seed=50)


def test_untuned_fp32_wgrad_adds_atomically_unless_deterministic():
    """Untuned (the model's launch, no decision), a wgrad that stores fp32 runs its split-k kernel's atomic twin
    (heuristics.atomic_default) and matches float64; under torch.use_deterministic_algorithms(True) the same call
    runs the split-k kernel with partials instead, bitwise the same from run to run, and close to the atomic sums."""
    p = problem(LAYERS[0], 32, "f32")
    launch = untuned_launch()
    assert launch.kernel.split_k_mode is SplitKMode.ATOMIC and launch.split_k_slices > 1, launch.name
    x, w, dy = operands(p, seed=71)
    ref = reference(p, x, w, dy)

    def call():
        got = ops.conv2d_wgrad(dy, x, w.shape, 1, 1, out_dtype=torch.float32, select="heuristic")
        torch.cuda.synchronize()
        return got

    from cutlass_byoc.select import choose  # noqa: PLC0415

    assert choose(p, "heuristic") == launch
    atomic = call()
    assert rel_err(atomic, ref) < TOLERANCE[p.element_out]
    torch.use_deterministic_algorithms(True)
    try:
        assert choose(p, "heuristic") == LaunchConfig(deterministic_twin(launch.kernel), launch.split_k_slices)
        first, second = call(), call()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first, second)
    assert rel_err(first, ref) < TOLERANCE[p.element_out] and rel_err(first, atomic) < TOLERANCE[p.element_out]
