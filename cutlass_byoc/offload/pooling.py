"""Training max-pool layers on this backend's kernels (OffloadOptions.max_pool): the ops and the joint-graph rewrite.

In a training graph a 2-D max pool is a forward (``prims._low_memory_max_pool_with_offsets`` under Inductor's
decompositions: the values and each window's offset of its maximum, made indices by
``prims._low_memory_max_pool_offsets_to_indices``; else ``aten.max_pool2d_with_indices``) and a backward that reads
the indices: ``aten.max_pool2d_with_indices_backward``, or, where PyTorch decomposes it (torch/_decomp), zeros of
(N*C, H*W) in fp32 that a ``scatter_add`` fills with the gradient, reshaped and cast back. Inductor recomputes the
forward's offsets from the input in the backward (the joint graph keeps none): ResNet-50's stem pool's backward took
0.18 ms (batch 32) and 0.36 ms (batch 64) of a training step under CUDA graphs on an H100, in Inductor's step and in
this backend's alike, where reading the gradient and the offsets and writing the input's gradient moves ~70 MB at
batch 32 (~25 us). The rewrite gives the pair to two ops of this module:

* ``cutlass_byoc::max_pool2d_fwd(x, kernel, stride, padding, dilation, ceil_mode) -> (values, offsets)``: the
  pooled values and, per window, where its maximum was (int8, ``kh * KW + kw``, as Inductor's low-memory pool),
  the same shape and strides as the values; the offsets are what the backward keeps of the forward;
* ``cutlass_byoc::max_pool2d_bwd(grad, offsets, input_size, kernel, stride, padding, dilation, ceil_mode,
  channels_last, grad2=None) -> grad_input``: each input element's gradient, gathered from the windows whose maximum
  it was; where the graph's gradient of the pool is an add of two tensors that nothing else reads (ResNet's stem
  pool feeds the first block's conv and its shortcut), the op takes both (grad, grad2) and adds them itself, in fp32,
  so that no add kernel is left beside it (Inductor fuses that add into its own pool backward).

Both follow ATen's ``max_pool2d_with_indices`` (its tie and NaN rules, its order of the backward's fp32 sums) and
its layouts (the values in the memory format ``suggest_memory_format`` gives the input, the input's gradient in the
one the graph recorded). On CUDA they run the Triton kernels of pool_kernels.py; off CUDA, for tensors of 2**31
elements or more (the kernels' int32 arithmetic), and where Triton cannot be imported (said once in the log), ATen's
own pooling, the offsets converted to and from its indices.

What is rewritten: a forward and the backward that reads its indices, on the same input with the same parameters,
4-D, static shapes, fp16/bf16/fp32, a window of at most 127 elements, on CUDA where ``require_cuda``, the indices and
every step between them and the result read by nothing else, and the layouts the graph recorded equal to ones the
ops make. Anything else is left to Inductor as it was (the reason logged). Inference graphs (no backward) are not
touched.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch._prims_common import suggest_memory_format

from .library import _LIB, _TAGS, NAMESPACE

log = logging.getLogger("cutlass_byoc.offload")

aten = torch.ops.aten
prims = torch.ops.prims

#: the most elements a window may have (its offset is stored as int8)
MAX_WINDOW = 127

# needs_fixed_stride_order: Inductor passes the input in the strides traced, so the outputs' strides (made from them)
# are the ones the fake implementations gave it
_LIB.define("max_pool2d_fwd(Tensor x, int[2] kernel, int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode)"
            " -> (Tensor, Tensor)", tags=_TAGS)
_LIB.define("max_pool2d_bwd(Tensor grad, Tensor offsets, SymInt[4] input_size, int[2] kernel, int[2] stride, "
            "int[2] padding, int[2] dilation, bool ceil_mode, bool channels_last, Tensor? grad2=None) -> Tensor",
            tags=_TAGS)


def out_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """A pooled dimension's size, as ATen computes it (pooling_output_shape)."""
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = num // s + 1
    if ceil_mode and (out - 1) * s >= size + p:  # the last window must start inside the input or its left padding
        out -= 1
    return out


def _strides(shape: Sequence[int], memory_format) -> tuple[int, ...]:
    return torch.empty(tuple(shape), device="meta").contiguous(memory_format=memory_format).stride()


def _new(like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, memory_format) -> torch.Tensor:
    """An uninitialised tensor on like's device (fake where like is fake), dense in memory_format."""
    shape = tuple(int(d) for d in shape)
    return like.new_empty_strided(shape, _strides(shape, memory_format), dtype=dtype)


