"""Random conv programs through the backend on the CPU, against eager and float64: a search for partitioner defects
(a wrong result, a crash of the user's compile, a gradient lost) on patterns no model of the zoo check has.

    python scripts/fuzz_partition.py [--seeds 0:200] [--inductor-every 0] [--json out.jsonl] [--show] [--no-plan]
        [--option NAME=VALUE ...]   # a backend option on every program, e.g. bn_sums=true

Each seed builds one random program (`generate`): a few convs (plain, grouped, depthwise, transposed, dilated,
strided, reflect/circular/replicate padding, 'same' and 'valid', weight-standardised, shared by two calls, two
convs reading one input), each followed by a random tail of what models put there: activations fused or not
(ReLU, in-place ReLU, ReLU6, hardtanh with other bounds, leaky ReLU, GELU erf and tanh, SiLU written out, ...),
batch norm (running or batch statistics), a bias or scale parameter, a residual in either order, the conv's output
used twice or returned, casts, channel and spatial slices, concatenation, pooling, padding, a squeeze-excitation
gate, a layout round trip. It runs in channels_last or NCHW, in fp32 or under CPU bf16 autocast, for training (input
and parameter gradients) or inference, with random backend options (`fuse_epilogue`, `fuse_casts`,
`fuse_bn_stats`, `bn_sums`, `overlap_wgrad`, `transposed`, `channels_last`).

`check` compiles it with `make_backend(require_cuda=False, strict=True, inductor=...)` (the partitioned graph run
eagerly, or by Inductor's CPU code, each offloaded call on its PyTorch reference), runs eager on a copy, and compares
both with a float64 copy: the output(s) (values, dtype and shape), the input gradient and every parameter's gradient.
Then it builds each offloaded problem's tuning plan and renders its kernels' sources (what `select="tune"` and
`cutlass-byoc tune` do first; `--no-plan` skips it). What is flagged:
- a value whose error (in norm or in its largest element, relative to the truth's; gradients' scales floored at
  1e-3 of the largest gradient's norm) is over 1e-4 (3e-2 under bf16) and over 10x eager's; a gradient that vanishes
  in exact arithmetic (under that floor) only when the error is 100x over;
- a gradient eager has and we do not; an output of another dtype or shape than eager's;
- a crash of the compile or of the plan (strict: a partitioning failure raises), with its traceback, unless plain
  torch.compile (Inductor, or for the eager graphs `aot_eager_decomp_partition`: AOT autograd with Inductor's
  decompositions and min-cut partitioner, as the backend's eager graphs have) fails on the program too; a flagged
  value whose error plain torch.compile has too (both counted apart: PyTorch's own, e.g. a meta kernel's strides,
  Inductor's CPU lowering of another op, or a decomposed op's rounding at an activation's kink); an aten op's
  stride check failing in Inductor's code (counted apart: its CPU kernel's output strides are not its meta kernel's,
  as the padding modes' backward with a channels_last input);
- through Inductor's CPU code, a flagged value only when it is not Inductor's own: counted apart where the same program
  with the partitioned graphs run eagerly is right and every partitioned graph's metadata holds (each node run on
  random inputs gives the shape and strides its meta['val'] says, `meta_mismatches`), as Inductor's CPU code of a
  16-bit circular padding copied to channels_last is wrong without this backend too (seed 14230, `_inductor_cpu_wrong`);
- under bf16 a flagged gradient only when the same program in fp32 is flagged too (bf16 moves an element across a
  ReLU's kink, and one element changes a bias gradient summed over a few pixels by a whole term);
- on the GPU (`--device cuda`) an fp32 program's flagged value only when its error is also 10x over that of eager
  with every conv's operands rounded to TF32 first (`TF32Convs`): our fp32 kernels multiply in TF32, as cuDNN's do
  where it picks a tensor-core kernel, but on a few channels it takes full fp32, and a bias gradient summed over
  terms that cancel magnifies TF32's rounding (seed 16: 7.0e-3 in both, eager 1.7e-6).
Exit status 1 when a program failed. oneDNN is off (a crash of eager's own conv in torch 2.13 CPU, see `main`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

#: the tails' elementwise functions (the partitioner fuses some, must leave the look-alikes)
FUNCTIONS = {
    "relu": torch.relu,
    "relu_": lambda y: y.relu_(),
    "relu6": F.relu6,
    "hardtanh_0_6": lambda y: F.hardtanh(y, 0.0, 6.0),
    "hardtanh_other": lambda y: F.hardtanh(y, -0.5, 2.0),
    "clamp_min0": lambda y: y.clamp(min=0),
    "clamp": lambda y: y.clamp(-1.0, 1.0),
    "leaky_relu": lambda y: F.leaky_relu(y, 0.1),
    "elu": F.elu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "silu_written": lambda y: y * torch.sigmoid(y),
    "sigmoid": torch.sigmoid,
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
    "mul_scalar": lambda y: y * 0.5,
    "add_scalar": lambda y: y + 0.25,
    "neg": lambda y: -y,
    "roundtrip_bf16": lambda y: y if y.dtype == torch.float64 else y.to(torch.bfloat16).float(),
    "to_float": lambda y: y if y.dtype == torch.float64 else y.float(),  # the float64 truth stays float64
    "contiguous": lambda y: y.contiguous(),
    "layout_roundtrip": lambda y: y.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
    "slice_hw": lambda y: y[:, :, 1:, 1:],
    "slice_c": lambda y: y[:, : max(1, y.shape[1] // 2)],
    "max_pool": lambda y: F.max_pool2d(y, 2, ceil_mode=True),
    "avg_pool": lambda y: F.avg_pool2d(y, 2, ceil_mode=True),
    "pad_asym": lambda y: F.pad(y, (1, 0, 0, 1)),
    "upsample": lambda y: F.interpolate(y, scale_factor=2, mode="nearest"),
    "channel_shuffle": lambda y: y.view(y.shape[0], 2, y.shape[1] // 2, *y.shape[2:]).transpose(1, 2)
    .reshape(y.shape),
}
#: the activations' weight in the tails (the fusable ones more often)
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}
FUNCTION_WEIGHTS = {"relu": 6, "relu_": 2, "relu6": 2, "silu": 3, "gelu": 2, "sigmoid": 2, "hardswish": 2}


@dataclasses.dataclass
class Program:
    """A random conv program: instructions over a list of values (vals[0] is the input), the modules and parameters
    they use, and which values are returned."""

    seed: int
    shape: tuple
    channels_last: bool
    training: bool
    autocast: bool
    options: dict
    inductor: bool
    steps: list  # (op, name, *source indices)
    outputs: list
    text: list  # one line per step, for the report
    batches: tuple = ()  # batch sizes run after the first through the same compiled model (a dynamic batch)
    device: str = "cpu"  # where it runs: "cpu" (the ops' PyTorch reference) or "cuda" (the kernels)
    amp: str = "bf16"  # autocast's dtype where `autocast`

    def describe(self) -> str:
        head = (f"seed {self.seed}: on {self.device}, input {self.shape} "
                f"{'channels_last' if self.channels_last else 'NCHW'}, "
                f"{'training' if self.training else 'inference'}{f', {self.amp} autocast' if self.autocast else ''}, "
                f"{'inductor' if self.inductor else 'eager'} graphs, options {self.options}")
        if self.batches:
            head += f", then batches {', '.join(map(str, self.batches))} through the same compiled model"
        return "\n".join([head] + [f"  v{i + 1} = {t}" for i, t in enumerate(self.text)] +
                         [f"  return {', '.join(f'v{i}' for i in self.outputs)}"])


class Net(nn.Module):
    def __init__(self, program: Program, modules: dict, params: dict) -> None:
        super().__init__()
        self.program = program
        self.mods = nn.ModuleDict(modules)
        self.params = nn.ParameterDict(params)

    def forward(self, x):
        vals = [x]
        for op, name, *src in self.program.steps:
            a = vals[src[0]]
            if op == "mod":
                y = self.mods[name](a)
            elif op == "fn":
                y = FUNCTIONS[name](a)
            elif op == "ws_conv":  # weight standardisation (BiT, NFNet): computed on the weight before the conv
                conv = self.mods[name]
                w = conv.weight
                w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.var((1, 2, 3), keepdim=True, unbiased=False) + 1e-5
                                                             ).sqrt()
                y = F.conv2d(a, w, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
            elif op == "add_param":
                y = a + self.params[name].view(1, -1, 1, 1)
            elif op == "mul_param":
                y = a * self.params[name].view(1, -1, 1, 1)
            elif op == "add":
                y = a + vals[src[1]]
            elif op == "mul":
                y = a * vals[src[1]]
            elif op == "cat":
                y = torch.cat([a, vals[src[1]]], 1)
            elif op == "se":  # squeeze-excitation gate: a 1x1 conv on the pooled map
                y = a * torch.sigmoid(self.mods[name](a.mean((2, 3), keepdim=True)))
            else:
                raise AssertionError(op)
            vals.append(y)
        outs = [vals[i] for i in self.program.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def _conv(rng: random.Random, c: int, h: int, w: int) -> tuple[nn.Module, str]:
    """A random conv2d or transposed conv on c channels of h x w (its output at least 1 x 1)."""
    for _ in range(100):
        transposed = rng.random() < 0.12
        kind = rng.choice(["plain"] * 5 + ["depthwise", "grouped", "pointwise", "pointwise"])
        k = rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
        groups = 1
        if kind == "depthwise":
            groups, k = c, c * rng.choice([1, 1, 1, 2])
        elif kind == "grouped":
            divisors = [g for g in range(2, c + 1) if c % g == 0]
            if divisors:
                groups = rng.choice(divisors)
                k = groups * rng.choice([1, 2, 3])
        if kind == "pointwise":
            r = s = 1
        else:
            r, s = rng.choice([(1, 1), (3, 3), (3, 3), (3, 3), (5, 5), (7, 7), (1, 3), (3, 1), (2, 2), (1, 7)])
        stride = rng.choice([1, 1, 1, 2, 2, (1, 2), 3])
        dilation = rng.choice([1] * 6 + [2, (1, 2)])
        bias = rng.random() < 0.4
        mode = "zeros"
        if transposed:
            sh, sw = (stride, stride) if isinstance(stride, int) else stride
            dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
            padding = rng.choice([0, (r // 2, s // 2), 1])
            ph, pw = (padding, padding) if isinstance(padding, int) else padding
            out_pad = rng.choice([0, 0, 1]) if min(sh, sw) > 1 else 0
            p = (h - 1) * sh - 2 * ph + dh * (r - 1) + out_pad + 1
            q = (w - 1) * sw - 2 * pw + dw * (s - 1) + out_pad + 1
            if p < 1 or q < 1 or p > 40 or q > 40:
                continue
            return (nn.ConvTranspose2d(c, k, (r, s), stride, padding, out_pad, groups, bias, dilation),
                    f"ConvTranspose2d({c}, {k}, {(r, s)}, stride={stride}, padding={padding}, "
                    f"output_padding={out_pad}, groups={groups}, bias={bias}, dilation={dilation})")
        same = stride == 1 and rng.random() < 0.2
        padding = "same" if same else rng.choice([0, 1, (r // 2, s // 2), (r // 2, s // 2), "valid", 2])
        if padding not in ("same", "valid") and rng.random() < 0.15:
            mode = rng.choice(["reflect", "circular", "replicate"])
        sh, sw = (stride, stride) if isinstance(stride, int) else stride
        dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
        if padding == "same":
            ph, pw = dh * (r - 1) // 2, dw * (s - 1) // 2
            p, q = h, w
        else:
            ph, pw = (0, 0) if padding == "valid" else (padding, padding) if isinstance(padding, int) else padding
            p = (h + 2 * ph - dh * (r - 1) - 1) // sh + 1
            q = (w + 2 * pw - dw * (s - 1) - 1) // sw + 1
        if p < 1 or q < 1 or (mode != "zeros" and (ph >= h or pw >= w)):
            continue
        return (nn.Conv2d(c, k, (r, s), stride, padding, dilation, groups, bias, padding_mode=mode),
                f"Conv2d({c}, {k}, {(r, s)}, stride={stride}, padding={padding!r}, dilation={dilation}, "
                f"groups={groups}, bias={bias}, padding_mode={mode!r})")
    raise AssertionError("no conv fits")


def generate(seed: int, inductor: bool = False, device: str = "cpu", amp: str = "bf16"
             ) -> tuple[Program, Net, torch.Tensor]:
    """The program of `seed`, its module (random weights, batch norms' running statistics randomised) and input, on
    the CPU (`check` moves them to the program's device). The program does not depend on `device` or `amp`."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n, c = rng.choice([1, 2, 2, 3]), rng.choice([1, 2, 3, 4, 6, 8, 16])
    h, w = rng.randint(4, 14), rng.randint(4, 14)
    training = rng.random() < 0.7
    program = Program(seed=seed, shape=(n, c, h, w), channels_last=rng.random() < 0.6, training=training,
                      device=device, amp=amp,
                      autocast=rng.random() < 0.3, inductor=inductor, steps=[], outputs=[], text=[],
                      options={k: v for k, v in (("fuse_epilogue", rng.random() < 0.85),
                                                 ("fuse_casts", rng.random() < 0.85),
                                                 ("fuse_bn_stats", rng.random() < 0.3),
                                                 ("overlap_wgrad", rng.choice([0, 0, 0, 1, 2]) if training else 0),
                                                 ("transposed", rng.random() < 0.9),
                                                 ("channels_last", rng.random() < 0.9)) if v != _DEFAULTS[k]})
    modules: dict = {}
    params: dict = {}
    x = torch.randn(n, c, h, w)
    vals = [x]  # eager values while generating, for the shapes

    def emit(op, name, srcs, text):
        program.steps.append((op, name, *srcs))
        program.text.append(text)
        net = Net(program, modules, params)
        with torch.no_grad():
            net.eval()
            for m in net.modules():  # batch norm on running statistics: generation only needs the shapes
                m.training = False
            try:
                y = _last_value(net, x)
            except RuntimeError:  # e.g. a conv called again on a smaller image: drop the step
                program.steps.pop()
                program.text.pop()
                return None
        vals.append(y)
        return len(vals) - 1

    def conv_on(src):
        cur = vals[src]
        conv, text = _conv(rng, cur.shape[1], cur.shape[2], cur.shape[3])
        name = f"conv{len(modules)}"
        modules[name] = conv
        if isinstance(conv, nn.Conv2d) and conv.padding_mode == "zeros" and rng.random() < 0.1 and \
                conv.weight[0].numel() >= 4:  # (a fan-in of 1 standardises the weight to 0)
            return emit("ws_conv", name, [src], f"weight-standardised {text}(v{src})"), name
        return emit("mod", name, [src], f"{text}(v{src})"), name

    cur = 0
    for _ in range(rng.randint(1, 4)):
        cur, conv_name = conv_on(cur)
        if rng.random() < 0.08:  # the same conv (its weight) called again: two wgrads summed
            y = vals[cur]
            conv = modules[conv_name]
            if isinstance(conv, nn.Conv2d) and conv.in_channels == y.shape[1] and conv.padding_mode == "zeros":
                cur = emit("mod", conv_name, [cur], f"{conv_name} again(v{cur})") or cur
        if rng.random() < 0.08:  # a second conv on the conv's input: two dgrads summed
            src = program.steps[cur - 1][2]
            other, _ = conv_on(src)
            if vals[other].shape == vals[cur].shape:
                cur = emit("add", "", [cur, other], f"v{cur} + v{other}") or cur
        for _ in range(rng.choices([0, 1, 2, 3, 4], [2, 4, 3, 2, 1])[0]):
            y = vals[cur]
            k = y.shape[1]
            pick = rng.random()
            if pick < 0.45:
                names = [f for f in FUNCTIONS if _fits(f, y)]
                name = rng.choices(names, [FUNCTION_WEIGHTS.get(f, 1) for f in names])[0]
                if name == "relu_" and any(s[0] in ("add", "mul", "cat") and cur in s[2:] for s in program.steps):
                    name = "relu"  # in place on a value another step already read: eager's autograd refuses
                cur = emit("fn", name, [cur], f"{name}(v{cur})") or cur
            elif pick < 0.6:
                name = f"bn{len(modules)}"
                bn = nn.BatchNorm2d(k)
                with torch.no_grad():
                    bn.running_mean.uniform_(-0.5, 0.5)
                    bn.running_var.uniform_(0.5, 2.0)
                    bn.weight.uniform_(0.5, 1.5)
                    bn.bias.uniform_(-0.5, 0.5)
                frozen = not training or y.shape[0] * y.shape[2] * y.shape[3] < 16 or rng.random() < 0.4
                bn.train(not frozen)
                bn._fuzz_frozen = frozen
                modules[name] = bn
                text = f"BatchNorm2d({k}){' (running stats)' if frozen else ''}(v{cur})"
                cur = emit("mod", name, [cur], text) or cur
            elif pick < 0.68:
                name, op = f"p{len(params)}", rng.choice(["add_param", "mul_param"])
                params[name] = nn.Parameter(torch.randn(k) * 0.5 + (1.0 if op == "mul_param" else 0.0))
                cur = emit(op, name, [cur], f"v{cur} {'+' if op == 'add_param' else '*'} {name}") or cur
            elif pick < 0.8:
                same = [i for i in range(len(vals) - 1) if vals[i].shape == y.shape and i != cur]
                if same:
                    other = rng.choice(same)
                    a, b = (cur, other) if rng.random() < 0.5 else (other, cur)
                    op = rng.choice(["add", "add", "add", "mul"])
                    cur = emit(op, "", [a, b], f"v{a} {'+' if op == 'add' else '*'} v{b}") or cur
            elif pick < 0.86:  # the conv's output used twice: by an activation and by a sum with its result
                act = rng.choice(["relu", "silu", "sigmoid", "gelu"])
                z = emit("fn", act, [cur], f"{act}(v{cur})")
                if z is not None:
                    cur = emit("add", "", [z, cur], f"v{z} + v{cur}") or cur
            elif pick < 0.9:
                program.outputs.append(cur)  # an intermediate returned too
            elif pick < 0.94 and len(vals) > 1:
                same_hw = [i for i in range(len(vals) - 1) if vals[i].shape[2:] == y.shape[2:]
                           and vals[i].shape[0] == y.shape[0] and i != cur]
                if same_hw:
                    other = rng.choice(same_hw)
                    cur = emit("cat", "", [cur, other], f"cat(v{cur}, v{other})") or cur
            else:
                name = f"se{len(modules)}"
                modules[name] = nn.Conv2d(k, k, 1)
                text = f"v{cur} * sigmoid(Conv2d({k}, {k}, 1)(mean_hw(v{cur})))"
                cur = emit("se", name, [cur], text) or cur
    program.outputs.append(cur)
    program.outputs = list(dict.fromkeys(program.outputs))
    if program.outputs == [0]:
        program.outputs = [cur]
    if rng.random() < 0.2:  # a second batch size: torch.compile recompiles with a symbolic batch
        program.batches = (rng.choice([b for b in (1, 2, 3, 4) if b != n]),)
    if rng.random() < 0.3:  # drawn last, so that the seeds before this option keep their programs; on by default,
        program.options["bn_sums"] = False  # so the draw turns it off (Inductor's Welford statistics)
    net = Net(program, modules, params)
    net.train(training)
    for m in net.modules():
        if getattr(m, "_fuzz_frozen", False):
            m.eval()
    if program.channels_last:
        net = net.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return program, net, x


_DEFAULTS = {"fuse_epilogue": True, "fuse_casts": True, "fuse_bn_stats": False, "bn_sums": True, "overlap_wgrad": 0,
             "transposed": True, "channels_last": True}


def _fits(name: str, y: torch.Tensor) -> bool:
    if name == "channel_shuffle":
        return y.shape[1] % 2 == 0
    if name == "slice_hw":
        return min(y.shape[2:]) > 2
    if name in ("max_pool", "avg_pool"):
        return min(y.shape[2:]) >= 2
    if name == "upsample":
        return max(y.shape[2:]) <= 12
    if name == "relu_":
        return y._base is None  # not a view of another value
    return True


def _last_value(net: Net, x: torch.Tensor) -> torch.Tensor:
    saved = net.program.outputs
    net.program.outputs = [len(net.program.steps)]
    try:
        return net(x)
    finally:
        net.program.outputs = saved


def _outputs(out) -> list:
    return list(out) if isinstance(out, tuple) else [out]


def _step(model: nn.Module, x: torch.Tensor, program: Program, weights: list, run=None):
    """(outputs, input gradient, parameter gradients) of one step of `model` (or `run`), the gradients float64."""
    x = x.clone().requires_grad_(program.training)
    amp = torch.autocast(x.device.type, dtype=AMP[program.amp]) if program.autocast and x.dtype != torch.float64 \
        else contextlib.nullcontext()
    if not program.training:
        with torch.no_grad(), amp:
            outs = _outputs((model if run is None else run)(x))
        return [o.detach() for o in outs], None, {}
    with amp:
        outs = _outputs((model if run is None else run)(x))
    sum((o.double() * wt).sum() for o, wt in zip(outs, weights)).backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return [o.detach() for o in outs], x.grad.double() if x.grad is not None else None, grads


def _error(ours: torch.Tensor, truth: torch.Tensor, floor: float = 0.0) -> float:
    """Relative error in norm and in the largest element, the larger of the two; `floor` bounds the scales from below
    (a gradient that is zero in exact arithmetic, such as a conv's bias before a training batch norm, is noise)."""
    if not torch.isfinite(ours).all():
        return float("inf")
    d = ours - truth
    return max((d.norm() / max(truth.norm().item(), floor, 1e-30)).item(),
               (d.abs().max() / max(truth.abs().max().item(), floor, 1e-30)).item())


#: where our fp32 kernels multiply in TF32 (the tests add "cpu", its calls' references under TF32Convs)
TF32_DEVICES = {"cuda"}


def tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 `t` rounded to TF32 (10 mantissa bits, to nearest, ties away), layout kept: what a tensor core reads."""
    bits = t.view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


class TF32Convs(TorchDispatchMode):
    """Every aten convolution (forward and backward) with its fp32 operands rounded to TF32 first (`tf32`; not the
    bias, which an epilogue adds in fp32): eager with the rounding our fp32 kernels have, whatever kernel PyTorch
    picks for the conv itself."""

    OPERANDS = {torch.ops.aten.convolution.default: 2, torch.ops.aten.convolution_backward.default: 3}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = self.OPERANDS.get(func, 0)
        args = tuple(tf32(a) if i < n and isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                     for i, a in enumerate(args))
        return func(*args, **(kwargs or {}))


def _tf32_steps(program: Program, net: nn.Module, steps: list) -> list:
    """The program's eager steps with TF32Convs (the flagged-error baseline of an fp32 program on the GPU)."""
    eager = copy.deepcopy(net)
    with TF32Convs():
        return [_step(eager, x, program, weights) for x, weights, _, _ in steps]


def _plain_steps(program: Program, net: nn.Module, steps: list) -> Optional[list]:
    """The program's steps through torch.compile without this backend, or None where that fails: Inductor, or for
    the eager graphs AOT autograd with Inductor's decompositions and partitioner (`aot_eager_decomp_partition`), as
    the backend runs them (not `aot_eager`: a decomposed batch norm rounds differently, and seed 3547's element at 1 +
    2.4e-7 in eager, exactly 1.0 decomposed, passes clamp(-1, 1)'s gradient: 0.12 off in dx under either)."""
    torch._dynamo.reset()
    plain = copy.deepcopy(net)
    try:
        compiled = torch.compile(plain, backend="inductor" if program.inductor else "aot_eager_decomp_partition")
        return [_step(plain, x, program, weights, run=compiled) for x, weights, _, _ in steps]
    except Exception:  # noqa: BLE001
        return None


@contextlib.contextmanager
def _graph_checks(checks: list):
    """While inside: each graph the backend's pass partitions is run node by node on random inputs right after the
    pass, its nodes' real strides and shapes compared with the metadata the pass left (what Inductor lowers from);
    `checks` gets each graph's mismatches (empty: the metadata holds)."""
    from cutlass_byoc.offload import backend as offload_backend  # noqa: PLC0415

    partition = offload_backend.partition

    def checked(graph, *args, **kwargs):
        report = partition(graph, *args, **kwargs)
        try:
            checks.append(meta_mismatches(graph))
        except Exception as e:  # noqa: BLE001 - an op that cannot run on random inputs: nothing proven either way
            checks.append([f"not checked: {type(e).__name__}: {str(e)[:200]}"])
        return report

    offload_backend.partition = checked
    try:
        yield checks
    finally:
        offload_backend.partition = partition


def meta_mismatches(graph) -> list:
    """The nodes of a partitioned graph whose real output (shape, strides), run eagerly on random inputs of the
    placeholders' metadata, is not what their meta['val'] says."""
    import torch.fx as fx  # noqa: PLC0415
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # noqa: PLC0415

    out, env = [], {}
    with unset_fake_temporarily(), torch.no_grad():
        for n in graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder":
                if not isinstance(v, torch.Tensor):
                    env[n] = _hint(v) if isinstance(v, torch.SymInt) else v
                    continue
                shape = [_hint(s) for s in v.shape]
                data = (torch.randn(shape, dtype=v.dtype) if v.dtype.is_floating_point else
                        torch.zeros(shape, dtype=v.dtype))
                env[n] = data.as_strided(shape, [_hint(s) for s in v.stride()]) if data.numel() else data
                continue
            if n.op != "call_function":
                continue
            args = fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
            env[n] = r = n.target(*args, **kwargs)
            if isinstance(r, torch.Tensor) and isinstance(v, torch.Tensor) and r.numel() > 1 and (
                    tuple(r.shape) != tuple(_hint(s) for s in v.shape) or _strides(r) != _strides(v)):
                out.append(f"{n.name}: {tuple(r.shape)} {r.stride()}, meta {tuple(v.shape)} {tuple(v.stride())}")
    return out


def _strides(t: torch.Tensor) -> tuple:
    """A tensor's strides where they matter: those of its dimensions longer than 1 (a size-1 dimension's stride
    addresses nothing, and PyTorch's ops and fake kernels set it differently)."""
    return tuple(_hint(st) if _hint(sz) > 1 else None for sz, st in zip(t.shape, t.stride()))


def _hint(size) -> int:
    """A size's value for the inputs the graph was traced with, without a guard: int() of a symbolic size would
    specialise the graph's shape environment to it, and Inductor then lowers the dynamic graph's expressions of that
    size as numbers (seed 15200, a batch norm's n / (n - 1) of a dynamic batch: "Cannot convert expression to
    float", a crash of this check's making)."""
    if isinstance(size, torch.SymInt):
        from torch.fx.experimental import symbolic_shapes  # noqa: PLC0415

        hint = getattr(symbolic_shapes, "optimization_hint", None)  # torch 2.13; size_hint before (deprecated since)
        return int(hint(size) if hint else size.node.shape_env.size_hint(size.node.expr))
    return int(size)


def _inductor_cpu_wrong(program: Program, net: nn.Module, x: torch.Tensor, checks: list) -> bool:
    """A value flagged under Inductor's CPU code is Inductor's own when the same program through the backend with
    its partitioned graphs run eagerly (each op as the graph says) is right, and every partitioned graph's metadata
    holds (so Inductor lowered a graph whose strides it was told truly): e.g. seed 14230, a circular padding of
    a bf16 channels_last tensor whose channels_last copy Inductor's CPU code computes wrongly in torch 2.13 without
    this backend too (`torch.compile(lambda t: F.pad(t, (1, 1, 1, 1), mode="circular").contiguous(memory_format=
    torch.channels_last))` on a bf16 or fp16 CPU tensor of 2 channels: wrong; fp32: right). Plain torch.compile of the
    program does not show it, since without the backend its convs' outputs stay NCHW."""
    if program.device != "cpu" or not program.inductor or not checks or any(checks):
        return False
    eager_graphs = check(dataclasses.replace(program, inductor=False), net, x, plan=False)
    return not failed(eager_graphs) and "invalid" not in eager_graphs


def _set_apart(rec: dict, key: str, program: Program, ours: list, steps: list, flagged: list, baseline: list) -> list:
    """What of `flagged` stays flagged where an error must also be 10x `baseline`'s steps'; the rest goes to
    rec[key] (counted apart, not failures)."""
    kept, _ = _compare_steps(program, ours, steps, baseline)
    if len(kept) < len(flagged):
        rec[key] = [f for f in flagged if f not in kept]
    return kept


def _compare_steps(program: Program, ours: list, steps: list, plain: Optional[list] = None) -> tuple[list, float]:
    """What is flagged over the batch sizes' steps (prefixed with the batch size after the first), our worst error;
    with `plain`, an error must also be 10x plain torch.compile's."""
    flagged, worst = [], 0.0
    for i, (step, (xi, _, truth, theirs)) in enumerate(zip(ours, steps)):
        found, w = _compare(program, step, theirs, truth, plain[i] if plain is not None else None)
        flagged += [f if i == 0 else f"N={xi.shape[0]}: {f}" for f in found]
        worst = max(worst, w)
    return flagged, worst


def _input(program: Program, batch: int, seed: int) -> torch.Tensor:
    x = torch.randn(batch, *program.shape[1:], generator=torch.Generator().manual_seed(seed)).to(program.device)
    return x.contiguous(memory_format=torch.channels_last) if program.channels_last else x


def plan_and_render(problems) -> int:
    """What `select="tune"` and `cutlass-byoc tune` do first with each offloaded problem, on the CPU: its plan (every
    family's candidates, channel padding and space-to-depth twins, split counts) and each planned kernel's source;
    the number of kernels rendered."""
    from cutlass_byoc.profiler.plan import plan_problem  # noqa: PLC0415
    from cutlass_byoc.render import render  # noqa: PLC0415

    kernels = list(dict.fromkeys(k for problem in dict.fromkeys(problems) for k in plan_problem(problem).kernels))
    for kernel in kernels:
        render(kernel, "nvcc")
    return len(kernels)


def check(program: Program, net: nn.Module, x: torch.Tensor, plan: bool = True,
          launches: Optional[list] = None) -> dict:
    """One program through the backend, eager and float64, then (`plan`) each offloaded problem's tuning plan and
    its kernels' sources; the record (see the module's docstring). `launches` gets the launches the partitioner
    chose at compile time."""
    from cutlass_byoc.offload import library  # noqa: PLC0415
    from cutlass_byoc.offload.backend import make_backend  # noqa: PLC0415
    from cutlass_byoc.offload.report import Pass  # noqa: PLC0415

    net, x = net.to(program.device), x.to(program.device)
    exact = copy.deepcopy(net).double()
    eager, mine = copy.deepcopy(net), copy.deepcopy(net)
    steps = []  # (input, projection weights, truth, eager's) of each batch size
    for i, b in enumerate((x.shape[0], *program.batches)):
        xi = x if i == 0 else _input(program, b, program.seed + 10 + i)
        with torch.no_grad():
            shapes = [o.shape for o in _outputs(_last_value_all(exact, xi.double()))]
        g = torch.Generator().manual_seed(program.seed + 1 + i)
        weights = [torch.randn(s, dtype=torch.float64, generator=g).to(program.device) for s in shapes]
        steps.append((xi, weights, _step(exact, xi.double(), program, weights), _step(eager, xi, program, weights)))
    # compile-time choices by the heuristic alone: no decision cache on this machine or the GPU's changes them, so
    # `fuzz_kernels` here names the kernels a GPU run launches
    options = {"select": "heuristic", **program.options, "strict": True}
    if program.device == "cpu":
        options["require_cuda"] = False
    backend = make_backend(options, inductor=program.inductor)
    torch._dynamo.reset()
    library.RUNTIME.clear()
    first_site = len(library._SITES)
    rec: dict = {"seed": program.seed}
    ours, checks = [], []
    try:
        with _graph_checks(checks) if program.device == "cpu" and program.inductor else contextlib.nullcontext():
            compiled = torch.compile(mine, backend=backend)
            for xi, weights, _, _ in steps:
                ours.append(_step(mine, xi, program, weights, run=compiled))
    except Exception as e:  # noqa: BLE001 - the user's compile would have crashed
        rec["crash"] = f"{type(e).__name__}: {str(e)[:400]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
        if _plain_steps(program, net, steps) is None:  # PyTorch's own (e.g. a meta kernel's strides), not ours
            rec["pytorch_crash"] = rec.pop("crash")
        elif "assert_size_stride" in rec["traceback"] and "Error in op: torch.ops.aten." in rec["crash"]:
            # an aten op whose CPU kernel's output strides are not its meta kernel's (the padding modes' backward
            # follows its input's memory format): Inductor's own layout choice for that input triggers it, which no
            # layout of ours can pin (partition.STRIDE_SENSITIVE restores what we changed)
            rec["aten_strides"] = rec.pop("crash")
        return rec
    if plan:
        try:
            rec["planned"] = plan_and_render([s.problem for s in library._SITES[first_site:]])
        except Exception as e:  # noqa: BLE001 - select="tune" (or `cutlass-byoc tune`) would have crashed
            rec["crash"] = f"planning: {type(e).__name__}: {str(e)[:400]}"
            rec["traceback"] = traceback.format_exc()[-3000:]
            return rec
    flagged, worst = _compare_steps(program, ours, steps)
    if flagged:  # where plain torch.compile is as wrong (Inductor's own lowering of another op), it is not ours
        plain = _plain_steps(program, net, steps)
        if plain is not None:
            flagged = _set_apart(rec, "pytorch_wrong", program, ours, steps, flagged, plain)
    if flagged and _inductor_cpu_wrong(program, net, x, checks):
        rec["inductor_cpu_wrong"], flagged = flagged, []
    if flagged and program.device in TF32_DEVICES and not program.autocast:  # TF32's rounding: see the docstring
        flagged = _set_apart(rec, "tf32_noise", program, ours, steps, flagged, _tf32_steps(program, net, steps))
    rep = [r for r in backend.reports]
    if launches is not None:
        launches += [launch for r in rep for launch in r.launches]
    rec.update(flagged=flagged, worst=worst,
               offloaded={k.value: sum(r.count(k) for r in rep) for k in Pass},
               bn_sums=sum(r.bn_sums for r in rep),
               left=sorted({e.reason.split(";")[0] for r in rep for e in r.entries if not e.offloaded}),
               reference_calls=library.RUNTIME.reference_calls)
    if program.device == "cuda":  # on the GPU a call on the reference fell back (its reason logged and kept here)
        rec.update(kernel_calls=dict(library.RUNTIME.kernel_calls), fallbacks=dict(library.RUNTIME.fallbacks))
    return rec


def _compare(program: Program, ours, theirs, truth, plain=None) -> tuple[list, float]:
    """(what is flagged, our worst error) of one step against eager's (and plain torch.compile's: an error as large
    there is not flagged) and the float64 truth's."""
    # bf16 / fp16 autocast; fp32 on the GPU runs TF32 (cuDNN's convs too, by default)
    floor = ({"bf16": 3e-2, "fp16": 1e-2}[program.amp] if program.autocast else
             3e-3 if program.device == "cuda" else 1e-4)
    flagged, worst = [], 0.0
    for i, (o, e) in enumerate(zip(ours[0], theirs[0])):
        if o.dtype != e.dtype or o.shape != e.shape:
            flagged.append(f"out{i}: {o.dtype} {tuple(o.shape)}, eager {e.dtype} {tuple(e.shape)}")
    pl = plain or ([None] * len(ours[0]), None, {})
    pairs = [(f"out{i}", o, e, t, 0.0, q) for i, (o, e, t, q) in enumerate(zip(ours[0], theirs[0], truth[0], pl[0]))]
    if program.training:
        grads = [truth[1]] + list(truth[2].values())
        scale = 1e-3 * max(g.norm().item() for g in grads if g is not None)
        pairs.append(("dx", ours[1], theirs[1], truth[1], scale, pl[1]))
        pairs += [(n, ours[2].get(n), theirs[2].get(n), t, scale, pl[2].get(n)) for n, t in truth[2].items()]
    for name, o, e, t, scale, q in pairs:
        if t is None:
            continue
        if o is None:
            if e is not None:
                flagged.append(f"{name}: no gradient")
            continue
        if o.shape != t.shape:
            flagged.append(f"{name}: shape {tuple(o.shape)} != {tuple(t.shape)}")
            continue
        ours_err = _error(o.double(), t, scale)
        eager_err = _error(e.double(), t, scale) if e is not None else 0.0
        if q is not None and q.shape == t.shape:
            eager_err = max(eager_err, _error(q.double(), t, scale))
        worst = max(worst, ours_err)
        # a gradient that vanishes in exact arithmetic (under the scale: a batch norm's bias before another training
        # batch norm) is rounding noise in every fp32 run, eager's smaller or larger by chance: only a gross error
        vanishing = t.norm().item() < scale
        if ours_err > (100 * floor if vanishing else floor) and ours_err > 10 * eager_err:
            flagged.append(f"{name}: error {ours_err:.2e} (eager {eager_err:.2e})")
    return flagged, worst


def _last_value_all(net: nn.Module, x: torch.Tensor):
    net.eval()
    try:
        return net(x)
    finally:
        net.train(net.program.training)
        for m in net.modules():
            if getattr(m, "_fuzz_frozen", False):
                m.eval()


def run_seed(seed: int, inductor: bool = False, plan: bool = True, device: str = "cpu", amp: str = "bf16",
             force: Optional[dict] = None) -> tuple[Program, dict]:
    """One seed's program checked; `force`: backend options set on it whatever the seed drew (--option)."""
    program, net, x = generate(seed, inductor, device, amp)
    if force:
        program.options = {**program.options, **force}
    try:
        rec = check(program, net, x, plan)
        grads_only = all(not f.startswith("out") for f in rec.get("flagged", []))
        if program.autocast and rec.get("flagged") and grads_only:
            # bf16 moves values across a ReLU's kink (an element at 3e-3 of the largest one becomes 0): one element
            # changes a bias gradient summed over a few pixels by a whole term. The same program in fp32 tells such
            # noise from a defect.
            fp32 = check(dataclasses.replace(program, autocast=False), net, x, plan=False)
            if not fp32.get("crash") and not fp32.get("flagged"):
                rec["bf16_noise"], rec["flagged"] = rec["flagged"], []
    except Exception as e:  # noqa: BLE001 - eager or float64 failed: the program is not valid, not a finding
        return program, {"seed": seed, "invalid": f"{type(e).__name__}: {str(e)[:300]}"}
    return program, rec


def fuzz_kernels(seeds, amp: str = "fp16") -> list:
    """The kernels `--device cuda` launches for these seeds on a cache without decisions (`scripts/warm_cache.py
    --fuzz` compiles them ahead): each program through the backend here under `amp` autocast (CPU autocast takes
    fp16 too), the launches chosen at compile time, which the call sites bind on the GPU (a dynamic batch's sizes
    bind the plan's launch where it takes them)."""
    launches: list = []
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # see main()
    try:
        for seed in seeds:
            program, net, x = generate(seed, amp=amp)
            try:
                check(program, net, x, plan=False, launches=launches)
            except Exception:  # noqa: BLE001 - eager refuses it: the GPU run skips it too
                continue
    finally:
        torch.backends.mkldnn.enabled = was
    return list(dict.fromkeys(launch.kernel for launch in launches))


def failed(rec: dict) -> bool:
    return bool(rec.get("crash") or rec.get("flagged"))


def forced_option(text: str) -> tuple[str, object]:
    """--option NAME=VALUE: an OffloadOptions field and a bool (true/false), int or float value."""
    from cutlass_byoc.offload import OffloadOptions  # noqa: PLC0415

    name, sep, raw = text.partition("=")
    fields = {f.name for f in dataclasses.fields(OffloadOptions)}
    if not sep or name not in fields:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME among {sorted(fields)}, got {text!r}")
    low = raw.strip().lower()
    if low in ("true", "false"):
        return name, low == "true"
    for kind in (int, float):
        try:
            return name, kind(raw)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"--option {name}: a bool, int or float, got {raw!r}")


def seed_range(text: str) -> range:
    """--seeds: A:B (B excluded) or one seed."""
    a, _, b = text.partition(":")
    try:
        seeds = range(int(a), int(b)) if b else range(int(a), int(a) + 1)
    except ValueError:
        seeds = range(0)
    if not seeds:
        raise argparse.ArgumentTypeError(f"expected A:B with integers A < B, or one integer seed, got {text!r}")
    return seeds


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=seed_range, default=range(0, 200), help="A:B (B excluded) or one seed")
    ap.add_argument("--inductor-every", type=int, default=0,
                    help="every n-th seed through Inductor's CPU code instead of the eager graph (0: none)")
    ap.add_argument("--json", default=None, help="also write one JSON line per seed here")
    ap.add_argument("--show", action="store_true", help="print each program")
    ap.add_argument("--no-plan", action="store_true", help="skip the tuning plans and the kernels' sources")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the programs on the GPU through the kernels (no plans; kernels compiled on demand "
                         "unless `scripts/warm_cache.py --fuzz` compiled them)")
    ap.add_argument("--amp", choices=("bf16", "fp16"), default=None,
                    help="autocast's dtype in the programs that use it (default: bf16 on the CPU, fp16 on the GPU)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", type=forced_option,
                    help="a backend option set on every program (a bool, int or float; e.g. bn_sums=true), whatever "
                         "its seed drew; repeatable")
    a = ap.parse_args(argv)
    # a left conv logs its reason (the report counts them); PyTorch's own CPU convolutions, not oneDNN's: with oneDNN,
    # torch 2.13 CPU's eager Conv2d(16, 6, 1, stride=3, padding=2, dilation=(1, 2)) on a channels_last 2x16x2x1 input
    # crashes the process (segfault; seed 523). Both restored on return (a caller in the same process, tests).
    was = torch.backends.mkldnn.enabled
    logging.disable(logging.WARNING)
    torch.backends.mkldnn.enabled = False
    try:
        return _run(a)
    finally:
        logging.disable(logging.NOTSET)
        torch.backends.mkldnn.enabled = was


