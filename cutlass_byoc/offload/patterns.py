"""The pattern table of the cutlass_byoc offload and its predicates: which aten-level subgraphs CUTLASS can take.

The patterns are torch.fx graphs matched with torch.fx's own :class:`SubgraphMatcher`; every scalar argument of a
convolution (stride, padding, ..., groups) and every operand is a pattern placeholder, so one pattern covers all
convolutions of its shape of epilogue. The table is the product of

    aten.convolution  [-> add(bias | residual)]  [-> activation]  [-> cast]

where the activation appears in each form graphs carry it: the aten op (``aten.silu``) and its decompositions as
Inductor's and the core-ATen decomposition tables trace them (``x * sigmoid(x)`` or, for 16-bit x,
``convert(f32) -> ... -> convert(f16)``), and the cast is ``prims.convert_element_type``, ``aten._to_copy`` or
``aten.to.dtype``. For the backward, ``aten.convolution_backward`` is matched alone (its output mask decides what is
computed) and a second pattern ``convert_element_type(getitem(convolution_backward, 1))`` finds wgrad results cast to
fp32 for fp32 master weights under autocast.

Predicates (:func:`fprop_problem`, :func:`dgrad_problem`, :func:`wgrad_problem`, :func:`kernel_for`) build a
:class:`Conv2dProblem` from the FakeTensor metadata of the matched nodes (``node.meta['val']``) and ask
:func:`cutlass_byoc.select.choose` and :meth:`LaunchConfig.reject_reason` whether a kernel exists; each rejection
names its reason (layout, dtype, alignment, groups, dilation, transposed, depthwise, device, dynamic shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections import Counter
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from ..config import LaunchConfig
from ..problem import Conv2dProblem, Epilogue, ProblemError
from ..select import SelectMode, choose, cudnn_faster
from ..types import Activation, ConvKind, DType, SourceKind
from .report import DYNAMIC_SHAPE

log = logging.getLogger("cutlass_byoc.offload")

aten = torch.ops.aten
prims = torch.ops.prims

CONV = aten.convolution.default
CONV_BACKWARD = aten.convolution_backward.default
CAST_TARGETS = (prims.convert_element_type.default, aten._to_copy.default, aten.to.dtype)
ADD = aten.add.Tensor
ACTIVATION_OPS = {
    Activation.RELU: aten.relu.default, Activation.SIGMOID: aten.sigmoid.default, Activation.SILU: aten.silu.default,
    Activation.HARDSWISH: aten.hardswish.default, Activation.GELU: aten.gelu.default,
    Activation.RELU6: aten.hardtanh.default,  # F.relu6 is hardtanh(x, 0, 6) in aten graphs
}
#: literal arguments after the input, where the activation op has some (ReLU6: hardtanh's bounds)
ACTIVATION_ARGS = {Activation.RELU6: (0.0, 6.0)}
ACTIVATION_FNS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    Activation.RELU: torch.relu, Activation.SIGMOID: torch.sigmoid, Activation.SILU: F.silu,
    Activation.HARDSWISH: F.hardswish, Activation.GELU: F.gelu, Activation.RELU6: F.relu6,
}
CONV_PARAMS = ("stride", "padding", "dilation", "transposed", "output_padding", "groups")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: OffloadOptions.host_credit_us without CUDA graphs: below most of the host time an offloaded call saved over
#: aten.convolution in the offload bench's host-overhead rows on the H200 (runs 25-32: aten 16-46 us, our C++ call
#: site 7-22 us; saved 6-24 us a call, median 14, 4 of 24 below 10)
DEFAULT_HOST_CREDIT_US = 10.0


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """What the partitioner may offload and how the kernels are chosen.

    select: how the ops pick a kernel at run time (tune on first call, cached decisions only, or the heuristic);
    at compile time the predicates use the heuristic (and the decision cache unless select is 'heuristic').
    """

    select: SelectMode = SelectMode.CACHED
    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    transposed: bool = True
    fuse_epilogue: bool = True
    fuse_casts: bool = True
    channels_last: bool = True  # insert channels_last conversions for non-channels_last operands (else reject)
    require_cuda: bool = True  # offload only CUDA tensors (False: any device; the ops' reference runs off CUDA)
    allow_tf32: Optional[bool] = None  # fp32 convs run as TF32; None: follow torch.backends.cudnn.allow_tf32
    prebuild: bool = True  # compile the chosen kernels in parallel at graph compile time (CUDA, select != tune)
    strict: bool = False  # re-raise a partitioning failure instead of compiling that graph without offload (tests)
    cudagraphs: bool = False  # Inductor's CUDA graphs (cudagraph trees) around the compiled graphs, ops included
    # leave a conv to PyTorch where the decision cache says cuDNN was faster than the tuned kernel (select cached or
    # tune; the heuristic has no measurement to go by)
    prefer_cudnn: bool = True
    # prefer_cudnn's handicap for cuDNN, in us per call: the host time an offloaded call saves over aten's convolution
    # (the offload bench's host-overhead rows: 6-24 us on the H200, median 14). Without CUDA graphs a training step is
    # host-bound (ResNet-50 b32: ~19 ms of host time per step, ~10 ms of GPU work), so a kernel up to that much slower
    # than cuDNN still shortens the step; under graphs host time is gone and the kernel must win outright. None: the
    # default below without CUDA graphs, 0 with them (options.cudagraphs, a mode that turns them on, or Inductor's
    # config at compile time); a number applies in both.
    host_credit_us: Optional[float] = None
    mode: Optional[str] = None  # torch.compile's mode, passed to Inductor ("reduce-overhead" implies cudagraphs)
    # offload convs whose batch size is symbolic (torch.compile's dynamic graph after a second batch size): planned
    # at the size the graph was compiled for, each batch size met at run time bound on its first call (CallSite)
    dynamic_batch: bool = True
    # a training batch norm's statistics after an offloaded conv computed in the conv's epilogue (the kernel's
    # channel-statistics twin, KernelConfig.channel_stats) instead of a second pass over its output: the graph's
    # var_mean of the conv's output becomes mean = sum / count, var = sum of squares / count - mean**2 (clamped at 0).
    # Static batch sizes, plain fprop epilogues, sm90 conv launches; not under torch.use_deterministic_algorithms (the
    # sums are atomic adds); off by default (its call path is the general one, so it pays off under CUDA graphs)
    fuse_bn_stats: bool = False
    # a training batch norm's statistics as one pass of shifted sums (statistics.py): its var_mean over every
    # dimension but the channels becomes the per-channel sum and sum of squares of x minus the channel's first
    # element, which Inductor reduces in one fused pass, instead of its Welford reduction (a division an element; the
    # forward statistics of ResNet-50 b64 training ran at 37% of the H200's copy speed in the step). Any batch norm,
    # whoever made its input (the convs whose epilogue computes the statistics under fuse_bn_stats keep theirs);
    # static shapes, fp32 compute. On by default: on ResNet-50 training under CUDA graphs (H200, fused SGD, three
    # interleaved rounds) it took the step from 6.38 to 6.26 ms at batch 32 and from 10.36 to 10.18 ms at batch 64
    bn_sums: bool = True
    # offloaded wgrads launched on a side stream, each running beside the data gradients and batch-norm backward of
    # the next layers (cuDNN under Inductor runs them in line): n > 0 lets up to n of them be in flight there, each
    # joined back into the current stream at the n-th offloaded wgrad after it (the last one of a graph joins them
    # all). Only wgrads whose result nothing in the graph reads (a gradient returned to autograd) take part; under
    # CUDA graphs the side stream becomes a parallel branch of the captured graph. 0: every wgrad in line (the
    # default: on ResNet-50 training under CUDA graphs, H200, it took 0.06-0.09 ms off a step's 6.4-10.9 ms of GPU
    # busy time, the kernels beside the wgrads slowing down by almost as much; README, runs 33-34)
    overlap_wgrad: int = 0
    # deterministic kernels only for the offloaded convs, as under torch.use_deterministic_algorithms(True) but
    # without asking it of the rest of PyTorch: the 3.x split-k wgrad's atomic twin and the GEMM family's
    # nondeterministic stream-K reduction run as their deterministic twins (the same tile and slices, the partials
    # summed in order), and a tune at compile time does not time them. False: as PyTorch's flag says (which, set,
    # requires them anyway)
    deterministic: bool = False
    # per-parameter small ops in multi-tensor launches (batching.py) instead of a kernel each, in the graphs this
    # backend changed: the casts of graph inputs (under autocast every conv and linear weight, fp32 to fp16/bf16, on
    # each step) and the increments of 0-dim integer inputs (batch norms' num_batches_tracked)
    batch_params: bool = True
    # a training graph's 2-D max pools (forward and backward) on this backend's kernels (pooling.py): the forward
    # keeps each window's offset of its maximum, and the backward gathers from it instead of Inductor's recompute
    # and atomic scatter (ResNet-50's stem pool backward on an H100, b32 / b64: Inductor's 0.18 / 0.36 ms, ours
    # 0.035 / 0.067 with the add of its two incoming gradients taken in; scripts/pool_bench.py)
    max_pool: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "select", SelectMode(self.select))
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"cutlass_byoc options: deterministic must be True or False, got {self.deterministic!r}")
        ov = self.overlap_wgrad
        if isinstance(ov, bool) or not isinstance(ov, int) or ov < 0:
            raise ValueError(f"cutlass_byoc options: overlap_wgrad must be an int >= 0 (wgrads in flight on the side "
                             f"stream; 0: none), got {ov!r}")
        credit = self.host_credit_us
        if credit is not None and (isinstance(credit, bool) or not isinstance(credit, (int, float)) or not
                                   math.isfinite(credit) or credit < 0):
            raise ValueError(f"cutlass_byoc options: host_credit_us must be None or a finite number >= 0 (us per "
                             f"call), got {credit!r}")

    @classmethod
    def from_any(cls, options: "OffloadOptions | dict | None" = None, **kwargs) -> "OffloadOptions":
        if isinstance(options, OffloadOptions):
            return dataclasses.replace(options, **kwargs) if kwargs else options
        merged = dict(options or {})
        merged.update(kwargs)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(merged) - fields
        if unknown:
            raise ValueError(f"cutlass_byoc options: unknown {sorted(unknown)}; expected some of {sorted(fields)}")
        return cls(**merged)

    def cudnn_credit_us(self) -> float:
        """The host credit prefer_cudnn gives our kernels now (see host_credit_us): read at partition time, inside
        Inductor's compile, where its config patches (cudagraphs from options or mode) are in effect."""
        if self.host_credit_us is not None:
            return float(self.host_credit_us)
        return 0.0 if self.uses_cudagraphs() else DEFAULT_HOST_CREDIT_US

    def uses_cudagraphs(self) -> bool:
        """Whether the compiled graphs run under CUDA graphs: these options ask for them, or Inductor's config has
        them on (a mode's or the user's own setting)."""
        if self.cudagraphs:
            return True
        try:
            from torch._inductor import config as inductor_config  # noqa: PLC0415
            from torch._inductor import list_mode_options  # noqa: PLC0415

            if self.mode not in (None, "default") and list_mode_options(self.mode).get("triton.cudagraphs"):
                return True
            return bool(inductor_config.triton.cudagraphs)
        except Exception:  # noqa: BLE001 - Inductor's private config moved: assume graphs (no credit, the safe side)
            return True

    @property
    def compile_time_select(self) -> SelectMode:
        return SelectMode.HEURISTIC if self.select is SelectMode.HEURISTIC else SelectMode.CACHED


