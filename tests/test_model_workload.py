"""CPU tests of `cutlass-byoc tune/bench --model`: the problems traced from a model are exactly those the backend's
partitioner offloads (fprop, dgrad, wgrad with autocast's dtypes and the fused epilogues)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `models:resnet50` specs name tests/models.py

from cutlass_byoc.cli import UsageError, _items_from_args, build_parser  # noqa: E402
from cutlass_byoc.offload import explain  # noqa: E402
from cutlass_byoc.offload.trace import load_model, model_problems  # noqa: E402
from cutlass_byoc.types import ConvKind  # noqa: E402


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2"])
def test_model_problems_are_the_partitioners(name):
    problems, rep = model_problems(f"models:{name}", 2, image=64)
    # the same model partitioned as explain() does it on real (CPU) tensors
    torch.manual_seed(0)
    m = load_model(f"models:{name}").to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    _, ref = explain(m, x, training=True, autocast=torch.float16, options={"require_cuda": False})
    assert {p.name for p in problems} == {e.problem for e in ref.offloaded}
    assert len(problems) == len(set(problems))
    kinds = {p.kind for p in problems}
    assert kinds == {ConvKind.FPROP, ConvKind.DGRAD, ConvKind.WGRAD}
    assert all(p.element_a.value == "f16" for p in problems)
    # fused epilogues as the partitioner fuses them (autocast's fp32 wgrad outputs for fp32 master weights)
    assert any(p.kind is ConvKind.WGRAD and p.element_out.value == "f32" for p in problems)


def test_inference_traces_forward_only():
    problems, _ = model_problems("models:resnet18", 1, training=False, image=64)
    assert problems and {p.kind for p in problems} == {ConvKind.FPROP}


def test_cli_model_items():
    args = build_parser().parse_args(["tune", "--model", "models:resnet18", "--batch", "2", "--image", "64",
                                      "--amp", "bf16"])
    items = _items_from_args(args)
    assert items and all(it.problem.element_a.value == "bf16" and it.problem.n == 2 for it in items)
    assert items[0].layer == "resnet18#0"


@pytest.mark.parametrize("spec, match", [("resnet50", "expected torchvision"), ("nosuchpkg_xyz:f", "cannot import"),
                                         ("models:nope", "no callable")])
def test_bad_model_spec_names_the_flag(spec, match):
    args = build_parser().parse_args(["tune", "--model", spec])
    with pytest.raises(UsageError, match=match):
        _items_from_args(args)
    args = build_parser().parse_args(["bench", "--model", "models:resnet18", "--kind", "fprop"])
    with pytest.raises(UsageError, match="--model"):
        _items_from_args(args)
