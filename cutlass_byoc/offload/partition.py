"""The partitioner: replaces each match of the pattern table in an aten-level FX graph with a call into the
cutlass_byoc custom ops and leaves everything else to PyTorch, recording every decision in an OffloadReport.

It works on any functional aten graph carrying FakeTensor metadata (``node.meta['val']``): AOTAutograd's joint,
forward and backward graphs (as the torch.compile backend sees them), make_fx traces and torch.export programs.

Steps of :func:`partition`:

1. fprop: for each pattern of :func:`patterns.fprop_patterns`, largest first, torch.fx's ``SubgraphMatcher`` finds
   the self-contained matches (no intermediate value used outside); the predicates decide; an accepted match becomes
   one ``cutlass_byoc::conv2d_fprop`` (or, for a transposed conv, ``::conv2d_dgrad`` plus the bias add), a rejected one
   gives way to smaller patterns on the same convolution.
2. backward: each ``aten.convolution_backward`` is split by its output mask into ``::conv2d_dgrad`` and
   ``::conv2d_wgrad`` (fusing a trailing cast of grad_weight to fp32), grad_bias becomes an fp32-accumulated sum of
   grad_output that Inductor fuses, and whatever cannot be offloaded stays in a convolution_backward with a reduced
   mask.
3. layout: the new ops return channels_last; the metadata of everything downstream is re-derived (fake execution), so
   an NCHW model's activations become channels_last from the first conv on. Only then are operands that are still
   not channels_last given one ``aten.clone(memory_format=channels_last)`` right after their producer (shared by all
   uses: the network input and NCHW weights), and graph outputs whose layout changed get their original layout back,
   so the values returned to PyTorch (user outputs and parameter gradients) keep eager's strides.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
from torch.fx.passes.utils.matcher_utils import InternalMatch
from torch.utils import _pytree as pytree

from ..types import Activation, ConvKind, DType, SourceKind
from . import library
from .batching import batch_counters, batch_param_casts
from .patterns import (
    CONV,
    CONV_BACKWARD,
    ConvPattern,
    OffloadOptions,
    PatternMatcher,
    PreferPyTorch,
    Reject,
    backward_pattern,
    check_dtypes,
    check_tensor,
    conv_params,
    exact_cast,
    fprop_patterns,
    kernel_for,
    make_problem,
    batch_shape,
    batch_shapes,
    pair,
    same_size,
    static_shape,
    val,
    wgrad_cast_patterns,
)
from .patterns import Epilogue
from .pooling import rewrite_max_pools
from .statistics import rewrite_batch_statistics
from .report import DYNAMIC_BATCH, DYNAMIC_SHAPE, OffloadEntry, OffloadReport, Pass

log = logging.getLogger("cutlass_byoc.offload")

aten = torch.ops.aten
prims = torch.ops.prims
CL = torch.channels_last
NEW_OPS = (library.FPROP, library.DGRAD, library.WGRAD, library.FPROP_STATS, library.WGRAD_ASYNC)
#: ops whose result depends on their input's strides, not only its values: never given a changed layout
STRIDE_SENSITIVE = {aten.as_strided.default, aten.as_strided_scatter.default, aten._reshape_alias.default,
                    aten.as_strided_copy.default, prims.as_strided.default,
                    # the padding modes' backward: on the CPU their output follows `input`'s memory format while
                    # their meta kernels say contiguous (torch 2.13), so Inductor's stride check of a channels_last
                    # input's result fails at run time (a replicate-padded conv after an offloaded one, NCHW model)
                    aten.reflection_pad1d_backward.default, aten.reflection_pad2d_backward.default,
                    aten.reflection_pad3d_backward.default, aten.replication_pad1d_backward.default,
                    aten.replication_pad2d_backward.default, aten.replication_pad3d_backward.default}
#: node.meta key marking the layout nodes the partitioner inserts ("channels_last" or "restride")
META_KEY = "cutlass_byoc_layout"
#: the tensor arguments of each new op that must be channels_last (positions in its args)
CL_ARGS = {library.FPROP: (0, 1, 3), library.DGRAD: (0, 1), library.WGRAD: (0, 1), library.FPROP_STATS: (0, 1),
           library.WGRAD_ASYNC: (0, 1)}
#: node.meta key of an inserted fprop op: the aten.convolution node it replaced (its report entry's node)
CONV_KEY = "cutlass_byoc_conv"


class _Rewriter:
    """State of one partitioning run over one graph."""

    def __init__(self, graph: fx.Graph, options: OffloadOptions, report: OffloadReport) -> None:
        self.graph = graph
        self.options = options
        self.report = report
        self.fake_mode = self._detect_fake_mode()
        self.new_nodes: list[fx.Node] = []
        self.cl_cache: dict[fx.Node, fx.Node] = {}
        self.rejections: dict[fx.Node, list[tuple[ConvPattern, Reject]]] = {}
        self.changed: set[fx.Node] = set()  # new nodes whose layout differs from the value they replaced
        self.orig_val: dict[fx.Node, Any] = {}  # traced metadata of values whose layout changed
        self.restore_cache: dict[fx.Node, fx.Node] = {}
        self.orig_outputs = [a.meta.get("val") if isinstance(a, fx.Node) else None
                             for a in pytree.tree_leaves(self.output_node.args)]

    # ------------------------------------------------------------------ fake execution
    def _detect_fake_mode(self):
        from torch._guards import detect_fake_mode  # noqa: PLC0415
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

        vals = [n.meta.get("val") for n in self.graph.nodes]
        mode = detect_fake_mode([v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
        return mode or FakeTensorMode(allow_non_fake_inputs=True)

    def _fake(self, v):
        from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415

        if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
            return self.fake_mode.from_tensor(v)
        return v

    def run_fake(self, node: fx.Node):
        """node's value computed on its inputs' metadata (the fake implementation of custom ops)."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        args, kwargs = pytree.tree_map(self._fake, (args, kwargs))
        with self.fake_mode:
            return node.target(*args, **kwargs)

    def set_val(self, node: fx.Node) -> fx.Node:
        v = self.run_fake(node)
        node.meta["val"] = v
        if isinstance(v, torch.Tensor):
            from torch.fx.passes.shape_prop import _extract_tensor_metadata  # noqa: PLC0415

            node.meta["tensor_meta"] = _extract_tensor_metadata(v)
        return node

    def call(self, target, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs or {})
        return self.set_val(node)

    @property
    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    # ------------------------------------------------------------------ fprop
    def run_fprop(self) -> None:
        present = {n.target for n in self.graph.nodes if n.op == "call_function"}
        if CONV not in present or not (self.options.fprop or self.options.transposed):
            for n in self.graph.nodes:
                if n.target is CONV:
                    self._conv_entry(n, False, reason="fprop offload is off")
            return
        for pat in fprop_patterns():
            if not pat.targets <= present:
                continue
            matcher = PatternMatcher(pat.gm.graph)
            for m in matcher.match(self.graph):
                conv = m.nodes_map[pat.conv]
                if conv.graph is not self.graph or conv._erased:  # consumed by an earlier pattern
                    continue
                if any(isinstance(e, PreferPyTorch) for _, e in self.rejections.get(conv, [])):
                    continue  # cuDNN measured faster for this conv's largest pattern: no smaller one is tried
                if any(gn._erased for pn, gn in m.nodes_map.items()
                       if isinstance(gn, fx.Node) and pn.op != "placeholder"):
                    continue
                try:
                    self._rebind(pat, m)
                    self._rewrite_fprop(pat, m)
                except Reject as e:
                    self.rejections.setdefault(conv, []).append((pat, e))
        for n in list(self.graph.nodes):
            if n.target is CONV:
                rej = self.rejections.get(n, [])
                reason = str(rej[-1][1]) if rej else "no pattern matched"
                self._conv_entry(n, False, reason=reason)

    def _conv_entry(self, conv: fx.Node, offloaded: bool, **kw) -> OffloadEntry:
        transposed = len(conv.args) > 6 and conv.args[6] is True
        entry = OffloadEntry(node=conv.name, kind=Pass.TRANSPOSED_FPROP if transposed else Pass.FPROP,
                             offloaded=offloaded, **kw)
        for pat, why in self.rejections.get(conv, []):
            if offloaded and pat.size > 1:
                entry.notes.append(f"not fused {'+'.join(pat.steps)}: {why}")
        return self.report.add(entry)

    def _rebind(self, pat: ConvPattern, m: InternalMatch) -> None:
        """Bind the match's placeholders to the values its operations use *now*.

        The matcher finds every match of a pattern before any is rewritten, so a placeholder can still name a node
        an earlier rewrite replaced and erased (``conv -> relu -> conv -> relu``: the second conv's input was the
        first relu, now the first fused op). The operations' own arguments were rerouted by that rewrite, so reading
        them again gives the live operands; a replacement node is always defined before the operation using it."""
        nm = m.nodes_map

        def bind(pa, ga) -> None:
            if isinstance(pa, fx.Node):
                if pa.op == "placeholder":
                    nm[pa] = ga
            elif isinstance(pa, (list, tuple)) and isinstance(ga, (list, tuple)) and len(pa) == len(ga):
                for x, y in zip(pa, ga):
                    bind(x, y)

        for pn in pat.gm.graph.nodes:
            if pn.op == "call_function":
                gn = nm[pn]
                bind(pn.args, gn.args)
                for key, pa in pn.kwargs.items():
                    if key in gn.kwargs:
                        bind(pa, gn.kwargs[key])
        stale = [f"{pn.name}->{gn.name}" for pn, gn in nm.items() if isinstance(gn, fx.Node) and gn._erased]
        if stale:
            raise Reject(f"match refers to erased nodes {stale}")

    def _rewrite_fprop(self, pat: ConvPattern, m: InternalMatch) -> None:
        nm = m.nodes_map
        opts = self.options
        conv = nm[pat.conv]
        last = nm[next(iter(pat.gm.graph.find_nodes(op="output"))).args[0]]
        bound = {k: nm[p] for k, p in pat.inputs.items()}
        x, w, b = bound["x"], bound["w"], bound["b"]
        stride, padding, dilation, groups, transposed = conv_params(bound)
        xv, wv, yv = val(x), val(w), val(conv)
        check_tensor(xv, "input", opts)
        check_tensor(wv, "weight", opts)
        check_dtypes(xv, wv, opts)
        x_shape, y_shape, dynamic = batch_shapes(xv, yv, "input", "output", opts)
        w_shape = static_shape(wv, "weight")
        if b is not None:
            bv = val(b)
            if bv.dim() != 1:
                raise Reject(f"bias: expected 1-d, got shape {tuple(bv.shape)}")
        if transposed:
            if dynamic:
                raise Reject(f"{DYNAMIC_SHAPE}: transposed convs are offloaded at static shapes only (input "
                             f"{tuple(xv.shape)})")
            self._rewrite_transposed(pat, conv, x, w, b, stride, padding, dilation, groups, bound, x_shape, w_shape,
                                     y_shape)
            return
        if not opts.fprop:
            raise Reject("fprop offload is off")
        if any(pair(bound["output_padding"], "output_padding")):
            raise Reject(f"output_padding: {bound['output_padding']} on a non-transposed conv")
        if pat.size > 1 and not opts.fuse_epilogue and pat.steps != ("cast",):
            raise Reject("epilogue fusion is off")
        out_v = val(last)
        out_dtype = out_v.dtype
        fused: list[str] = []
        k = w_shape[0]
        bias_nodes: list[fx.Node] = [b] if b is not None else []
        if b is not None:
            fused.append("bias")
        residual = None
        if pat.add is not None:
            other = nm[pat.other]
            ov = val(other)
            oshape, o_dyn = batch_shape(ov, "add operand", opts)
            if (o_dyn or dynamic) and len(oshape) == 4 and not same_size(ov.shape[0], yv.shape[0]):
                raise Reject(f"{DYNAMIC_SHAPE}: add operand's batch {ov.shape[0]} is not the output's {yv.shape[0]}")
            if oshape == y_shape:
                residual = other
                fused.append("residual")
            elif oshape in ((k, 1, 1), (1, k, 1, 1)) and ov.dtype in (torch.float16, torch.bfloat16, torch.float32):
                bias_nodes.append(other)
                if "bias" not in fused:
                    fused.append("bias")
            else:
                raise Reject(f"add: operand of shape {oshape} is neither a per-channel bias of {k} channels nor a "
                             f"residual of shape {y_shape}")
        if pat.activation is not Activation.IDENTITY:
            fused.append(pat.activation.value)
        if pat.cast is not None:
            if not opts.fuse_casts:
                raise Reject("cast fusion is off")
            dt = nm[pat.cast_dtype]
            if not isinstance(dt, torch.dtype) or dt not in (torch.float16, torch.bfloat16, torch.float32):
                raise Reject(f"cast: to {dt!r}; kernels store float16, bfloat16 or float32")
            fused.append(f"cast({str(dt).replace('torch.', '')})")
        if residual is not None and not exact_cast(val(residual).dtype, out_dtype):
            # the kernels read the residual as C, in the output's type
            raise Reject(f"dtype: epilogue source {residual.name} is {val(residual).dtype}; storing {out_dtype} would "
                         f"round it before the add")
        # The bias keeps the output's type where that is exact (one bias of that type, or an fp32 output); otherwise
        # (an fp32 bias under a 16-bit output, two biases summed) it is an fp32 vector, added unrounded in fp32.
        bias_dtype = None
        if bias_nodes:
            one = len(bias_nodes) == 1 and val(bias_nodes[0]).dtype == out_dtype
            bias_dtype = out_dtype if one or out_dtype == torch.float32 else torch.float32
        source = (SourceKind.BIAS_RESIDUAL if residual is not None and bias_nodes else SourceKind.RESIDUAL
                  if residual is not None else SourceKind.BIAS if bias_nodes else SourceKind.NONE)
        epilogue = Epilogue(pat.activation, source, DType.from_torch(bias_dtype) if bias_dtype is not None else None)
        problem = make_problem(ConvKind.FPROP, x_shape, w_shape, stride, padding, dilation, groups, xv.dtype,
                               out_dtype, epilogue)
        launch = kernel_for(problem, opts)
        # accepted: build the replacement before `last` (every operand is defined before it)
        with self.graph.inserting_before(last):
            bias_arg = None
            if bias_nodes:
                flat = [self._cast(self.call(aten.view.default, (bn, [k])) if val(bn).dim() != 1 else bn, bias_dtype)
                        for bn in bias_nodes]
                bias_arg = flat[0]
                for extra in flat[1:]:
                    bias_arg = self.call(aten.add.Tensor, (bias_arg, extra))
            res_arg = self._cast(residual, out_dtype) if residual is not None else None
            # bias and residual both go to the kernel (one epilogue: act(conv + bias + residual), no extra pass)
            site = library.register_site("fprop", problem, opts.select.value,
                                         y_shape if res_arg is not None else (k,) if bias_arg is not None else None,
                                         dynamic=dynamic)
            new = self.call(library.FPROP, (x, w, bias_arg, res_arg, site))
        new.meta[CONV_KEY] = conv.name
        self._replace(pat.gm.graph, nm, last, new)
        entry = self._conv_entry(conv, True, problem=problem.name, kernel=self._kernel_name(problem, launch),
                                 pattern=pat.name, fused=tuple(fused))
        if dynamic:
            entry.notes.append(_dynamic_note(problem.n))
        entry.node = conv.name

    def _rewrite_transposed(self, pat, conv, x, w, b, stride, padding, dilation, groups, bound, x_shape, w_shape,
                            y_shape) -> None:
        opts = self.options
        if not opts.transposed:
            raise Reject("transposed: offload of transposed convs is off")
        if pat.size > 1:
            raise Reject("transposed: runs as dgrad, whose epilogue takes no bias, activation, residual or cast")
        # conv_transpose2d(x, w) with w (Cin, Cout/g, R, S) is the dgrad of a conv from y-shaped inputs to x
        problem = make_problem(ConvKind.DGRAD, y_shape, w_shape, stride, padding, dilation, groups, val(x).dtype,
                               val(conv).dtype)
        if (problem.n, problem.k, problem.p, problem.q) != tuple(x_shape):
            raise Reject(f"transposed: output_padding {bound['output_padding']} gives an output the dgrad of "
                         f"input {x_shape} does not produce")
        launch = kernel_for(problem, opts)
        with self.graph.inserting_before(conv):
            new = self.call(library.DGRAD, (x, w, library.register_site("dgrad", problem, opts.select.value)))
            if b is not None:
                bias4 = self.call(aten.view.default, (b, [1, y_shape[1], 1, 1]))
                new2 = self.call(aten.add.Tensor, (new, bias4))
            else:
                new2 = new
        self.new_nodes.append(new)
        self._substitute(conv, new2)
        self.graph.erase_node(conv)
        self._conv_entry(conv, True, problem=problem.name, kernel=self._kernel_name(problem, launch), pattern=pat.name,
                         fused=(), notes=["bias added by PyTorch"] if b is not None else [])

    def _cast(self, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        if val(node).dtype == dtype:
            return node
        return self.call(prims.convert_element_type.default, (node, dtype))

    def _substitute(self, old: fx.Node, new: fx.Node) -> None:
        """Route old's uses to new (a new op's output, or a value computed from one)."""
        if _layout_differs(old.meta.get("val"), new.meta.get("val")):
            self.changed.add(new)
            self.orig_val[new] = old.meta.get("val")
        old.replace_all_uses_with(new)

    def _replace(self, pattern_graph: fx.Graph, nm: dict, last: fx.Node, new: fx.Node) -> None:
        self._substitute(last, new)
        self.new_nodes.append(new)
        for pn in reversed(list(pattern_graph.nodes)):
            if pn.op in ("placeholder", "output"):
                continue
            gn = nm[pn]
            if not gn._erased:
                self.graph.erase_node(gn)

    # ------------------------------------------------------------------ batch-norm statistics
    def fuse_bn_stats(self) -> None:
        """OffloadOptions.fuse_bn_stats: each offloaded conv whose output a training batch norm reduces (Inductor's
        decomposition: var_mean(y.float(), [0, 2, 3], correction=0, keepdim=True)) becomes one kernel storing y and
        its per-channel sums and sums of squares; the var_mean becomes mean = sum / count and var = sum of squares /
        count - mean**2 (clamped at 0: fp32 sums of the stored y, as the batch norm reads it)."""
        if not self.options.fuse_bn_stats:
            return
        if torch.are_deterministic_algorithms_enabled():  # the kernels add their sums atomically
            log.info("cutlass_byoc: batch-norm statistics not fused: deterministic algorithms are required")
            return
        for node in [n for n in self.new_nodes if n.target is library.FPROP and not n._erased]:
            found = _bn_statistics(node)
            if found is None:
                continue
            entry = next(iter(self.report.by_node(node.meta.get(CONV_KEY, ""))), None)
            twin, why = self._stats_twin(node)
            if twin is None:
                if entry is not None:
                    entry.notes.append(f"batch-norm statistics not fused: {why}")
                continue
            self._fuse_stats(node, *found, entry, twin)

    def _stats_twin(self, node: fx.Node):
        """(the channel-statistics launch for this fprop op, None) or (None, why not)."""
        x, w, bias, residual, index = node.args
        if bias is not None or residual is not None:
            return None, "the conv's epilogue has a bias or residual"
        site = library.site(index)
        p = site.problem
        if site.dynamic:
            return None, "symbolic batch size"
        if p.epilogue != Epilogue() or p.element_out not in (DType.F16, DType.BF16):
            return None, f"epilogue {p.epilogue.tag} to {p.element_out.value} (plain, 16-bit only)"
        twin = library.stats_launch(p, self.options.select.value)
        if twin is None:
            return None, "the conv's launch has no channel-statistics twin (sm90 conv fprop kernels only)"
        return twin, None

    def _fuse_stats(self, node: fx.Node, cast: fx.Node, var_mean: fx.Node, entry: Optional[OffloadEntry],
                    twin) -> None:
        x, w, _, _, index = node.args
        p = library.site(index).problem
        stats_index = library.register_stats_site(p, self.options.select.value)
        with self.graph.inserting_before(node):
            call = self.call(library.FPROP_STATS, (x, w, stats_index))
            y = self.call(operator.getitem, (call, 0))
            stats = self.call(operator.getitem, (call, 1))
        y.meta[CONV_KEY] = node.meta.get(CONV_KEY)
        node.replace_all_uses_with(y)
        if node in self.changed:  # the layout bookkeeping follows the value
            self.changed.discard(node)
            self.changed.add(y)
            self.orig_val[y] = self.orig_val.pop(node, None)
        self.new_nodes[self.new_nodes.index(node)] = call
        self.graph.erase_node(node)
        count = float(p.n * p.p * p.q)
        shape = [1, p.k, 1, 1]
        with self.graph.inserting_before(var_mean):
            mean = self.call(aten.div.Tensor, (self.call(aten.select.int, (stats, 0, 0)), count))
            ex2 = self.call(aten.div.Tensor, (self.call(aten.select.int, (stats, 0, 1)), count))
            var = self.call(aten.sub.Tensor, (ex2, self.call(aten.mul.Tensor, (mean, mean))))
            var = self.call(aten.clamp_min.default, (var, 0.0))
            out = {0: self.call(aten.view.default, (var, shape)), 1: self.call(aten.view.default, (mean, shape))}
        for u in list(var_mean.users):
            u.replace_all_uses_with(out[u.args[1]])
            self.graph.erase_node(u)
        self.graph.erase_node(var_mean)
        if not cast.users:
            self.graph.erase_node(cast)
        self.report.bn_stats += 1
        if entry is not None:
            entry.fused = (*entry.fused, "bn_stats")
            entry.kernel = twin.name
        self.report.launches.append(twin)

    def _kernel_name(self, problem, launch) -> str:
        from ..select import SelectMode  # noqa: PLC0415

        self.report.launches.append(launch)
        self.report.problems.append(problem)
        if self.options.select is SelectMode.TUNE:
            return f"tuned at compile time (heuristic until then: {launch.name})"
        return launch.name

    # ------------------------------------------------------------------ backward
    def run_backward(self) -> None:
        if not any(n.target is CONV_BACKWARD for n in self.graph.nodes):
            return
        casts: dict[fx.Node, fx.Node] = {}
        for gm, cb_ph, gi_pn, cast_pn in wgrad_cast_patterns():
            for m in PatternMatcher(gm.graph).match(self.graph):
                cb = m.nodes_map[cb_ph]
                if isinstance(cb, fx.Node) and cb.target is CONV_BACKWARD:
                    casts[cb] = m.nodes_map[cast_pn]
        gm, cb_pn = backward_pattern()
        for m in PatternMatcher(gm.graph).match(self.graph):
            self._rewrite_backward(m.nodes_map[cb_pn], casts.get(m.nodes_map[cb_pn]))

    def _rewrite_backward(self, cb: fx.Node, cast: Optional[fx.Node]) -> None:
        opts = self.options
        (go, inp, w, _bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask) = cb.args
        getitems = {}
        for u in cb.users:
            if u.target is not operator.getitem or not isinstance(u.args[1], int):
                for kind in (Pass.DGRAD, Pass.WGRAD):
                    self.report.add(OffloadEntry(cb.name, kind, False, reason=f"result used by {u.name}, not unpacked"))
                return
            getitems.setdefault(u.args[1], []).append(u)
        mask = list(mask)
        try:
            (stride, padding, dilation, groups, transposed) = conv_params(
                dict(stride=stride, padding=padding, dilation=dilation, groups=groups, transposed=transposed))
            gov, xv, wv = val(go), val(inp), val(w)
            for t, what in ((gov, "grad_output"), (xv, "input"), (wv, "weight")):
                check_tensor(t, what, opts)
            check_dtypes(gov, wv, opts)
            check_dtypes(gov, xv, opts)
            x_shape, _, dynamic = batch_shapes(xv, gov, "input", "grad_output", opts)
            w_shape = static_shape(wv, "weight")
            if transposed:
                # conv_transpose2d(x, w), w (Cin, Cout/g, R, S), is the dgrad of a conv C from y-shaped inputs to
                # x-shaped outputs with weight w: its grad_input is C's fprop of grad_output, its grad_weight C's
                # wgrad with x as C's output gradient and grad_output as C's input. output_padding only makes
                # grad_output longer than C's windows reach, so C of grad_output is x-shaped again, unless
                # output_padding reaches past the stride (it may where the dilation is larger)
                if not opts.transposed:
                    raise Reject("transposed: offload of transposed convs is off")
                if dynamic:
                    raise Reject(f"{DYNAMIC_SHAPE}: transposed convs are offloaded at static shapes only (input "
                                 f"{tuple(xv.shape)})")
                y_shape = static_shape(gov, "grad_output")
                back = (y_shape[0], w_shape[0], *(library.conv_out_size(y_shape[2 + i], w_shape[2 + i], stride[i],
                                                                        padding[i], dilation[i]) for i in (0, 1)))
                if back != tuple(x_shape):
                    raise Reject(f"transposed: output_padding {tuple(output_padding)}: the conv of grad_output "
                                 f"{y_shape} gives {back}, not the input's shape {tuple(x_shape)}")
        except Reject as e:
            for i, kind in ((0, Pass.DGRAD), (1, Pass.WGRAD)):
                if mask[i] and getitems.get(i):
                    self.report.add(OffloadEntry(cb.name, kind, False, reason=str(e)))
            return
        conv = (stride, padding, dilation, groups)
        if transposed:  # (static shapes)
            done = [self._grad_input(cb, mask[0], getitems, ConvKind.FPROP, y_shape, w_shape, conv, gov.dtype,
                                     lambda site: (library.FPROP, (go, w, None, None, site)), dynamic=False,
                                     transposed=True),
                    self._grad_weight(cb, mask[1], getitems, cast, y_shape, w_shape, conv, gov.dtype, (inp, go),
                                      dynamic=False, transposed=True)]
        else:
            done = [self._grad_input(cb, mask[0], getitems, ConvKind.DGRAD, x_shape, w_shape, conv, gov.dtype,
                                     lambda site: (library.DGRAD, (go, w, site)), dynamic=dynamic),
                    self._grad_weight(cb, mask[1], getitems, cast, x_shape, w_shape, conv, gov.dtype, (go, inp),
                                      dynamic=dynamic)]
        self._finish_backward(cb, go, getitems, mask, done)

    def _grad_input(self, cb, wanted: bool, getitems, kind: ConvKind, a_shape, w_shape, conv, dtype, call, *,
                    dynamic: bool, transposed: bool = False) -> bool:
        """convolution_backward's grad_input as one `kind` problem on an input of `a_shape` (dgrad; a transposed
        conv's: the fprop of grad_output), `call(site)` giving the op and its arguments; whether it was offloaded."""
        if not (wanted and getitems.get(0)):
            return False
        try:
            if not self.options.dgrad:
                raise Reject("dgrad offload is off")
            problem = make_problem(kind, a_shape, w_shape, *conv, dtype, val(getitems[0][0]).dtype)
            launch = kernel_for(problem, self.options)
            with self.graph.inserting_before(cb):
                site = library.register_site(kind.value, problem, self.options.select.value, dynamic=dynamic)
                new = self.call(*call(site))
            self.new_nodes.append(new)
            for g in getitems[0]:
                self._substitute(g, new)
                self.graph.erase_node(g)
            notes = ([_dynamic_note(problem.n)] if dynamic else []) + \
                (["transposed conv: its grad_input is the fprop of grad_output"] if transposed else [])
            self.report.add(OffloadEntry(cb.name, Pass.DGRAD, True, problem.name, self._kernel_name(problem, launch),
                                         "convolution_backward[grad_input]" + (" (transposed)" if transposed else ""),
                                         notes=notes))
            return True
        except Reject as e:
            self.report.add(OffloadEntry(cb.name, Pass.DGRAD, False, reason=str(e)))
            return False

    def _grad_weight(self, cb, wanted: bool, getitems, cast, a_shape, w_shape, conv, dtype, operands, *,
                     dynamic: bool, transposed: bool = False) -> bool:
        """convolution_backward's grad_weight as one wgrad problem on an input of `a_shape`, the op reading
        `operands` (its grad_output and input: a transposed conv's x and grad_output), a following cast to 16 bits or
        fp32 fused; whether it was offloaded."""
        if not (wanted and getitems.get(1)):
            return False
        try:
            if not self.options.wgrad:
                raise Reject("wgrad offload is off")
            fuse_cast = None
            notes = []
            if cast is not None and len(getitems[1]) == 1 and len(getitems[1][0].users) == 1:
                dt = cast.args[1] if len(cast.args) > 1 else cast.kwargs.get("dtype")
                if not self.options.fuse_casts:
                    notes.append("cast not fused: cast fusion is off")
                elif dt in (torch.float16, torch.bfloat16, torch.float32):
                    fuse_cast = cast
            out_node = fuse_cast if fuse_cast is not None else getitems[1][0]
            out_dtype = val(out_node).dtype
            problem = make_problem(ConvKind.WGRAD, a_shape, w_shape, *conv, dtype, out_dtype)
            launch = kernel_for(problem, self.options)
            with self.graph.inserting_before(cb):
                site = library.register_site("wgrad", problem, self.options.select.value, dynamic=dynamic)
                new = self.call(library.WGRAD, (*operands, site))
            self.new_nodes.append(new)
            if fuse_cast is not None:
                self._substitute(fuse_cast, new)
                self.graph.erase_node(fuse_cast)
                self.graph.erase_node(getitems[1][0])
            else:
                for g in getitems[1]:
                    self._substitute(g, new)
                    self.graph.erase_node(g)
            fused = (f"cast({str(out_dtype).replace('torch.', '')})",) if fuse_cast is not None else ()
            if dynamic:
                notes.append(_dynamic_note(problem.n))
            if transposed:
                notes.append("transposed conv: its grad_weight is the wgrad of the conv from grad_output to the input")
            self.report.add(OffloadEntry(cb.name, Pass.WGRAD, True, problem.name, self._kernel_name(problem, launch),
                                         "convolution_backward[grad_weight]" + (" (transposed)" if transposed else ""),
                                         fused, notes=notes))
            return True
        except Reject as e:
            self.report.add(OffloadEntry(cb.name, Pass.WGRAD, False, reason=str(e)))
            return False

    def _finish_backward(self, cb, go, getitems, mask, done) -> None:
        """After a convolution_backward's offloaded results: its grad_bias as a reduction of grad_output, and the
        node itself computing only what was not offloaded (or gone)."""
        if not any(done):
            return
        # grad_bias: an fp32-accumulated reduction of grad_output, left to PyTorch / Inductor
        if mask[2] and getitems.get(2):
            with self.graph.inserting_before(cb):
                s = self.call(aten.sum.dim_IntList, (go, [0, 2, 3]), {"dtype": torch.float32})
                gb = self.call(prims.convert_element_type.default, (s, val(getitems[2][0]).dtype))
            for g in getitems[2]:
                g.replace_all_uses_with(gb)
                self.graph.erase_node(g)
        rest = [mask[0] and not done[0] and bool(getitems.get(0)), mask[1] and not done[1] and bool(getitems.get(1)),
                False]
        for u in list(cb.users):  # unpacked but unused results (make_fx keeps them)
            if not u.users:
                self.graph.erase_node(u)
        if any(rest):
            cb.update_arg(10, rest)
            self.set_val(cb)
        elif not cb.users:
            self.graph.erase_node(cb)

    # ------------------------------------------------------------------ wgrad on a side stream
    def overlap_wgrad(self) -> None:
        """Turn the offloaded wgrads whose result only leaves the graph into one chain of wgrad_site_async calls
        (OffloadOptions.overlap_wgrad = n): call i launches on the side stream and joins call i - n; the last call
        joins the rest and runs in line. Each call's `after` holds what it joins (that call's grad_output, input and
        output) and the previous call's output: the graph then orders the calls, and keeps the joined calls'
        tensors alive and unreused, until the join. Runs after fix_layouts: the operands are final."""
        n = self.options.overlap_wgrad
        if n <= 0:
            return
        chain = [v for v in self.graph.nodes
                 if v.target is library.WGRAD and v.users and all(u.op == "output" for u in v.users)]
        if len(chain) < 2:
            return
        made: list[fx.Node] = []
        for i, old in enumerate(chain):
            last = i == len(chain) - 1
            joined = range(max(0, i - n), i) if last else ([i - n] if i >= n else [])
            after: list[fx.Node] = []
            for j in joined:
                after += [made[j].args[0], made[j].args[1], made[j]]
            if made and made[-1] not in after:
                after.append(made[-1])
            go, inp, site = old.args
            with self.graph.inserting_before(old):
                new = self.call(library.WGRAD_ASYNC, (go, inp, site, 0 if last else n, after))
            old.replace_all_uses_with(new)
            self.graph.erase_node(old)
            self.new_nodes[self.new_nodes.index(old)] = new
            made.append(new)
        self.report.overlapped_wgrads += len(chain) - 1

    # ------------------------------------------------------------------ layout
    def fix_layouts(self) -> None:
        """Re-derive metadata downstream of the new ops, then make their operands channels_last and restore the
        layout of graph outputs that changed."""
        self._refresh_downstream()
        for node in self.new_nodes:
            if node._erased:
                continue
            for i in CL_ARGS[node.target]:
                a = node.args[i]
                if isinstance(a, fx.Node):
                    v = a.meta.get("val")
                    if isinstance(v, torch.Tensor) and v.dim() == 4 and not v.is_contiguous(memory_format=CL):
                        node.update_arg(i, self._channels_last(a))
        out = self.output_node
        leaves, spec = pytree.tree_flatten(out.args)
        if len(leaves) != len(self.orig_outputs):
            return
        restored = False
        for i, (n, orig) in enumerate(zip(leaves, self.orig_outputs)):
            v = n.meta.get("val") if isinstance(n, fx.Node) else None
            if not isinstance(v, torch.Tensor) or not isinstance(orig, torch.Tensor) or v.dim() != 4:
                continue
            if tuple(v.stride()) == tuple(orig.stride()) or tuple(v.shape) != tuple(orig.shape):
                continue
            if orig.is_contiguous():
                fmt = None if v.is_contiguous() else torch.contiguous_format
            elif orig.is_contiguous(memory_format=CL):
                fmt = None if v.is_contiguous(memory_format=CL) else CL
            else:
                fmt = None  # an unusual layout: the values are right, only insignificant strides may differ
            if fmt is None:
                continue
            with self.graph.inserting_before(out):
                leaves[i] = self.call(aten.clone.default, (n,), {"memory_format": fmt})
            leaves[i].meta[META_KEY] = "restride"
            restored = True
            self.report.output_restrides += 1
        if restored:
            out.args = pytree.tree_unflatten(leaves, spec)

    def _channels_last(self, node: fx.Node) -> fx.Node:
        if node in self.cl_cache:
            return self.cl_cache[node]
        if node.op == "placeholder":
            anchor = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        else:
            anchor = node
        with self.graph.inserting_after(anchor):
            c = self.call(aten.clone.default, (node,), {"memory_format": CL})
        c.meta[META_KEY] = "channels_last"
        self.cl_cache[node] = c
        self.report.layout_conversions += 1
        return c

    def _refresh_downstream(self) -> None:
        """Re-derive the metadata of everything downstream of a layout change. An op that cannot take the new
        layout (a view that needs the traced strides, as_strided, anything that fails on the new metadata) gets
        its inputs back in the layout the graph was traced with, so no value is ever computed on strides the
        graph did not expect."""
        dirty = {n for n in self.changed if not n._erased}
        if not dirty:
            return
        for n in list(self.graph.nodes):
            if n.op != "call_function" or n in dirty or n.target in NEW_OPS:
                continue
            if not any(a in dirty for a in n.all_input_nodes):
                continue
            old = n.meta.get("val")
            new = _FAILED  # not None: an op's value may be None (an unused result of convolution_backward)
            if n.target not in STRIDE_SENSITIVE:
                try:
                    new = self.run_fake(n)
                except Exception as e:  # noqa: BLE001 - any failure: give the op its traced layouts back
                    log.debug("%s cannot take the new layout (%s); restoring its inputs' layout", n.name, e)
            if new is _FAILED:
                for a in n.all_input_nodes:
                    if a in dirty and _layout_differs(self.orig_val.get(a), a.meta.get("val")):
                        n.replace_input_with(a, self._restore(a, n))
                continue
            if _layout_differs(old, new):
                self.orig_val.setdefault(n, old)
                n.meta["val"] = new
                if isinstance(new, torch.Tensor) and "tensor_meta" in n.meta:
                    from torch.fx.passes.shape_prop import _extract_tensor_metadata  # noqa: PLC0415

                    n.meta["tensor_meta"] = _extract_tensor_metadata(new)
                dirty.add(n)


    def _restore(self, node: fx.Node, before: fx.Node) -> fx.Node:
        """node's value in the layout the graph was traced with (a copy, shared by later users)."""
        if node in self.restore_cache:
            return self.restore_cache[node]
        orig = self.orig_val[node]
        with self.graph.inserting_before(before):
            if orig.is_contiguous():
                r = self.call(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
            elif orig.is_contiguous(memory_format=CL):
                r = self.call(aten.clone.default, (node,), {"memory_format": CL})
            else:
                empty = self.call(aten.empty_strided.default, (list(orig.shape), list(orig.stride())),
                                  {"dtype": orig.dtype, "device": orig.device})
                r = self.call(aten.copy.default, (empty, node))
        r.meta[META_KEY] = "restride"
        self.restore_cache[node] = r
        self.report.layout_restores += 1
        return r


_FAILED = object()


def _bn_statistics(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    """(cast, var_mean) where a training batch norm reduces `node`'s output as Inductor's decomposition does:
    var_mean(convert_element_type(y, float32), [0, 2, 3], correction=0, keepdim=True), its results read through
    getitem only; else None."""
    for cast in node.users:
        if cast.target is not prims.convert_element_type.default or cast.args[1] is not torch.float32:
            continue
        for vm in cast.users:
            if vm.target is not aten.var_mean.correction or vm.args[0] is not cast:
                continue
            dims = vm.args[1] if len(vm.args) > 1 else vm.kwargs.get("dim")
            if (list(dims or ()) == [0, 2, 3] and vm.kwargs.get("correction") == 0 and vm.kwargs.get("keepdim")
                    and len(vm.args) <= 2 and all(u.target is operator.getitem and u.args[1] in (0, 1)
                                                  for u in vm.users)):
                return cast, vm
    return None


def _dynamic_note(n: int) -> str:
    """The report's note on a call whose batch size is symbolic."""
    return (f"{DYNAMIC_BATCH}: planned at N={n}, each batch size met at run time bound to a launch at its first call")


def _layout_differs(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(la) != len(lb):
        return True
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return True
        if isinstance(x, torch.Tensor) and (tuple(x.shape) != tuple(y.shape) or tuple(x.stride()) != tuple(y.stride())
                                            or x.dtype != y.dtype):
            return True
    return False


def partition(graph: fx.Graph | fx.GraphModule, options: OffloadOptions | dict | None = None,
              name: str = "graph") -> OffloadReport:
    """Offload every convolution of `graph` that CUTLASS can take, in place; return the report.

    Never breaks the graph: if partitioning raises, or leaves a graph that fails ``lint`` (a node used before it is
    defined, ...), the graph is put back exactly as it came, the reason is logged as a warning and recorded in
    ``report.failure``, and the caller compiles it as it would have without this backend. ``strict=True`` re-raises
    instead (tests)."""
    options = OffloadOptions.from_any(options)
    from ..gemm1x1 import forced_determinism  # noqa: PLC0415

    with forced_determinism(options.deterministic):  # the selections, the tune and the prebuild below
        return _partition(graph, options, name)


def _partition(graph: fx.Graph | fx.GraphModule, options: OffloadOptions, name: str) -> OffloadReport:
    gm = graph if isinstance(graph, fx.GraphModule) else graph.owning_module
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    from ..select import SelectMode  # noqa: PLC0415

    if options.select is SelectMode.TUNE and options.prefer_cudnn and options.prebuild and _can_tune():
        _tune_first(g, options, name)
    report = OffloadReport(name)
    backup = _snapshot(g)
    try:
        rw = _Rewriter(g, options, report)
        rw.run_fprop()
        rw.run_backward()
        rw.fuse_bn_stats()
        _note_host_credit(report, options)
        _note_untuned(report, options)
        changed = bool(rw.new_nodes)
        if changed:
            rw.fix_layouts()
            rw.overlap_wgrad()
            if options.batch_params:
                report.batched_casts = batch_param_casts(g, options.require_cuda)
                report.batched_counters = batch_counters(g, options.require_cuda)
        if options.max_pool:
            report.max_pools, report.max_pools_left = rewrite_max_pools(g, options.require_cuda)
            changed = changed or bool(report.max_pools)
        if options.bn_sums:
            report.bn_sums, report.bn_sums_left = rewrite_batch_statistics(g, options.require_cuda)
            changed = changed or bool(report.bn_sums)
        if changed:
            g.lint()
    except Exception as e:  # noqa: BLE001 - any failure of ours must leave the user's graph as it was
        if options.strict:
            raise
        _restore(g, backup)
        report.fail(f"partitioning raised {type(e).__name__}: {e}")
        changed = False
    if changed and gm is not None:
        gm.recompile()
    log.info("%s", report.summary())
    if changed and options.prebuild:
        prebuild(report, options)
    return report


def _note_host_credit(report: OffloadReport, options: OffloadOptions) -> None:
    """Note on each offloaded entry whose decision measured cuDNN faster, within the host credit, both times."""
    from ..select import SelectMode, host_credit_note  # noqa: PLC0415

    if not options.prefer_cudnn or options.compile_time_select is not SelectMode.CACHED:
        return
    credit = options.cudnn_credit_us()
    if credit <= 0:
        return
    problems = {p.name: p for p in report.problems}
    for e in report.entries:
        problem = problems.get(e.problem) if e.offloaded else None
        note = host_credit_note(problem, credit) if problem is not None else None
        if note:
            e.notes.append(note)


_warned_elsewhere: set = set()


def _note_untuned(report: OffloadReport, options: OffloadOptions) -> None:
    """select="cached" on a GPU: count the offloaded problems without a decision for it (they run the model's launch),
    and name the decisions the cache holds for them from elsewhere (another GPU, CUTLASS version or template set:
    a cache copied from another machine, or from before an upgrade), with a warning once per process and cause."""
    from ..decisions import current_gpu, decisions_elsewhere, lookup  # noqa: PLC0415
    from ..select import SelectMode  # noqa: PLC0415

    gpu = current_gpu()
    if options.select is not SelectMode.CACHED or gpu is None or not report.problems:
        return  # heuristic: untuned by request; tune: tuned at prebuild
    try:
        offloaded = {e.problem for e in report.offloaded}
        untuned = [p for p in dict.fromkeys(report.problems)
                   if p.name in offloaded and lookup(p, gpu=gpu) is None]
        report.untuned = len(untuned)
        if not untuned:
            return
        report.tuned_elsewhere = decisions_elsewhere(untuned, gpu=gpu)
    except Exception as e:  # noqa: BLE001 - a note of the report; it must not fail the partition
        log.debug("cutlass_byoc: could not look for decisions made elsewhere: %s", e)
        return
    for why, problems in report.tuned_elsewhere.items():
        if why not in _warned_elsewhere:
            _warned_elsewhere.add(why)
            log.warning("cutlass_byoc: %s: %d offloaded problems have no decision for %s; the cache holds decisions "
                        "for %d of them %s, which are not used here: they run the model's launch until tuned on "
                        "this GPU (`cutlass-byoc tune --model ...`, or select=\"tune\")", report.graph, len(untuned),
                        gpu.tag, len(problems), why)


def _can_tune() -> bool:
    return torch.cuda.is_available()


def _tune_first(g: fx.Graph, options: OffloadOptions, name: str) -> None:
    """select="tune" with prefer_cudnn: partition a copy of the graph to find its problems, tune the new ones (cuDNN
    timed alongside, tune_report), so that the real partition below already knows where cuDNN is faster and leaves
    those convs to PyTorch in this very compile. Any failure here only loses that: the real partition then runs as
    without it (and the ops tune at prebuild, as before)."""
    try:
        copy = _snapshot(g)
        probe = OffloadReport(f"{name}(problems to tune)")
        rw = _Rewriter(copy, dataclasses.replace(options, strict=False, prebuild=False), probe)
        rw.run_fprop()
        rw.run_backward()
        if probe.problems:
            tune_report(probe)
    except Exception as e:  # noqa: BLE001 - tuning first is an optimisation of the offload decisions
        log.warning("cutlass_byoc: could not tune %s before partitioning it: %s", name, e)


def _snapshot(g: fx.Graph) -> fx.Graph:
    """A copy of g's nodes (metadata dicts copied, their values shared) to put back if partitioning fails."""
    copy, env = fx.Graph(), {}
    for n in g.nodes:
        env[n] = copy.node_copy(n, lambda a: env[a])
    return copy


def _restore(g: fx.Graph, backup: fx.Graph) -> None:
    """Make g hold backup's nodes again, keeping g's own placeholders (the graph's signature)."""
    phs = [n for n in g.nodes if n.op == "placeholder"]
    bphs = [n for n in backup.nodes if n.op == "placeholder"]
    if len(phs) != len(bphs):
        raise RuntimeError(f"cannot restore the graph: {len(phs)} placeholders now, {len(bphs)} before")
    for n in list(g.nodes):  # drop every edge first: a misordered graph cannot be erased in reverse order
        if n.op != "placeholder":
            n.args, n.kwargs = (), {}
    for n in reversed(list(g.nodes)):
        if n.op != "placeholder":
            g.erase_node(n)
    env = dict(zip(bphs, phs))
    for n in backup.nodes:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
    g.lint()


def prebuild(report: OffloadReport, options: OffloadOptions) -> None:
    """Compile the kernels the report's ops will launch, in parallel, now rather than one by one at their first
    call; with ``select="tune"``, tune every new problem of the graph in one batch (one parallel build of all
    candidates, then timing, with a progress bar) and show the winners in the report. Only where the kernels can run
    (CUDA); failures are logged (the op then falls back to PyTorch at run time, with the reason recorded)."""
    from ..select import SelectMode  # noqa: PLC0415

    if not report.launches or not torch.cuda.is_available():
        return
    if options.select is SelectMode.TUNE:
        tune_report(report)
        return
    try:
        from ..build import build  # noqa: PLC0415

        results = build(dict.fromkeys(launch.kernel for launch in report.launches))
        failed = [r for r in results.values() if not r.ok]
        log.info("cutlass_byoc: %d kernels ready for %s (%d failed to compile)", len(results) - len(failed),
                 report.graph, len(failed))
    except Exception as e:  # noqa: BLE001 - building is an optimisation; the first call builds or falls back
        log.warning("cutlass_byoc: could not prebuild the kernels of %s: %s", report.graph, e)


def tune_report(report: OffloadReport) -> None:
    """Tune the report's problems that have no decision yet, all at once, and name the winners in its entries.

    Several processes compiling the same graphs (the ranks of a DDP job) tune each problem once: the first to claim
    a problem tunes it on its own GPU and the others wait for its decision (profiler/coordinate.py: per-problem file
    locks in the cache, a deadline, and the model's launch for what ends without a decision)."""
    from ..decisions import lookup  # noqa: PLC0415
    from ..profiler.coordinate import coordinated_tune, decided_here, worker_settings  # noqa: PLC0415
    from ..profiler.tune import tune_workload  # noqa: PLC0415

    problems = list(dict.fromkeys(report.problems))
    settings = worker_settings()  # this rank's GPU, not always GPU 0
    try:
        co = coordinated_tune(problems, lambda ps: tune_workload(ps, progress=True, settings=settings))
    except Exception as e:  # noqa: BLE001 - tuning is an optimisation: the ops then use the model's launch
        log.warning("cutlass_byoc: could not tune the problems of %s: %s", report.graph, e)
        return
    log.info("cutlass_byoc: %s: %d problems: %s", report.graph, len(problems), co.summary())
    # A problem tuned by an earlier call of this process (with prefer_cudnn, _tune_first tunes a probe of the graph
    # just before this call) keeps its label: "cached" is for decisions older than the process.
    how = {p.name: decided_here(p) or "cached" for p in [*co.decided_before, *co.tuned, *co.waited]}
    by_name = {p.name: p for p in problems}
    for e in report.offloaded:
        p = by_name.get(e.problem)
        if p is None:
            continue
        if p in co.fell_back:
            e.notes.append(f"not tuned: {co.fell_back[p]}")
            continue
        dec = lookup(p)
        if dec is not None:
            e.kernel = f"{dec.launch.name} ({how.get(p.name, 'cached')}, {dec.time_us:.1f} us)"


def offloaded_calls(graph: fx.Graph | fx.GraphModule) -> list[fx.Node]:
    """The calls into cutlass_byoc ops in a partitioned graph."""
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return [n for n in g.nodes if n.target in NEW_OPS]


def count_targets(graph: fx.Graph | fx.GraphModule, targets: Iterable) -> int:
    g = graph.graph if isinstance(graph, fx.GraphModule) else graph
    targets = tuple(targets)
    return sum(1 for n in g.nodes if n.target in targets)