# ---------------------------------------------------------------------------------------------- matcher
class PatternMatcher(SubgraphMatcher):
    """torch.fx's SubgraphMatcher, except that two placeholders may bind the same graph value.

    Upstream refuses to bind one graph node to two pattern nodes, so ``add(conv(y), y)`` (a residual equal to the
    conv's input) would not match ``add(conv(x), other)``. Placeholders are wildcards for operands, so binding the
    same operand twice is sound; a graph node matched as an operation of the pattern still binds to nothing else.
    """

    def __init__(self, pattern: fx.Graph, **kwargs) -> None:
        kwargs.setdefault("match_output", False)
        kwargs.setdefault("match_placeholder", False)
        kwargs.setdefault("remove_overlapping_matches", True)
        kwargs.setdefault("ignore_literals", False)
        super().__init__(pattern, **kwargs)

    def _match_nodes(self, pn: fx.Node, gn: fx.Node, match, node_name_match: str = "") -> bool:
        if pn.op == "placeholder" and not self.match_placeholder:
            if pn in match.nodes_map:
                return match.nodes_map[pn] == gn
            if any(g is gn and p.op != "placeholder" for p, g in match.nodes_map.items()):
                return False
            match.nodes_map[pn] = gn
            return True
        return super()._match_nodes(pn, gn, match, node_name_match)


