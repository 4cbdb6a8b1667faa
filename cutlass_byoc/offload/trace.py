"""Aten-level graphs of a model on fake tensors, as torch.compile's AOTAutograd sees them, and :func:`explain`:
what the partitioner would offload from a model, without compiling or running anything.

``training=True`` traces the joint graph (forward, loss and ``torch.autograd.grad`` of every parameter), which holds
the same ``aten.convolution_backward`` calls as AOTAutograd's joint graph; ``decompositions`` picks the table the
graph is traced with: ``"inductor"`` (what ``torch.compile`` uses), ``"core"`` (core ATen, as torch.export's
``run_decompositions``) or ``None`` (aten ops as dispatched).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.fx as fx

from .patterns import OffloadOptions
from .report import OffloadReport


def decomposition_table(which: Optional[str]) -> Optional[dict]:
    if which is None or which == "none":
        return None
    if which == "inductor":
        import torch._inductor.lowering  # noqa: F401, PLC0415 - Inductor's decompositions consult its lowerings
        from torch._inductor.decomposition import select_decomp_table  # noqa: PLC0415

        return select_decomp_table()
    if which == "core":
        from torch._decomp import core_aten_decompositions  # noqa: PLC0415

        return dict(core_aten_decompositions())
    raise ValueError(f"decompositions: expected 'inductor', 'core' or None, got {which!r}")


def _autocast(device_type: str, dtype: Optional[torch.dtype]):
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def trace(model: torch.nn.Module, *inputs: torch.Tensor, training: bool = False,
          autocast: Optional[torch.dtype] = None, decompositions: Optional[str] = "inductor",
          loss_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, tracing_mode: str = "fake"
          ) -> fx.GraphModule:
    """The aten graph of ``model(*inputs)`` (training: with the backward of ``loss_fn(output)``, default sum).

    Placeholders: the parameters, the buffers, then the inputs. Nothing is computed (fake tensors)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    device_type = inputs[0].device.type if inputs else "cpu"
    loss_fn = loss_fn or (lambda out: out.float().sum())

    def forward(p, b, *xs):
        with _autocast(device_type, autocast):
            return torch.func.functional_call(model, {**p, **b}, xs)

    if training:
        def fn(p, b, *xs):
            loss = loss_fn(forward(p, b, *xs))
            return loss, torch.autograd.grad(loss, list(p.values()))
    else:
        def fn(p, b, *xs):
            with torch.no_grad():
                return forward(p, b, *xs)

    from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

    return make_fx(fn, decomposition_table=decomposition_table(decompositions), tracing_mode=tracing_mode)(
        params, buffers, *inputs)


def explain(model: torch.nn.Module, *inputs: torch.Tensor, training: bool = False,
            autocast: Optional[torch.dtype] = None, options: OffloadOptions | dict | None = None,
            decompositions: Optional[str] = "inductor") -> tuple[fx.GraphModule, OffloadReport]:
    """Trace and partition; return the partitioned graph and the report."""
    from .partition import partition  # noqa: PLC0415

    gm = trace(model, *inputs, training=training, autocast=autocast, decompositions=decompositions)
    report = partition(gm, options, name=type(model).__name__ + ("(joint)" if training else "(forward)"))
    return gm, report
