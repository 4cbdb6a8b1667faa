"""The ``cutlass_byoc`` torch.compile backend: Inductor with the cutlass_byoc partitioner run on the joint graph.

``torch.compile(model, backend="cutlass_byoc", options={"select": "tune"})`` (registered through the
``torch_dynamo_backends`` entry point, and by importing this module) compiles exactly as ``torch.compile`` with
Inductor does (AOTAutograd, decompositions, min-cut partitioning, fusion, cudagraphs if asked), with one addition:
the partitioner runs as Inductor's ``joint_custom_pre_pass``, i.e. on the aten-level joint forward+backward graph
(the inference graph when no gradient is needed), before AOTAutograd splits it into the forward and backward graphs.
Offloading there rather than in separate forward and backward compilers keeps layouts consistent: when an NCHW
model's convs become channels_last, the activations saved for the backward are channels_last in both graphs, so no
transpose is needed around any conv. Everything not offloaded is compiled by Inductor.

Options (a dict or keyword arguments, see :class:`OffloadOptions`): ``select`` = ``"tune"`` (profile on the first
call of each new problem), ``"cached"`` (recorded decisions, else the heuristic; the default) or ``"heuristic"``;
switches for fprop/dgrad/wgrad/transposed offload and epilogue/cast fusion; ``prefer_cudnn`` and its
``host_credit_us`` (without CUDA graphs a kernel up to that much slower than cuDNN is still offloaded: it saves more
host time than it costs); ``require_cuda``; ``cudagraphs=True``
(or ``torch.compile(..., mode="reduce-overhead")``) for Inductor's CUDA graphs around everything, the offloaded ops
included (they allocate their workspaces per call from the caching allocator and never synchronize); ``strict``.

The report of each compiled graph is logged (logger ``cutlass_byoc.offload``) and kept: :func:`last_report`,
:func:`reports`, or ``backend.reports`` of a :func:`make_backend` instance; what the ops did at run time (kernel
launches, fallbacks with reasons) is in :data:`cutlass_byoc.offload.library.RUNTIME`.

Shapes: torch.compile marks the batch dimension dynamic after it sees a second batch size (a smaller last batch).
Such convolutions are offloaded, planned at the traced batch size, each batch size bound at its first call
(:class:`.library.CallSite`; ``dynamic_batch=False`` leaves them to PyTorch). Other symbolic sizes are left to
PyTorch (with the reason "dynamic shape"); ``torch.compile(..., dynamic=False)`` keeps every graph static.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from .partition import partition
from .patterns import OffloadOptions
from .report import OffloadReport

log = logging.getLogger("cutlass_byoc.offload")

BACKEND_NAME = "cutlass_byoc"
_REPORTS: list[OffloadReport] = []
_lock = threading.Lock()


def reports() -> list[OffloadReport]:
    """Reports of every graph partitioned in this process, oldest first."""
    with _lock:
        return list(_REPORTS)


def last_report() -> Optional[OffloadReport]:
    with _lock:
        return _REPORTS[-1] if _REPORTS else None


def clear_reports() -> None:
    with _lock:
        _REPORTS.clear()


class OffloadPass:
    """The partitioner as an Inductor graph pass (a plain callable on torch.fx.Graph: Inductor then bypasses its FX
    graph cache for these graphs, so the pass, and its report, runs on every compilation)."""

    def __init__(self, options: OffloadOptions, sink: Optional[list[OffloadReport]] = None) -> None:
        self.options = options
        self.sink = sink if sink is not None else []
        self.ran = False  # whether the pass changed a graph (then a later failure may be ours)

    def __call__(self, graph: fx.Graph) -> None:
        with _lock:
            name = f"graph{len(_REPORTS)}"
        has_backward = any(n.target is torch.ops.aten.convolution_backward.default for n in graph.nodes)
        report = partition(graph, self.options, name=f"{name}({'joint' if has_backward else 'forward'})")
        self.ran = self.ran or bool(report.offloaded)
        self.sink.append(report)
        with _lock:
            _REPORTS.append(report)


def compile_with_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], options: OffloadOptions,
                         sink: Optional[list[OffloadReport]] = None) -> Callable:
    """Inductor's compile_fx with the offload pass added to its joint-graph passes."""
    from torch._inductor import config as inductor_config  # noqa: PLC0415
    from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415

    ours = OffloadPass(options, sink)
    existing = inductor_config.joint_custom_pre_pass
    if existing is None:
        passes: Any = ours
    else:
        passes = [*(existing if isinstance(existing, (list, tuple)) else [existing]), ours]
    patches = inductor_patches(options)
    try:
        return compile_fx(gm, list(example_inputs), config_patches={**patches, "joint_custom_pre_pass": passes})
    except Exception as e:  # noqa: BLE001 - a model never fails to compile because of this backend
        if options.strict or not ours.ran:
            raise  # strict, or the failure came before our pass touched the graph: it is not ours
        report = OffloadReport(f"graph{len(reports())}(retry)")
        report.fail(f"Inductor failed on the offloaded graph ({type(e).__name__}: {e}); compiled again without "
                    "offload")
        ours.sink.append(report)
        with _lock:
            _REPORTS.append(report)
    return compile_fx(gm, list(example_inputs), config_patches=patches)


