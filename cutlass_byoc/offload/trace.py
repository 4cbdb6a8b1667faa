"""Aten-level graphs of a model on fake tensors, as torch.compile's AOTAutograd sees them, and :func:`explain`:
what the partitioner would offload from a model, without compiling or running anything.

``training=True`` traces the joint graph (forward, loss and ``torch.autograd.grad`` of every parameter), which holds
the same ``aten.convolution_backward`` calls as AOTAutograd's joint graph; ``decompositions`` picks the table the
graph is traced with: ``"inductor"`` (what ``torch.compile`` uses), ``"core"`` (core ATen, as torch.export's
``run_decompositions``) or ``None`` (aten ops as dispatched).
"""

from __future__ import annotations

import contextlib
import copy
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
    """The aten graph of ``model(*inputs)`` (training: with the backward of ``loss_fn(output)``, default sum, to
    the parameters that require a gradient).

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
            # frozen parameters (requires_grad False, e.g. a fine-tuned model's backbone) get no gradient, as in
            # the model's own backward: their convs have no wgrad
            return loss, torch.autograd.grad(loss, [v for v in p.values() if v.requires_grad])
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


def load_model(spec: str) -> torch.nn.Module:
    """A model from ``torchvision:resnet50``, ``timm:NAME`` or ``package.module:factory`` (called with no
    arguments), with random weights."""
    import importlib  # noqa: PLC0415

    if ":" not in spec:
        raise ValueError(f"--model: expected torchvision:NAME, timm:NAME or package.module:factory, got {spec!r}")
    where, name = spec.split(":", 1)
    if where == "torchvision":
        import torchvision.models as tvm  # noqa: PLC0415

        if not hasattr(tvm, name):
            raise ValueError(f"--model: torchvision.models has no {name!r}")
        return getattr(tvm, name)(weights=None)
    if where == "timm":
        import timm  # noqa: PLC0415

        return timm.create_model(name, pretrained=False)
    try:
        module = importlib.import_module(where)
    except ImportError as e:
        raise ValueError(f"--model: cannot import {where!r}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"--model: {where} has no callable {name!r}")
    return factory()


def model_problems(model: torch.nn.Module | str, batch: int, *, training: bool = True,
                   autocast: Optional[torch.dtype] = torch.float16, image: int = 224, in_channels: int = 3,
                   channels_last: bool = True, options: OffloadOptions | dict | None = None):
    """The conv problems the backend would offload from `model` (fprop, dgrad and wgrad with the dtypes and
    epilogues autocast produces), in graph order without repeats, and the partition report; traced on fake
    tensors (nothing computed, no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

    from .partition import partition  # noqa: PLC0415

    # a caller's module is copied: the channels_last conversion below, made under the fake mode, would otherwise
    # swap its parameters for fake tensors, and train() would change its mode
    m = load_model(model) if isinstance(model, str) else copy.deepcopy(model)
    m = m.train(training)
    opts = OffloadOptions.from_any(options, require_cuda=False, prebuild=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(batch, in_channels, image, image)
        if channels_last:
            m, x = m.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        gm = trace(m, x, training=training, autocast=autocast)
        report = partition(gm, opts, name=type(m).__name__ + ("(joint)" if training else "(forward)"))
    return list(dict.fromkeys(report.problems)), report