def _fwd_outputs(x: torch.Tensor, kernel, stride, padding, dilation, ceil_mode) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's values and offsets: ATen's output shape, in the memory format it suggests for the input."""
    n, c, h, w = x.shape
    shape = (n, c, out_size(h, kernel[0], stride[0], padding[0], dilation[0], ceil_mode),
             out_size(w, kernel[1], stride[1], padding[1], dilation[1], ceil_mode))
    fmt = suggest_memory_format(x)
    return _new(x, shape, x.dtype, fmt), _new(x, shape, torch.int8, fmt)


def _bwd_output(grad: torch.Tensor, input_size, channels_last: bool) -> torch.Tensor:
    """The input's gradient, dense in the memory format the graph recorded for it."""
    return _new(grad, input_size, grad.dtype, torch.channels_last if channels_last else torch.contiguous_format)


@functools.lru_cache(maxsize=1)
def _triton_kernels():
    """pool_kernels, or None (the reason logged once) where Triton cannot be imported."""
    try:
        from . import pool_kernels  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - no Triton (or a broken one): ATen's pooling serves the ops
        log.warning("cutlass_byoc: max-pool ops run on ATen's kernels: Triton unavailable (%s: %s)", type(e).__name__, e)
        return None
    return pool_kernels


def _extent(t: torch.Tensor) -> int:
    """How many elements t's view spans in its storage (1 + the largest offset of an element)."""
    return 1 + sum((d - 1) * abs(s) for d, s in zip(t.shape, t.stride()) if d > 0)


def int32_holds(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether the kernels' int32 arithmetic holds for the tensors (each one's element count and extent under 2**31:
    the kernels count positions, and offsets inside an image, in int32)."""
    return all(max(_extent(t), t.numel()) < 2**31 for t in tensors if t is not None)


def _kernels_for(*tensors: Optional[torch.Tensor]):
    """pool_kernels where the tensors are on CUDA and int32_holds for them; else None, and ATen's pooling serves the
    op."""
    if not all(t.is_cuda for t in tensors if t is not None) or not int32_holds(*tensors):
        return None
    return _triton_kernels()


def _window_starts(t: torch.Tensor, stride, padding) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window's first input row and column (negative in the padding), broadcastable to t (N, C, PH, PW)."""
    ph, pw = t.shape[2:]
    return (torch.arange(ph, device=t.device).view(1, 1, ph, 1) * stride[0] - padding[0],
            torch.arange(pw, device=t.device).view(1, 1, 1, pw) * stride[1] - padding[1])


def offsets_to_indices(offsets: torch.Tensor, input_w: int, kernel, stride, padding, dilation) -> torch.Tensor:
    """ATen's flat indices (ih * W + iw) of the window offsets (kh * KW + kw)."""
    h0, w0 = _window_starts(offsets, stride, padding)
    o = offsets.long()
    kh, kw = o // kernel[1], o % kernel[1]
    return (h0 + kh * dilation[0]) * input_w + w0 + kw * dilation[1]