# ---------------------------------------------------------------------------------------------- pattern table
@dataclasses.dataclass(eq=False)
class ConvPattern:
    """One fprop pattern: the pattern graph and its named nodes (keys into a match's nodes_map)."""

    name: str
    gm: fx.GraphModule
    conv: fx.Node
    inputs: dict[str, fx.Node]  # placeholders: x, w, b and the conv parameters
    add: Optional[fx.Node] = None
    other: Optional[fx.Node] = None  # placeholder bound to the add's other operand
    activation: Activation = Activation.IDENTITY
    act_nodes: tuple[fx.Node, ...] = ()
    cast: Optional[fx.Node] = None
    cast_dtype: Optional[fx.Node] = None  # placeholder bound to the cast's dtype
    size: int = 1  # number of op nodes
    targets: frozenset = frozenset()

    @property
    def steps(self) -> tuple[str, ...]:
        s = []
        if self.add is not None:
            s.append("add")
        if self.activation is not Activation.IDENTITY:
            s.append(self.activation.value)
        if self.cast is not None:
            s.append("cast")
        return tuple(s)


def _graph_key(g: fx.Graph) -> tuple:
    """A structural key of a graph (ops, targets, argument wiring and literals), to drop duplicate forms."""
    index = {n: i for i, n in enumerate(g.nodes)}
    key = []
    for n in g.nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("%", index[a]))
        key.append((n.op, str(n.target) if n.op != "placeholder" else "", repr(args)))
    return tuple(key)