def inductor_patches(options: OffloadOptions) -> dict[str, Any]:
    """Inductor config for these options: torch.compile's mode as Inductor applies it, and CUDA graphs."""
    patches: dict[str, Any] = {}
    if options.mode not in (None, "default"):
        from torch._inductor import list_mode_options  # noqa: PLC0415

        patches.update(list_mode_options(options.mode))
    if options.cudagraphs:
        patches["triton.cudagraphs"] = True
    return patches


def compile_eager_with_offload(gm: fx.GraphModule, example_inputs: Sequence[Any], options: OffloadOptions,
                               sink: Optional[list[OffloadReport]] = None) -> Callable:
    """AOTAutograd with Inductor's decompositions and partitioner, the offload pass on the joint (or inference)
    graph, and the resulting forward and backward graphs run eagerly instead of being compiled by Inductor.

    For debugging and for checks that isolate the kernels from Inductor (and for CPU tests: no C++ compiler)."""
    import torch._inductor.lowering  # noqa: F401, PLC0415 - some of Inductor's decompositions consult its lowerings
    from torch._dynamo.backends.common import aot_autograd  # noqa: PLC0415
    from torch._functorch.aot_autograd import make_boxed_func  # noqa: PLC0415
    from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: PLC0415
    from torch._inductor.decomposition import select_decomp_table  # noqa: PLC0415

    ours = OffloadPass(options, sink)

    def partition_fn(joint: fx.GraphModule, joint_inputs, **kwargs):
        ours(joint.graph)
        joint.recompile()
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)

    def run_eagerly(g: fx.GraphModule, _inputs):
        return make_boxed_func(g.forward)

    def inference(g: fx.GraphModule, _inputs):
        ours(g.graph)
        g.recompile()
        return make_boxed_func(g.forward)

    backend = aot_autograd(fw_compiler=run_eagerly, bw_compiler=run_eagerly, inference_compiler=inference,
                           partition_fn=partition_fn, decompositions=select_decomp_table())
    return backend(gm, list(example_inputs))


def cutlass_byoc_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Optional[dict] = None,
                         **kwargs: Any) -> Callable:
    """The torch.compile backend (entry point ``torch_dynamo_backends: cutlass_byoc``)."""
    mode = kwargs.pop("mode", None)
    if mode is not None:
        kwargs["mode"] = mode  # e.g. "reduce-overhead": Inductor's CUDA graphs, the ops captured with the rest
    opts = OffloadOptions.from_any(options, **kwargs)
    return compile_with_offload(gm, example_inputs, opts)


class CutlassByocBackend:
    """A configured backend object: ``torch.compile(model, backend=make_backend(select="heuristic"))``; its
    reports list holds the report of every graph it compiled."""

    def __init__(self, options: OffloadOptions, inductor: bool = True) -> None:
        self.options = options
        self.inductor = inductor
        self.reports: list[OffloadReport] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        compile_fn = compile_with_offload if self.inductor else compile_eager_with_offload
        return compile_fn(gm, example_inputs, self.options, self.reports)

    def report(self) -> OffloadReport:
        """All graphs' reports merged."""
        out = OffloadReport("all graphs")
        for r in self.reports:
            out = out.merge(r)
        return out


def make_backend(options: Optional[dict | OffloadOptions] = None, *, inductor: bool = True,
                 **kwargs: Any) -> CutlassByocBackend:
    """A backend with these options; ``inductor=False`` runs the partitioned graphs eagerly (no Inductor)."""
    return CutlassByocBackend(OffloadOptions.from_any(options, **kwargs), inductor=inductor)


def register() -> None:
    """Make ``backend="cutlass_byoc"`` work without the installed entry point (an idempotent no-op with it)."""
    try:
        from torch._dynamo.backends import registry  # noqa: PLC0415

        registry._lazy_import()
        if BACKEND_NAME in registry._COMPILER_FNS or registry._BACKENDS.get(BACKEND_NAME) is not None:
            return  # registered, or the entry point will load this function on first lookup
        registry.register_backend(cutlass_byoc_backend, name=BACKEND_NAME)
    except Exception as e:  # noqa: BLE001 - private registry API; the entry point still works
        log.debug("cutlass_byoc: could not register the backend directly: %s", e)


register()
