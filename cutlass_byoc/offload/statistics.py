"""Batch statistics as one pass of shifted sums (OffloadOptions.bn_sums): each training batch norm's
``var_mean`` over every dimension but the channels becomes, per channel, the sum and the sum of squares of
``x - shift`` (shift: the channel's first element), from which ``mean = shift + s1 / n`` and
``var = max(s2 - s1 * s1 / n, 0) / (n - correction)``.

Why: Inductor lowers a large ``var_mean`` as a Welford reduction (``triton_helpers.welford_reduce``: a running mean,
M2 and count per lane, a division per element), and the forward batch norms' statistics of a ResNet-50 b64
training step ran at 1.58 TB/s in the step, 37% of the H200's copy speed (0.95 ms for 1.5 GB; 131 launches, the
largest kernels 1.3-2.0 TB/s; ``benchmarks/h200/inductor-bandwidth-b64-session44.json`` with the same step's
profile, README). The sums are two multiply-adds an element in one pass; Inductor fuses both into one reduction.

Accuracy: the shift keeps the sums about the channel's values, so the subtraction ``s2 - s1 * s1 / n`` does not
cancel what a large mean would (the variance of fp16 data near 1000 with spread 1, plain sums of squares in fp32,
would lose about 1e6 * 2**-24, 6%, of its value; shifted, the sums are of numbers of the spread's size). Sums are fp32,
as Inductor's Welford is, over the var_mean's own fp32 input (the batch norm's cast of an fp16/bf16 activation).

Only a ``var_mean`` of a static-shaped fp32 tensor of 2 or more dimensions over every dimension but dimension 1
(BatchNorm1d/2d/3d's batch statistics) is rewritten, with its results read through ``getitem``; reductions over
the last dimension (layer norm) and every other var_mean stay Inductor's.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .pooling import _static  # a tensor of static sizes and strides

aten = torch.ops.aten
log = logging.getLogger("cutlass_byoc.offload")

VAR_MEAN = aten.var_mean.correction
#: the metadata the new nodes take from the var_mean they replace: where it came from, not what it computes
PROVENANCE = ("original_aten", "stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr", "from_node",
              "partitioner_tag", "custom")


def _val(node) -> Optional[torch.Tensor]:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def match(vm: fx.Node, require_cuda: bool = True) -> tuple[Optional[dict], str]:
    """(what the rewrite needs, '') for a batch norm's var_mean, else (None, why not)."""
    if vm.op != "call_function" or vm.target is not VAR_MEAN:
        return None, "not a var_mean"
    if len(vm.args) < 1 or len(vm.args) > 2 or set(vm.kwargs) - {"dim", "correction", "keepdim"}:
        return None, "unexpected arguments"
    x = vm.args[0]
    xv = _val(x)
    if xv is None:
        return None, "no input metadata"
    if not _static(xv):
        return None, "dynamic shape"
    if xv.dtype is not torch.float32:
        return None, f"input {xv.dtype} (float32 only: the batch norm's compute type)"
    if xv.dim() < 2:
        return None, f"a {xv.dim()}-D input"
    if require_cuda and xv.device.type != "cuda":
        return None, "not on CUDA"
    dims = vm.args[1] if len(vm.args) > 1 else vm.kwargs.get("dim")
    if dims is None:
        return None, "a reduction over every dimension"
    dims = sorted(d % xv.dim() for d in dims)
    if dims != [d for d in range(xv.dim()) if d != 1]:
        return None, f"dims {dims}, not every dimension but the channels"
    correction = vm.kwargs.get("correction", 1)
    if isinstance(correction, bool) or not isinstance(correction, (int, float)) or correction < 0:
        return None, f"correction {correction!r}"
    n = xv.numel() // xv.shape[1] if xv.shape[1] else 0
    if n - correction <= 0:
        return None, f"{n} elements a channel, correction {correction}"
    if not vm.users or not all(u.target is operator.getitem and u.args[1] in (0, 1) for u in vm.users):
        return None, "its results read otherwise than by getitem"
    return {"x": x, "dims": dims, "correction": correction, "n": n, "keepdim": bool(vm.kwargs.get("keepdim"))}, ""


class _Builder:
    """Inserts calls, each with its fake value (meta "val") computed from its inputs' and the replaced node's
    PROVENANCE (Inductor names a kernel after the original_aten ops of its nodes, and the offload bench's profile
    tells the batch norms' statistics kernels by that name)."""

    def __init__(self, graph: fx.Graph, fake_mode, meta: dict) -> None:
        self.graph = graph
        self.fake_mode = fake_mode
        self.meta = meta

    def __call__(self, target, *args) -> fx.Node:
        node = self.graph.call_function(target, args)
        node.meta.update(self.meta)
        fake_args = pytree.tree_map(lambda a: _val(a) if isinstance(a, fx.Node) else a, args)
        with self.fake_mode or contextlib.nullcontext():
            node.meta["val"] = target(*fake_args)
        return node


def _rewrite(graph: fx.Graph, vm: fx.Node, m: dict) -> None:
    x, dims, n, corr = m["x"], m["dims"], float(m["n"]), float(m["correction"])
    call = _Builder(graph, getattr(_val(x), "fake_mode", None), {k: v for k, v in vm.meta.items() if k in PROVENANCE})
    with graph.inserting_before(vm):
        shift = x
        for d in dims:  # x[0:1, :, 0:1, ...]: each channel's first element, shaped as the keepdim result
            shift = call(aten.slice.Tensor, shift, d, 0, 1)
        dx = call(aten.sub.Tensor, x, shift)
        s1 = call(aten.sum.dim_IntList, dx, dims, True)
        s2 = call(aten.sum.dim_IntList, call(aten.mul.Tensor, dx, dx), dims, True)
        m1 = call(aten.div.Tensor, s1, n)
        mean = call(aten.add.Tensor, shift, m1)
        m2 = call(aten.clamp_min.default, call(aten.sub.Tensor, s2, call(aten.mul.Tensor, s1, m1)), 0.0)
        var = call(aten.div.Tensor, m2, n - corr)
        if not m["keepdim"]:
            var, mean = call(aten.squeeze.dims, var, dims), call(aten.squeeze.dims, mean, dims)
    out = {0: var, 1: mean}
    for u in list(vm.users):
        new = out[u.args[1]]
        new.meta.update({k: v for k, v in u.meta.items() if k in PROVENANCE})
        u.replace_all_uses_with(new)
        graph.erase_node(u)
    graph.erase_node(vm)


def rewrite_batch_statistics(graph: fx.Graph, require_cuda: bool = True) -> tuple[int, list[str]]:
    """Rewrite each batch norm's var_mean of the graph as shifted sums (see the module's doc); return how many, and
    why each other var_mean was left to Inductor."""
    done, left = 0, []
    for vm in [n for n in graph.nodes if n.op == "call_function" and n.target is VAR_MEAN]:
        m, why = match(vm, require_cuda)
        if m is None:
            left.append(f"{vm.name}: {why}")
            continue
        _rewrite(graph, vm, m)
        done += 1
    for why in left:
        log.info("var_mean left to Inductor: %s", why)
    return done, left