@functools.lru_cache(maxsize=None)
def activation_forms(act: Activation) -> tuple[fx.GraphModule, ...]:
    """The graphs an activation takes in aten-level graphs: one placeholder in, one value out."""
    forms: dict[tuple, fx.GraphModule] = {}

    def add(gm: fx.GraphModule) -> None:
        gm.graph.eliminate_dead_code()
        forms.setdefault(_graph_key(gm.graph), gm)

    g = fx.Graph()
    y = g.placeholder("y")
    g.output(g.call_function(ACTIVATION_OPS[act], (y, *ACTIVATION_ARGS.get(act, ()))))
    add(fx.GraphModule(torch.nn.Module(), g))
    from torch._decomp import core_aten_decompositions  # noqa: PLC0415
    from torch._inductor.decomposition import select_decomp_table  # noqa: PLC0415
    from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

    act_fn = ACTIVATION_FNS[act]

    def fn(y: torch.Tensor) -> torch.Tensor:  # make_fx traces every parameter: hide F.silu's `inplace`
        return act_fn(y)

    for table in (select_decomp_table(), core_aten_decompositions()):
        for dt in SUPPORTED_DTYPES:
            try:
                gm = make_fx(fn, decomposition_table=table, tracing_mode="fake")(torch.empty(2, 8, 4, 4, dtype=dt))
            except Exception as e:  # noqa: BLE001 - a decomposition that cannot trace on this build is skipped
                log.debug("activation %s does not trace for %s: %s", act.value, dt, e)
                continue
            for n in gm.graph.nodes:
                n.meta.clear()
            add(gm)
    return tuple(forms.values())


def _cast_node(g: fx.Graph, y: fx.Node, target, dtype: fx.Node) -> fx.Node:
    if target is aten._to_copy.default:
        return g.call_function(target, (y,), {"dtype": dtype})
    return g.call_function(target, (y, dtype))