def indices_to_offsets(indices: torch.Tensor, input_w: int, kernel, stride, padding, dilation) -> torch.Tensor:
    """The window offsets (kh * KW + kw) of ATen's flat indices (ih * W + iw)."""
    h0, w0 = _window_starts(indices, stride, padding)
    kh = (indices // input_w - h0) // dilation[0]
    kw = (indices % input_w - w0) // dilation[1]
    return (kh * kernel[1] + kw).to(torch.int8)


def _max_pool2d_fwd(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
                    ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    vals, offsets = _fwd_outputs(x, kernel, stride, padding, dilation, ceil_mode)
    kernels = _kernels_for(x, vals)
    if kernels is not None:
        kernels.max_pool2d_fwd(x, vals, offsets, kernel, stride, padding, dilation)
        return vals, offsets
    v, idx = aten.max_pool2d_with_indices.default(x, kernel, stride, padding, dilation, ceil_mode)
    vals.copy_(v)
    offsets.copy_(indices_to_offsets(idx, x.shape[3], kernel, stride, padding, dilation))
    return vals, offsets


def _max_pool2d_bwd(grad: torch.Tensor, offsets: torch.Tensor, input_size: list[int], kernel: list[int],
                    stride: list[int], padding: list[int], dilation: list[int], ceil_mode: bool,
                    channels_last: bool, grad2: Optional[torch.Tensor] = None) -> torch.Tensor:
    grad_input = _bwd_output(grad, input_size, channels_last)
    kernels = _kernels_for(grad, offsets, grad_input, grad2)
    if kernels is not None:
        kernels.max_pool2d_bwd(grad, offsets, grad_input, kernel, stride, padding, dilation, grad2=grad2)
        return grad_input
    # ATen's backward in fp32 (the kernels' sums), reading only the shape and layout of its input (an empty fp32
    # tensor of grad_input's shape and strides stands in for it: nothing is read, nothing cast) and the indices
    idx = offsets_to_indices(offsets, input_size[3], kernel, stride, padding, dilation)
    g = grad.float() if grad2 is None else grad.float() + grad2.float()
    like = torch.empty_strided(grad_input.shape, grad_input.stride(), dtype=torch.float32, device=grad_input.device)
    grad_input.copy_(aten.max_pool2d_with_indices_backward.default(g, like, kernel, stride, padding, dilation,
                                                                   ceil_mode, idx))
    return grad_input


_LIB.impl("max_pool2d_fwd", _max_pool2d_fwd, "CompositeExplicitAutograd")
_LIB.impl("max_pool2d_bwd", _max_pool2d_bwd, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::max_pool2d_fwd", lib=_LIB)(
    lambda x, kernel, stride, padding, dilation, ceil_mode: _fwd_outputs(x, kernel, stride, padding, dilation,
                                                                          ceil_mode))
torch.library.register_fake(f"{NAMESPACE}::max_pool2d_bwd", lib=_LIB)(
    lambda grad, offsets, input_size, kernel, stride, padding, dilation, ceil_mode, channels_last, grad2=None:
    _bwd_output(grad, input_size, channels_last))

FWD = torch.ops.cutlass_byoc.max_pool2d_fwd.default
BWD = torch.ops.cutlass_byoc.max_pool2d_bwd.default

# ------------------------------------------------------------------------------------------------ the rewrite
BACKWARD = aten.max_pool2d_with_indices_backward.default
SCATTER_ADD = aten.scatter_add.default
ATEN_FORWARD = aten.max_pool2d_with_indices.default


def _inductor_prim(name: str) -> Any:
    """One of Inductor's pooling prims (registered when Inductor is imported, so looked up when a graph is), or None."""
    return getattr(getattr(prims, name, None), "default", None)


#: the reshapes, copies and casts between the decomposed backward's scatter_add and its gradients and indices
_PLUMBING = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
             prims.convert_element_type.default, aten.alias.default}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pair(v: Any, default: Optional[list[int]] = None) -> Optional[list[int]]:
    if isinstance(v, int) and not isinstance(v, bool):
        return [v, v]
    if isinstance(v, (list, tuple)) and all(isinstance(e, int) and not isinstance(e, bool) for e in v):
        if len(v) == 0 and default is not None:
            return list(default)
        if len(v) in (1, 2):
            return [v[0], v[-1]]
    return None


def _params(args: Sequence[Any]) -> Optional[tuple]:
    """(kernel, stride, padding, dilation, ceil_mode) of a pool's arguments after its input."""
    kernel = _pair(args[0]) if args else None
    if kernel is None:
        return None
    rest = list(args[1:]) + [None] * 4
    stride = _pair(rest[0] if rest[0] is not None else [], kernel)
    padding = _pair(rest[1] if rest[1] is not None else 0)
    dilation = _pair(rest[2] if rest[2] is not None else 1)
    ceil_mode = rest[3] if rest[3] is not None else False
    if None in (stride, padding, dilation) or not isinstance(ceil_mode, bool):
        return None
    return kernel, stride, padding, dilation, ceil_mode


def _item(node: fx.Node, index: int) -> Optional[fx.Node]:
    """The node's getitem(index) user, if it has exactly one."""
    items = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
    return items[0] if len(items) == 1 else None


def _static(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and all(isinstance(d, int) for d in (*t.shape, *t.stride()))


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _forward_of(indices: Any) -> Optional[dict]:
    """The pool forward whose indices `indices` are: getitem 1 of aten's forward, or Inductor's low-memory forward's
    offsets (getitem 1) made indices; with the nodes that only the backward reads."""
    if not isinstance(indices, fx.Node):
        return None
    if indices.target is operator.getitem and getattr(indices.args[0], "target", None) is ATEN_FORWARD:
        return dict(fwd=indices.args[0], index_item=indices, only_backward=[indices])
    to_indices = _inductor_prim("_low_memory_max_pool_offsets_to_indices")
    if to_indices is not None and indices.target is to_indices:
        item = indices.args[0]
        if (isinstance(item, fx.Node) and item.target is operator.getitem and item.args[1] == 1
                and getattr(item.args[0], "target", None) is _inductor_prim("_low_memory_max_pool_with_offsets")):
            return dict(fwd=item.args[0], index_item=item, only_backward=[indices, item])
    return None


def _back_through_plumbing(node: Any, chain: list[fx.Node]) -> Any:
    """The first node before `node` that is not a reshape, copy or cast (each one passed added to chain)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _PLUMBING:
        chain.append(node)
        node = node.args[0]
    return node


def _aten_backward(bwd: fx.Node) -> tuple[Optional[dict], str]:
    """aten.max_pool2d_with_indices_backward(grad, x, kernel, stride, padding, dilation, ceil_mode, indices)."""
    if len(bwd.args) != 8 or bwd.kwargs:
        return None, "unexpected arguments"
    grad, x, *rest = bwd.args
    m = _forward_of(rest[-1])
    if m is None:
        return None, "indices not of a max-pool forward"
    if m["fwd"].args[0] is not x or _params(rest[:-1]) != _params(m["fwd"].args[1:]):
        return None, "the forward of another input or other parameters"
    m.update(grad=grad, out=bwd, plumbing=[bwd])
    return m, ""


def _scatter_backward(scatter: fx.Node) -> tuple[Optional[dict], str]:
    """The backward as PyTorch's decomposition writes it (torch/_decomp: max_pool2d_with_indices_backward):
    zeros (N*C, H*W) [fp32 for fp16/bf16], scatter_add along dim 1 of the indices and the gradient (N*C, PH*PW) [cast
    to fp32], reshaped to (N, C, H, W) [cast back] [made contiguous in the input's memory format]."""
    if len(scatter.args) != 4 or scatter.kwargs or scatter.args[1] != 1:
        return None, "unexpected arguments"
    zeros, _, indices, src = scatter.args
    if not (isinstance(zeros, fx.Node) and zeros.target is aten.full.default and zeros.args[1] == 0
            and len(zeros.users) == 1):
        return None, "not into zeros"
    plumbing = [zeros, scatter]
    m = _forward_of(_back_through_plumbing(indices, plumbing))
    if m is None:
        return None, "indices not of a max-pool forward"
    grad = _back_through_plumbing(src, plumbing)
    out = scatter
    while (user := _only_user(out)) is not None and user.target in _PLUMBING and user.args[0] is out:
        plumbing.append(user)
        out = user
    m.update(grad=grad, out=out, plumbing=plumbing)
    return m, ""


def _addends(grad: Any, gv: torch.Tensor) -> Optional[tuple[fx.Node, fx.Node]]:
    """The two tensors whose sum the pool's gradient is (an ``aten.add.Tensor`` the backward alone reads, both of the
    gradient's shape, dtype and device), which the backward op then adds itself; else None. In ResNets the stem
    pool's output feeds two convs (the first block's and its shortcut's), so its gradient is such a sum: Inductor
    fuses the add into its own pool backward, and left outside the op it would be a kernel of its own."""
    if not (isinstance(grad, fx.Node) and grad.op == "call_function" and grad.target is aten.add.Tensor
            and len(grad.args) == 2 and not grad.kwargs and len(grad.users) == 1):
        return None
    for t in grad.args:
        v = t.meta.get("val") if isinstance(t, fx.Node) else None
        if not _static(v) or v.shape != gv.shape or v.dtype != gv.dtype or v.device != gv.device:
            return None
    return grad.args[0], grad.args[1]


def _check(m: dict, require_cuda: bool) -> str:
    """Why the matched pool cannot take the rewrite ('' if it can); adds what the rewrite needs to m."""
    fwd, grad, out = m["fwd"], m["grad"], m["out"]
    params = _params(fwd.args[1:]) if not fwd.kwargs else None
    if params is None:
        return "unexpected forward arguments"
    x = fwd.args[0]
    values = _item(fwd, 0)
    if _item(fwd, 1) is not m["index_item"] or len(fwd.users) != 1 + (values is not None):
        return "unexpected forward outputs"
    for node in (*m["only_backward"], *m["plumbing"][:-1]):  # read by the backward alone (its last node: the result)
        if len(node.users) != 1:
            return f"{node.name} read elsewhere"
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    gv = grad.meta.get("val") if isinstance(grad, fx.Node) else None
    ov, vv = out.meta.get("val"), values.meta.get("val") if values is not None else None
    if not all(_static(t) for t in (xv, gv, ov)) or (values is not None and not _static(vv)):
        return "dynamic shape"
    if xv.dim() != 4 or xv.dtype not in _DTYPES:
        return f"input {tuple(xv.shape)} {xv.dtype}"
    if require_cuda and xv.device.type != "cuda":
        return "not on CUDA"
    kernel, stride, padding, dilation, ceil_mode = params
    if kernel[0] * kernel[1] > MAX_WINDOW:
        return f"a window of {kernel[0] * kernel[1]} elements (at most {MAX_WINDOW})"
    pooled = [xv.shape[0], xv.shape[1], out_size(xv.shape[2], kernel[0], stride[0], padding[0], dilation[0], ceil_mode),
              out_size(xv.shape[3], kernel[1], stride[1], padding[1], dilation[1], ceil_mode)]
    if list(gv.shape) != pooled or gv.dtype != xv.dtype:
        return f"gradient {tuple(gv.shape)} {gv.dtype}"
    if list(ov.shape) != list(xv.shape) or ov.dtype != xv.dtype:
        return f"result {tuple(ov.shape)} {ov.dtype}"
    # the layouts the graph recorded must be the ones the ops make
    if vv is not None and tuple(vv.stride()) != _strides(vv.shape, suggest_memory_format(xv)):
        return "values' layout"
    layouts = [f for f in (torch.channels_last, torch.contiguous_format) if tuple(ov.stride()) == _strides(ov.shape, f)]
    if not layouts:
        return "result's layout"
    m.update(x=x, values=values, params=params, channels_last=layouts[0] is torch.channels_last,
             addends=_addends(grad, gv))
    return ""


def rewrite_max_pools(graph: fx.Graph, require_cuda: bool = True) -> tuple[int, list[str]]:
    """Put each training max pool of the graph (forward and backward) on this module's ops; return how many, and
    why each other backward was left as it was."""
    done, skipped = 0, []
    found = [(n, _aten_backward) for n in graph.nodes if n.op == "call_function" and n.target is BACKWARD]
    found += [(n, _scatter_backward) for n in graph.nodes if n.op == "call_function" and n.target is SCATTER_ADD]
    for node, match in found:
        m, why = match(node)
        if m is not None:
            why = _check(m, require_cuda)
        if why:
            if match is _aten_backward or m is not None:  # a scatter_add of another kind is no pool's business
                skipped.append(f"{node.name}: {why}")
            continue
        _rewrite(graph, m)
        done += 1
    for why in skipped:
        log.info("max pool left to Inductor: %s", why)
    return done, skipped


def _rewrite(graph: fx.Graph, m: dict) -> None:
    kernel, stride, padding, dilation, ceil_mode = m["params"]
    fwd, x, values, out = m["fwd"], m["x"], m["values"], m["out"]
    xv = x.meta["val"]
    with graph.inserting_before(fwd):
        call = graph.call_function(FWD, (x, kernel, stride, padding, dilation, ceil_mode))
        vals_meta, offsets_meta = _fwd_outputs(xv, kernel, stride, padding, dilation, ceil_mode)  # fake, as xv is
        call.meta["val"] = (vals_meta, offsets_meta)
        new_values = graph.call_function(operator.getitem, (call, 0))
        new_values.meta["val"] = vals_meta
        offsets = graph.call_function(operator.getitem, (call, 1))
        offsets.meta["val"] = offsets_meta
    if values is not None:
        new_values.meta.update({k: v for k, v in values.meta.items() if k != "val"})
        values.replace_all_uses_with(new_values)
    grads = m["addends"] or (m["grad"],)
    with graph.inserting_before(out):
        new = graph.call_function(BWD, (grads[0], offsets, list(xv.shape), kernel, stride, padding, dilation,
                                        ceil_mode, m["channels_last"], *grads[1:]))
    new.meta.update(out.meta)
    out.replace_all_uses_with(new)
    # the old pool (and the add it took): every node of it that nothing reads any more, until none is left
    old = (*m["plumbing"], *m["only_backward"], values, fwd, m["grad"] if m["addends"] else None)
    dead = list(dict.fromkeys(n for n in old if n is not None))
    while erased := [n for n in dead if not n.users]:
        for node in erased:
            graph.erase_node(node)
            dead.remove(node)
