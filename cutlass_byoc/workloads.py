"""Workloads: named lists of conv problems. The default one is the ResNet-50 set of the benchmark (plus an odd-channel
layer), each layer in fprop, dgrad and wgrad; others come from JSON files.

JSON format (either form)::

    {"batch": 32, "dtype": "f16", "kinds": ["fprop", "dgrad", "wgrad"],
     "layers": [{"name": "l1", "c": 64, "k": 64, "r": 3, "stride": 1, "hw": 56},          # padding: r // 2
                {"name": "l2", "c": 64, "k": 64, "r": 3, "s": 3, "h": 56, "w": 40, "padding": 1,
                 "groups": 1, "n": 8, "kinds": ["fprop"]}]}

    [{"kind": "fprop", "n": 32, "h": 56, "w": 56, "c": 64, "k": 64, "r": 3, "s": 3, "pad_h": 1, ...}, ...]

The second form is a list of `Conv2dProblem.to_dict()` records (what `cutlass-byoc tune --dump-workload` writes).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

from .problem import Conv2dProblem, ProblemError
from .types import ConvKind, DType

KINDS = (ConvKind.FPROP, ConvKind.DGRAD, ConvKind.WGRAD)


class WorkloadError(ValueError):
    """A workload file that cannot be read; the message names the file, the entry and the field."""


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    c: int
    k: int
    r: int
    stride: int
    hw: int
    groups: int = 1
    padding: Optional[int] = None  # default: r // 2 (3x3 -> 1, 7x7 -> 3, 1x1 -> 0)
    resnet50: bool = True  # counted in the ResNet-50 geometric mean

    def problem(self, kind: ConvKind, batch: int = 32, dtype: DType = DType.F16) -> Conv2dProblem:
        pad = self.r // 2 if self.padding is None else self.padding
        return Conv2dProblem.make(kind, batch, self.c, self.hw, self.hw, self.k, self.r, stride=self.stride,
                                  padding=pad, groups=self.groups, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class WorkloadItem:
    layer: str  # the layer's name, shared by its three kinds
    problem: Conv2dProblem
    resnet50: bool = False
    count: int = 1  # how many conv passes of a traced step (--model) run this problem

    @property
    def kind(self) -> ConvKind:
        return self.problem.kind


#: Batch 32, fp16 NHWC: C -> K, RxS, stride, HxW.
RESNET50_LAYERS: tuple[Layer, ...] = (
    Layer("conv1_7x7_3_64_s2", 3, 64, 7, 2, 224),
    Layer("l1_1x1_64_64", 64, 64, 1, 1, 56),
    Layer("l1_3x3_64_64", 64, 64, 3, 1, 56),
    Layer("l1_1x1_64_256", 64, 256, 1, 1, 56),
    Layer("l1_1x1_256_64", 256, 64, 1, 1, 56),
    Layer("l2_3x3_128_s2", 128, 128, 3, 2, 56),
    Layer("l2_1x1_256_512_s2", 256, 512, 1, 2, 56),
    Layer("l2_3x3_128_128", 128, 128, 3, 1, 28),
    Layer("l2_1x1_512_128", 512, 128, 1, 1, 28),
    Layer("l3_3x3_256_256", 256, 256, 3, 1, 14),
    Layer("l3_1x1_256_1024", 256, 1024, 1, 1, 14),
    Layer("l3_1x1_1024_256", 1024, 256, 1, 1, 14),
    Layer("l4_3x3_512_512", 512, 512, 3, 1, 7),
    Layer("l4_3x3_512_s2", 512, 512, 3, 2, 14),
    Layer("l4_1x1_512_2048", 512, 2048, 1, 1, 7),
)
ODD_LAYERS: tuple[Layer, ...] = (Layer("odd_3x3_7_33", 7, 33, 3, 1, 56, resnet50=False),)


def _dw(name: str, c: int, r: int, stride: int, hw: int) -> Layer:
    return Layer(name, c, c, r, stride, hw, groups=c, resnet50=False)


#: The distinct depthwise convs of torchvision's MobileNetV2 at 224x224 (C, RxS, stride, input HxW).
MOBILENETV2_DW_LAYERS: tuple[Layer, ...] = (
    _dw("mbv2_dw_32_112", 32, 3, 1, 112),
    _dw("mbv2_dw_96_s2_112", 96, 3, 2, 112),
    _dw("mbv2_dw_144_56", 144, 3, 1, 56),
    _dw("mbv2_dw_144_s2_56", 144, 3, 2, 56),
    _dw("mbv2_dw_192_28", 192, 3, 1, 28),
    _dw("mbv2_dw_192_s2_28", 192, 3, 2, 28),
    _dw("mbv2_dw_384_14", 384, 3, 1, 14),
    _dw("mbv2_dw_576_14", 576, 3, 1, 14),
    _dw("mbv2_dw_576_s2_14", 576, 3, 2, 14),
    _dw("mbv2_dw_960_7", 960, 3, 1, 7),
)
#: The depthwise convs of torchvision's EfficientNet-B0 at 224x224 that MobileNetV2 does not already have (its
#: 32ch 3x3 at 112, 96ch 3x3 s2 at 112 and 144ch 3x3 at 56 are the same problems).
EFFICIENTNET_B0_DW_LAYERS: tuple[Layer, ...] = (
    _dw("effb0_dw_144_5x5_s2_56", 144, 5, 2, 56),
    _dw("effb0_dw_240_5x5_28", 240, 5, 1, 28),
    _dw("effb0_dw_240_s2_28", 240, 3, 2, 28),
    _dw("effb0_dw_480_14", 480, 3, 1, 14),
    _dw("effb0_dw_480_5x5_14", 480, 5, 1, 14),
    _dw("effb0_dw_672_5x5_14", 672, 5, 1, 14),
    _dw("effb0_dw_672_5x5_s2_14", 672, 5, 2, 14),
    _dw("effb0_dw_1152_5x5_7", 1152, 5, 1, 7),
    _dw("effb0_dw_1152_7", 1152, 3, 1, 7),
)
#: The named workload "depthwise": the depthwise layers of MobileNetV2 and EfficientNet-B0 (batch 32). Kept out
#: of the default workload so the ResNet-50 tune keeps its time; `cutlass-byoc tune depthwise` tunes them.
DEPTHWISE_LAYERS: tuple[Layer, ...] = MOBILENETV2_DW_LAYERS + EFFICIENTNET_B0_DW_LAYERS


def _items(layers: Iterable[Layer], kinds: Sequence[ConvKind], batch: int, dtype: DType) -> list[WorkloadItem]:
    return [WorkloadItem(l.name, l.problem(kind, batch, dtype), l.resnet50) for l in layers for kind in kinds]


def default_workload(batch: int = 32, dtype: DType | str = DType.F16, kinds: Sequence[ConvKind | str] = KINDS,
                     depthwise: Optional[bool] = False, arch: int = 90) -> list[WorkloadItem]:
    """The embedded workload: ResNet-50 and the odd-channel layer. `depthwise=True` adds the depthwise layers
    (the "depthwise" workload); `None` adds those some kernel family of this build computes."""
    kinds = [ConvKind(k) for k in kinds]
    dtype = DType(dtype)
    items = _items(RESNET50_LAYERS + ODD_LAYERS, kinds, batch, dtype)
    if depthwise is not False:
        dw = _items(DEPTHWISE_LAYERS, kinds, batch, dtype)
        if depthwise is None:
            from .profiler.plan import has_kernels  # noqa: PLC0415

            dw = [it for it in dw if has_kernels(it.problem, arch)]
        items += dw
    return items


def depthwise_workload(batch: int = 32, dtype: DType | str = DType.F16,
                       kinds: Sequence[ConvKind | str] = KINDS) -> list[WorkloadItem]:
    """The named workload "depthwise": MobileNetV2's and EfficientNet-B0's depthwise layers in every kind."""
    return _items(DEPTHWISE_LAYERS, [ConvKind(k) for k in kinds], batch, DType(dtype))


#: Workloads `cutlass-byoc tune NAME` and `bench NAME` accept instead of a JSON file.
NAMED_WORKLOADS = {
    "default": lambda **kw: default_workload(**kw),
    "resnet50": lambda **kw: default_workload(**kw),
    "depthwise": lambda **kw: depthwise_workload(**{k: v for k, v in kw.items() if k != "arch"}),
    "all": lambda **kw: default_workload(**kw, depthwise=True),
}


def named_workload(name: str, **kw) -> list[WorkloadItem]:
    if name not in NAMED_WORKLOADS:
        raise WorkloadError(f"workload: expected a JSON file or one of {', '.join(NAMED_WORKLOADS)}, got {name!r}")
    return NAMED_WORKLOADS[name](**kw)


def workload(name_or_path: str, **kw) -> list[WorkloadItem]:
    """What `cutlass-byoc tune NAME_OR_PATH` tunes: the named workload (`kw`: its batch, dtype, kinds, arch) unless
    a file of that name exists, else the workload file (which carries its own batch and types; `kinds`, if given,
    keeps those kinds' problems of it, as `--kinds` does for a named workload)."""
    if name_or_path in NAMED_WORKLOADS and not Path(name_or_path).exists():
        return named_workload(name_or_path, **kw)
    if not Path(name_or_path).exists():
        raise WorkloadError(f"workload: expected a JSON file or one of {', '.join(NAMED_WORKLOADS)}, got "
                            f"{name_or_path!r}: no such file")
    items = load_workload(name_or_path)
    if kw.get("kinds"):
        kinds = {ConvKind(k) for k in kw["kinds"]}
        items = [it for it in items if it.problem.kind in kinds]
        if not items:
            raise WorkloadError(f"{name_or_path}: no problems of the kinds {', '.join(sorted(k.value for k in kinds))}")
    return items


def _layer_problems(entry: dict, defaults: dict, where: str) -> list[WorkloadItem]:
    e = {**defaults, **entry}
    try:
        r = int(e["r"])
        s = int(e.get("s", r))
        h = int(e.get("h", e.get("hw", 0)))
        w = int(e.get("w", e.get("hw", h)))
        if not h:
            raise WorkloadError(f"{where}: expected 'hw' or 'h' and 'w'")
        stride = e.get("stride", 1)
        padding = e.get("padding", (r // 2, s // 2))
        kinds = [ConvKind(k) for k in e.get("kinds", [k.value for k in KINDS])]
        name = str(e.get("name", where))
        return [
            WorkloadItem(name, Conv2dProblem.make(
                kind, int(e.get("n", e.get("batch", 32))), int(e["c"]), h, w, int(e["k"]), r, s, stride=stride,
                padding=padding, dilation=e.get("dilation", 1), groups=int(e.get("groups", 1)),
                dtype=e.get("dtype", "f16"), out_dtype=e.get("out_dtype"), acc_dtype=e.get("acc_dtype", "f32"),
            ), bool(e.get("resnet50", False)))
            for kind in kinds
        ]
    except KeyError as ex:
        raise WorkloadError(f"{where}: missing field {ex}") from None
    except (ProblemError, ValueError, TypeError) as ex:
        if isinstance(ex, WorkloadError):
            raise
        raise WorkloadError(f"{where}: {ex}") from None


def load_workload(path: str | Path) -> list[WorkloadItem]:
    """Problems from a JSON file (see the module docstring for the two accepted forms)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except ValueError as e:
        raise WorkloadError(f"{path}: not valid JSON ({e})") from None
    items: list[WorkloadItem] = []
    if isinstance(data, dict) and "layers" in data:
        defaults = {k: v for k, v in data.items() if k != "layers"}
        if "batch" in defaults:
            defaults["n"] = defaults.pop("batch")
        for i, entry in enumerate(data["layers"]):
            items += _layer_problems(entry, defaults, f"{path}: layers[{i}]")
    elif isinstance(data, list):
        for i, entry in enumerate(data):
            where = f"{path}: [{i}]"
            if not isinstance(entry, dict):
                raise WorkloadError(f"{where}: expected an object, got {type(entry).__name__}")
            if "kind" in entry:
                try:
                    p = Conv2dProblem.from_dict({k: v for k, v in entry.items() if k != "name"})
                except (ProblemError, ValueError, TypeError) as e:
                    raise WorkloadError(f"{where}: {e}") from None
                items.append(WorkloadItem(str(entry.get("name", p.name)), p))
            else:
                items += _layer_problems(entry, {}, where)
    else:
        raise WorkloadError(f"{path}: expected an object with 'layers' or a list of problems")
    if not items:
        raise WorkloadError(f"{path}: no problems")
    return items


def dump_workload(items: Sequence[WorkloadItem], path: str | Path) -> None:
    Path(path).write_text(json.dumps([{"name": it.layer, **it.problem.to_dict()} for it in items], indent=1))