def _build(add_role: Optional[str], act: Activation, act_form: Optional[fx.GraphModule], cast_target) -> ConvPattern:
    g = fx.Graph()
    x, w, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("b")
    params = {p: g.placeholder(p) for p in CONV_PARAMS}
    conv = g.call_function(CONV, (x, w, b, *params.values()))
    inputs = {"x": x, "w": w, "b": b, **params}
    y, add_node, other, act_nodes, cast, cast_dtype = conv, None, None, (), None, None
    if add_role is not None:
        other = g.placeholder("other")
        add_node = g.call_function(ADD, (conv, other) if add_role == "conv_first" else (other, conv))
        y = add_node
    if act_form is not None:
        before = set(g.nodes)
        ph = next(n for n in act_form.graph.nodes if n.op == "placeholder")
        y = g.graph_copy(act_form.graph, {ph: y})
        act_nodes = tuple(n for n in g.nodes if n not in before)
    if cast_target is not None:
        cast_dtype = g.placeholder("dtype")
        cast = y = _cast_node(g, y, cast_target, cast_dtype)
    g.output(y)
    # placeholders first, in creation order (fx keeps insertion order; the late ones were made after the conv)
    first_op = next(n for n in g.nodes if n.op != "placeholder")
    for n in [n for n in g.nodes if n.op == "placeholder"]:
        first_op.prepend(n)
    gm = fx.GraphModule(torch.nn.Module(), g)
    ops = [n for n in g.nodes if n.op == "call_function"]
    name = "conv" + (f"+add({add_role})" if add_role else "") + (f"+{act.value}" if act_form is not None else "") + (
        f"+cast({getattr(cast_target, '__name__', cast_target)})" if cast_target is not None else "")
    return ConvPattern(name=name, gm=gm, conv=conv, inputs=inputs, add=add_node, other=other, activation=act,
                       act_nodes=act_nodes, cast=cast, cast_dtype=cast_dtype, size=len(ops),
                       targets=frozenset(n.target for n in ops))


@functools.lru_cache(maxsize=None)
def fprop_patterns() -> tuple[ConvPattern, ...]:
    """All fprop patterns, largest first (a larger pattern fuses more; a rejected one gives way to smaller ones)."""
    out: list[ConvPattern] = []
    acts: list[tuple[Activation, Optional[fx.GraphModule]]] = [(Activation.IDENTITY, None)]
    for act in ACTIVATION_OPS:
        acts += [(act, form) for form in activation_forms(act)]
    for add_role in (None, "conv_first", "other_first"):
        for act, form in acts:
            for cast in (None, *CAST_TARGETS):
                out.append(_build(add_role, act, form, cast))
    out.sort(key=lambda p: -p.size)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def backward_pattern() -> tuple[fx.GraphModule, fx.Node]:
    """``aten.convolution_backward`` with every argument a placeholder."""
    g = fx.Graph()
    names = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed",
             "output_padding", "groups", "output_mask")
    phs = [g.placeholder(n) for n in names]
    cb = g.call_function(CONV_BACKWARD, tuple(phs))
    g.output(cb)
    return fx.GraphModule(torch.nn.Module(), g), cb


@functools.lru_cache(maxsize=None)
def wgrad_cast_patterns() -> tuple[tuple[fx.GraphModule, fx.Node, fx.Node, fx.Node], ...]:
    """``cast(getitem(cb, 1), dtype)`` for each cast form: (graph, cb placeholder, getitem node, cast node)."""
    import operator  # noqa: PLC0415

    out = []
    for target in CAST_TARGETS:
        g = fx.Graph()
        cb, dt = g.placeholder("cb"), g.placeholder("dtype")
        gi = g.call_function(operator.getitem, (cb, 1))
        cast = _cast_node(g, gi, target, dt)
        g.output(cast)
        out.append((fx.GraphModule(torch.nn.Module(), g), cb, gi, cast))
    return tuple(out)


# ---------------------------------------------------------------------------------------------- predicates
class Reject(Exception):
    """A pattern instance CUTLASS cannot take; the message is the reason recorded in the report."""


class PreferPyTorch(Reject):
    """The conv is left to PyTorch because cuDNN measured faster: no smaller pattern of the same conv is tried (its
    problem would run untuned where the tuned one lost)."""


def val(x) -> torch.Tensor:
    """The FakeTensor (or example tensor) an fx node carries in meta['val']; Reject if it has none."""
    if not isinstance(x, fx.Node):
        raise Reject(f"operand {x!r} is not a graph value")
    v = x.meta.get("val")
    if not isinstance(v, torch.Tensor):
        raise Reject(f"{x.name}: no tensor metadata (meta['val']); trace with make_fx/AOTAutograd/export")
    return v


def static_shape(t: torch.Tensor, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in t.shape) if all(isinstance(s, int) for s in t.shape) else _raise_dynamic(t, what)
    except TypeError:
        return _raise_dynamic(t, what)


