"""Per-parameter small ops batched into multi-tensor launches (OffloadOptions.batch_params), in the graphs this
backend changed:

* casts: every ``prims.convert_element_type`` of a graph input (a parameter, the batch) to another floating dtype
  becomes an output of one ``cutlass_byoc::cast_params`` call. Under autocast each conv and linear weight is cast
  from fp32 on every step, and Inductor gives each cast its own kernel: 57 per ResNet-50 training step, ~2.3 us
  apiece on the H200 under CUDA graphs (~0.13 ms of the step's GPU time, plus a launch gap each), most of them too
  small to fill the GPU. ``cast_params`` copies them all with PyTorch's multi-tensor copy, a launch per ~110 tensors
  or ~20M elements.
* counters: every ``aten.add.Tensor(input, n)`` of a 0-dim integer graph input (a training batch norm's
  ``num_batches_tracked += 1``, 53 per ResNet-50 step, ~1.1 us each) becomes an output of one
  ``aten._foreach_add.Scalar``, which Inductor compiles as one foreach kernel, as it does a compiled optimizer's
  step counters.

What is batched: inputs that are placeholders (not a joint graph's incoming gradients) with static shape and dense
strides (a cast's result then has its input's strides, as the cast it replaces), on one device, the same dtype pair
(casts) or dtype and addend (counters); a group of fewer than two is left alone. The batch runs where the group's
first op was (its inputs, placeholders all, are defined before every other node); the values are the same, so
nothing downstream changes.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from . import library

aten = torch.ops.aten
prims = torch.ops.prims


def _placeholder_val(node: fx.Node, require_cuda: bool) -> Optional[torch.Tensor]:
    """The value of node's first argument if it is a static, dense graph input (on CUDA where required)."""
    if node.op != "call_function" or node.kwargs or len(node.args) != 2:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.op != "placeholder" or _is_tangent(src):
        return None
    v = src.meta.get("val")
    if not isinstance(v, torch.Tensor) or (require_cuda and v.device.type != "cuda"):
        return None
    if not all(isinstance(d, int) for d in (*v.shape, *v.stride())) or v.numel() == 0:
        return None
    return v if _dense(tuple(v.shape), tuple(v.stride())) else None


def _is_tangent(node: fx.Node) -> bool:
    """Whether a placeholder of a joint graph is an incoming gradient (AOTAutograd names them tangents_N, as its
    partitioner's _is_tangent reads them): known only in the backward, so never batched with the forward's inputs
    (the batch would then be computed in the backward, and the forward's values with it)."""
    return "tangents" in str(node.target)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether the elements fill their storage span exactly once (a permutation of a contiguous layout)."""
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def _cast_key(node: fx.Node, require_cuda: bool) -> Any:
    """The group of a batchable cast: (device, source dtype, target dtype), else None."""
    if node.target is not prims.convert_element_type.default:
        return None
    src, out, dtype = _placeholder_val(node, require_cuda), node.meta.get("val"), node.args[1]
    if src is None or not isinstance(out, torch.Tensor) or not isinstance(dtype, torch.dtype):
        return None
    if not (src.dtype.is_floating_point and dtype.is_floating_point) or src.dtype == dtype or out.dtype != dtype:
        return None
    if tuple(out.stride()) != tuple(src.stride()):
        return None
    return (src.device, src.dtype, dtype)


def _counter_key(node: fx.Node, require_cuda: bool) -> Any:
    """The group of a batchable counter increment: (device, dtype, addend), else None."""
    if node.target is not aten.add.Tensor:
        return None
    src, out, n = _placeholder_val(node, require_cuda), node.meta.get("val"), node.args[1]
    if src is None or src.dim() != 0 or src.dtype.is_floating_point or src.dtype.is_complex or src.dtype == torch.bool:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not isinstance(out, torch.Tensor) or out.dtype != src.dtype:
        return None
    return (src.device, src.dtype, n)


def _batch(graph: fx.Graph, key_of: Callable[[fx.Node], Any], make: Callable[[list[fx.Node], Any], tuple]) -> int:
    """Replace each group (by key_of) of two or more nodes with one call of make(inputs, key) -> (target, args),
    whose i-th result stands for the group's i-th node; return how many nodes were replaced."""
    groups: dict[Any, list[fx.Node]] = {}
    for node in graph.nodes:
        key = key_of(node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    batched = 0
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        target, args = make([n.args[0] for n in nodes], key)
        with graph.inserting_before(nodes[0]):  # its inputs, placeholders all, are defined before every other node
            call = graph.call_function(target, args)
            call.meta["val"] = [n.meta["val"] for n in nodes]
            for i, node in enumerate(nodes):
                item = graph.call_function(operator.getitem, (call, i))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
        for node in nodes:
            graph.erase_node(node)
        batched += len(nodes)
    return batched


def batch_param_casts(graph: fx.Graph, require_cuda: bool = True) -> int:
    """The graph's batchable casts as ``cast_params`` calls, one per (device, dtype pair); returns how many casts."""
    return _batch(graph, lambda n: _cast_key(n, require_cuda), lambda xs, key: (library.CAST_PARAMS, (xs, key[2])))


def batch_counters(graph: fx.Graph, require_cuda: bool = True) -> int:
    """The graph's batchable counter increments as ``_foreach_add.Scalar`` calls, one per (device, dtype, addend);
    returns how many increments."""
    return _batch(graph, lambda n: _counter_key(n, require_cuda),
                  lambda xs, key: (aten._foreach_add.Scalar, (xs, key[2])))