def _run(a: argparse.Namespace) -> int:
    amp = a.amp or ("fp16" if a.device == "cuda" else "bf16")
    t0 = time.perf_counter()
    bad = invalid = theirs = noise = tf32_noise = strides = inductor_cpu = 0
    totals: dict = {}
    for seed in a.seeds:
        program, rec = run_seed(seed, bool(a.inductor_every) and seed % a.inductor_every == 0,
                                not a.no_plan and a.device == "cpu", a.device, amp, dict(a.option))
        invalid += "invalid" in rec
        theirs += "pytorch_crash" in rec or bool(rec.get("pytorch_wrong"))
        strides += "aten_strides" in rec
        inductor_cpu += bool(rec.get("inductor_cpu_wrong"))
        noise += bool(rec.get("bf16_noise"))
        tf32_noise += bool(rec.get("tf32_noise"))
        for k, v in rec.get("offloaded", {}).items():
            totals[k] = totals.get(k, 0) + v
        if rec.get("bn_sums"):
            totals["bn_sums"] = totals.get("bn_sums", 0) + rec["bn_sums"]
        if a.show or failed(rec):
            print(program.describe())
        if failed(rec):
            bad += 1
            print(f"  FAILED: {rec.get('crash') or '; '.join(rec['flagged'])}")
            if rec.get("traceback"):
                print("  " + rec["traceback"].replace("\n", "\n  "))
        elif a.show:
            print(f"  ok: worst {rec.get('worst', 0):.1e}, offloaded {rec.get('offloaded')}, "
                  f"{rec.get('invalid', '')}")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(rec) + "\n")
    print(f"{len(a.seeds)} programs, {bad} failed, {invalid} invalid (eager itself refused them), {theirs} failed or "
          f"wrong under plain torch.compile too, {inductor_cpu} wrong only in Inductor's CPU code (right with the graphs "
          f"run eagerly, their metadata holding), {strides} with an aten op's strides not its meta's, {noise} with "
          f"16-bit gradient noise only, {tf32_noise} with TF32 rounding noise only; passes offloaded: {totals}; "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