def size_hint(s) -> Optional[int]:
    """The example value of a size: an int as it is, a backed SymInt's hint (the size the graph was traced at), None
    for an unbacked one (data-dependent)."""
    if isinstance(s, int):
        return s
    hint = getattr(getattr(s, "node", None), "hint", None)
    try:
        return int(hint) if hint is not None else None
    except (TypeError, ValueError):
        return None


def batch_shape(t: torch.Tensor, what: str, options: Optional["OffloadOptions"] = None) -> tuple[tuple[int, ...], bool]:
    """The sizes of an activation (or its gradient) with a symbolic batch size replaced by its hint, and whether the
    batch is symbolic. Only the batch (dim 0) may be symbolic, and only with a hint, with options.dynamic_batch on:
    otherwise Reject(dynamic shape)."""
    shape = tuple(t.shape)
    if all(isinstance(s, int) for s in shape):
        return tuple(int(s) for s in shape), False
    if options is not None and not options.dynamic_batch:
        _raise_dynamic(t, what, "dynamic_batch=False")
    if not shape or not all(isinstance(s, int) for s in shape[1:]):
        _raise_dynamic(t, what, "only the batch size may be symbolic")
    n = size_hint(shape[0])
    if n is None or n < 1:
        _raise_dynamic(t, what, "the batch size has no example value")
    return (n, *(int(s) for s in shape[1:])), True


def batch_shapes(a: torch.Tensor, b: torch.Tensor, what_a: str, what_b: str,
                 options: Optional["OffloadOptions"] = None) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """batch_shape of two tensors of one conv call (input and output, input and grad_output), and whether their
    batch is symbolic; Reject(dynamic shape) where it is and the two batch sizes are not the same expression."""
    a_shape, a_dyn = batch_shape(a, what_a, options)
    b_shape, b_dyn = batch_shape(b, what_b, options)
    dynamic = a_dyn or b_dyn
    if dynamic and not same_size(a.shape[0], b.shape[0]):
        raise Reject(f"{DYNAMIC_SHAPE}: {what_a} batch {a.shape[0]} and {what_b} batch {b.shape[0]} differ")
    return a_shape, b_shape, dynamic


def same_size(a, b) -> bool:
    """Whether two sizes are the same for every value of their symbols: equal ints, or the same symbolic expression
    (two symbols with equal example values are not)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, int) or isinstance(b, int):
        return False
    ea, eb = getattr(getattr(a, "node", None), "expr", None), getattr(getattr(b, "node", None), "expr", None)
    return ea is not None and ea == eb


def _raise_dynamic(t, what, why: Optional[str] = None):
    raise Reject(f"{DYNAMIC_SHAPE}: {what} has symbolic sizes {tuple(t.shape)}"
                 + (f" ({why})" if why else "") + "; kernels are chosen per static shape "
                 "(torch.compile(..., dynamic=False) keeps every graph static)")


def pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) for i in v):
        raise Reject(f"{name}: expected static ints, got {v!r}")
    v = tuple(v)
    if len(v) == 1:
        return (v[0], v[0])
    if len(v) != 2:
        raise Reject(f"{name}: {len(v)}-d convolution (only conv2d is offloaded)")
    return v  # type: ignore[return-value]


def check_tensor(t: torch.Tensor, what: str, options: OffloadOptions, dim: int = 4) -> None:
    if t.dim() != dim:
        raise Reject(f"layout: {what} is {t.dim()}-d, expected {dim}-d (only conv2d is offloaded)")
    if options.require_cuda and t.device.type != "cuda":
        raise Reject(f"device: {what} is on {t.device.type}; only CUDA tensors are offloaded")
    if t.dtype not in SUPPORTED_DTYPES:
        raise Reject(f"dtype: {what} is {t.dtype}; kernels take float16, bfloat16, float32")
    if dim == 4 and not options.channels_last and not t.is_contiguous(memory_format=torch.channels_last):
        raise Reject(f"layout: {what} is not channels_last and channels_last conversion is off")


def check_dtypes(a: torch.Tensor, b: torch.Tensor, options: OffloadOptions) -> None:
    if a.dtype != b.dtype:
        raise Reject(f"dtype: operands differ ({a.dtype} and {b.dtype}); kernels take one input type")
    if a.dtype == torch.float32:
        tf32 = options.allow_tf32 if options.allow_tf32 is not None else torch.backends.cudnn.allow_tf32
        if not tf32:
            raise Reject("dtype: float32 conv would run as TF32 but torch.backends.cudnn.allow_tf32 is False")


def _dtype(t: torch.dtype) -> DType:
    return DType.from_torch(t)


def make_problem(kind: ConvKind, x_shape, w_shape, stride, padding, dilation, groups: int, in_dtype, out_dtype,
                 epilogue: Epilogue = Epilogue()) -> Conv2dProblem:
    """A Conv2dProblem from PyTorch-ordered shapes: x (N, C, H, W) and w (K, C/groups, R, S)."""
    n, c, h, w = x_shape
    k, _, r, s = w_shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    try:
        return Conv2dProblem(kind=kind, n=n, h=h, w=w, c=c, k=k, r=r, s=s, pad_h=ph, pad_w=pw, stride_h=sh,
                             stride_w=sw, dilation_h=dh, dilation_w=dw, groups=groups, element_a=_dtype(in_dtype),
                             element_b=_dtype(in_dtype), element_out=_dtype(out_dtype), element_acc=DType.F32,
                             epilogue=epilogue)
    except ProblemError as e:
        raise Reject(f"problem: {e}") from None


def exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting src to dst loses nothing (so casting an epilogue source up front changes no value)."""
    return src == dst or dst == torch.float32


