"""GPU: a symbolic batch size keeps the offload (torch.compile's default recompiles with a dynamic batch after a
second batch size, e.g. a smaller last batch, and that graph then serves every later step). Model families train
through the real backend over batch sizes 8, 5, 8, 3, 5, 8 (tests/models.py's DYNAMIC_BATCHES): every step's fp16-autocast
result against an fp32 reference (the backend's error no worse than eager autocast's, within SLACK), every pass of
every step on the kernels (no fallback at run time), the dynamic graph's call sites bound once per batch size, and
their later calls on the C++ path. One family also runs through Inductor with CUDA graphs (cudagraph trees record
one graph per batch size), against the same reference, once over those sizes (warm-up and recording of each) and
once meeting one size four times (its replays too)."""

from __future__ import annotations

import copy

import pytest
import torch

from gpu_util import STEP_ABS as ABS, STEP_SLACK as SLACK, fp32_truth, training_step
from models import DYNAMIC_BATCHES, DYNAMIC_FAMILIES, FAMILIES, input_channels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (these tests run on the H200)"),
]

CL = torch.channels_last


def _run(family, inductor=False, cudagraphs=False, batches=DYNAMIC_BATCHES):
    from cutlass_byoc.offload import library, make_backend, native
    from cutlass_byoc.offload.bench import relative_errors

    torch.manual_seed(0)
    base = FAMILIES[family]().cuda().to(memory_format=CL).train()
    c = input_channels(base)
    truth_m, eager_m, ours_m = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    torch._dynamo.reset()
    library.RUNTIME.clear()
    opts = {"select": "heuristic", "strict": True, "cudagraphs": cudagraphs}
    backend = make_backend(opts, inductor=inductor)
    compiled = torch.compile(ours_m, backend=backend)
    first_site = len(library._SITES)
    lines = []
    launches = []
    for step, n in enumerate(batches):
        x = torch.randn(n, c, 64, 64, device="cuda").contiguous(memory_format=CL)
        truth, eager = fp32_truth(truth_m, x), training_step(eager_m, x, autocast=True)
        calls0 = sum(library.RUNTIME.kernel_calls.values())
        if cudagraphs:  # a new step: no replay reads the previous step's outputs (cudagraph trees)
            torch.compiler.cudagraph_mark_step_begin()
        ours = training_step(compiled, x, autocast=True)
        torch.cuda.synchronize()
        calls = sum(library.RUNTIME.kernel_calls.values()) - calls0
        launches.append(calls)
        e_eager, e_ours = relative_errors(*eager, *truth), relative_errors(*ours, *truth)
        lines.append(f"step {step} batch {n}: errors (loss, grad, worst param) vs fp32: eager fp16 "
                     f"{tuple(f'{e:.2e}' for e in e_eager)}, backend {tuple(f'{e:.2e}' for e in e_ours)}; "
                     f"kernel launches {calls}")
        assert e_ours[0] <= SLACK * e_eager[0] + ABS, (step, n, e_ours, e_eager)
        assert e_ours[1] <= SLACK * e_eager[1] + ABS, (step, n, e_ours, e_eager)
        # every offloaded pass of the graph serving this step ran on a kernel
        serving = backend.reports[-1] if step else backend.reports[0]
        if not cudagraphs:  # (a replay launches no op)
            assert calls >= len(serving.offloaded) > 0, (step, n, calls, serving.summary())
    print(f"\n{family} ({'inductor' if inductor else 'eager'}{' + cudagraphs' if cudagraphs else ''}):\n  "
          + "\n  ".join(lines) + f"\n{backend.reports[-1].summary()}")
    assert not library.RUNTIME.fallbacks, library.RUNTIME.fallbacks
    assert len(backend.reports) == 2, [r.summary() for r in backend.reports]  # static at 8, then dynamic
    dyn = backend.reports[-1]
    assert dyn.failure is None and dyn.offloaded and all(any(n.startswith("dynamic batch") for n in e.notes)
                                                         for e in dyn.offloaded), dyn.summary()
    sites = [s for s in library._SITES[first_site:] if s.dynamic]
    assert sites and all(set(s.batches) == set(batches[1:]) for s in sites), \
        [(s.problem.name, sorted(s.batches)) for s in sites]
    # bound at every size, but where the plan's launch rewrites the problem (channel padding, space-to-depth): those
    # take the general path at every size, as a static site does
    from cutlass_byoc.select import choose

    general = {s.index for s in sites if choose(s.problem, "heuristic").padded}
    assert all((s.batches[n] is False) == (s.index in general) for s in sites for n in s.batches), \
        [(s.problem.name, n, b is False) for s in sites for n, b in s.batches.items()]
    nat = native.loaded()
    if nat is not None and not cudagraphs:  # the sizes met again ran on the C++ path's bindings of their size
        assert all(nat.calls(s.index) >= 2 for s in sites if s.index not in general), \
            [(s.problem.name, nat.calls(s.index)) for s in sites]
    return launches


@pytest.mark.parametrize("family", DYNAMIC_FAMILIES)
def test_dynamic_batch_training_vs_fp32(family):
    _run(family)


def test_dynamic_batch_under_inductor_and_cuda_graphs():
    _run("chain", inductor=True, cudagraphs=True)


def test_dynamic_batch_under_cuda_graph_replays():
    """A batch size met again and again under CUDA graphs: cudagraph trees warm each size up, record it, then replay
    it (no op runs: the step's kernel launches are the recorded ones); every step's result, replays included,
    against the fp32 truth. (The test above meets each size at most twice in the dynamic graph: warm-up and
    recording, no replay.)"""
    launches = _run("chain", inductor=True, cudagraphs=True, batches=(8, 5, 5, 5, 5, 8))
    assert launches[-2] == 0, launches  # a replay of batch 5