@functools.lru_cache(maxsize=4096)
def _choose(problem: Conv2dProblem, mode: SelectMode) -> Optional[LaunchConfig]:
    return choose(problem, mode)


@functools.lru_cache(maxsize=4096)
def _why_none(problem: Conv2dProblem) -> str:
    try:
        from ..candidates import sm80_candidates  # noqa: PLC0415

        reasons = Counter(k.reject_reason(problem) or "split-k/launch limits" for k in sm80_candidates(problem))
    except Exception as e:  # noqa: BLE001 - the reason is informational
        return f"no kernel computes {problem.name} ({e})"
    if not reasons:
        return f"no kernel candidates for {problem.name}"
    return reasons.most_common(1)[0][0]


def kernel_for(problem: Conv2dProblem, options: OffloadOptions) -> LaunchConfig:
    """The launch the ops would use (at compile time), or Reject with the reason no kernel takes the problem."""
    if problem.is_depthwise:
        from ..depthwise import depthwise_problem_error  # noqa: PLC0415

        why = depthwise_problem_error(problem)
        if why:
            raise Reject(f"depthwise: {why}")
    elif problem.groups != 1:
        raise Reject(f"groups: grouped conv (groups={problem.groups}); implicit-GEMM kernels need groups == 1 "
                     "and depthwise kernels groups == C == K")
    why = problem.int32_overflow
    if why:
        raise Reject(f"size: {why}")
    if options.prefer_cudnn and options.compile_time_select is SelectMode.CACHED:
        why = cudnn_faster(problem, host_credit_us=options.cudnn_credit_us())
        if why:
            raise PreferPyTorch(why)
    launch = _choose(problem, options.compile_time_select)
    if launch is None:
        from ..candidates import unsupported_reason  # noqa: PLC0415

        raise Reject(unsupported_reason(problem) or f"no kernel: {_why_none(problem)}")
    why = launch.reject_reason(problem)
    if why:
        raise Reject(f"kernel {launch.name}: {why}")
    return launch


def conv_params(values: dict[str, object]) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], int, bool]:
    """stride, padding, dilation, groups, transposed from a convolution's bound literals; Reject if not conv2d."""
    stride, padding, dilation = (pair(values[k], k) for k in ("stride", "padding", "dilation"))
    groups, transposed = values["groups"], values["transposed"]
    if not isinstance(groups, int) or not isinstance(transposed, bool):
        raise Reject(f"groups/transposed: expected static values, got {groups!r}/{transposed!r}")
    return stride, padding, dilation, groups, transposed


def describe_epilogue(activation: Activation, source: SourceKind) -> Epilogue:
    return Epilogue(activation, source)


def shapes_equal(a: Sequence[int], b: Sequence[int]) -> bool:
    return tuple(a) == tuple(b)
