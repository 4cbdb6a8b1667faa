"""A conv2d problem: what to compute, independent of how.

Layouts are fixed: activations NHWC, filters KRSC (the channels_last layouts of PyTorch). The three kinds
read and write these tensors (CUTLASS's naming of the implicit GEMM operands A, B and the output D):

=======  ==========  ==========  ==========  ======================  =====================
kind     A           B           D (output)  GEMM M x N              GEMM K (reduction)
=======  ==========  ==========  ==========  ======================  =====================
fprop    x  NHWC     w  KRSC     y  NPQK     N*P*Q x K               C*R*S
dgrad    dy NPQK     w  KRSC     dx NHWC     N*H*W x C               K*R*S
wgrad    dy NPQK     x  NHWC     dw KRSC     K x C*R*S               N*P*Q
=======  ==========  ==========  ==========  ======================  =====================
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .types import Activation, ConvKind, DType, SourceKind

INT32_MAX = 2**31 - 1

#: Alignments (elements per vectorised access) the kernels are generated for, widest first.
ALIGNMENTS = (8, 4, 2, 1)


class ProblemError(ValueError):
    """A problem description that no kernel could compute; the message names the parameter."""


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What happens to the accumulator before it is stored: act(alpha * acc + beta * source)."""

    activation: Activation = Activation.IDENTITY
    source: SourceKind = SourceKind.NONE
    #: The bias's element type where it differs from the output's (an fp32 bias under a 16-bit output); None: the
    #: output's type. Conv2dProblem normalises a bias_dtype equal to its output type to None.
    bias_dtype: Optional[DType] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation", Activation(self.activation))
        object.__setattr__(self, "source", SourceKind(self.source))
        if self.bias_dtype is not None:
            object.__setattr__(self, "bias_dtype", DType(self.bias_dtype))

    @property
    def bias_vector(self) -> bool:
        """Whether a kernel needs a separate bias-vector operand for this epilogue: a bias together with a residual,
        or a bias whose type is not the output's (the plain kernels read the bias as C, in the output's type)."""
        return self.source is SourceKind.BIAS_RESIDUAL or (self.source is SourceKind.BIAS and self.bias_dtype is not None)

    @property
    def tag(self) -> str:
        parts = []
        if self.source is not SourceKind.NONE:
            parts.append(self.source.value + (f"_{self.bias_dtype.value}" if self.bias_dtype is not None else ""))
        if self.activation is not Activation.IDENTITY:
            parts.append(self.activation.value)
        return "+".join(parts) or "linear"


@dataclasses.dataclass(frozen=True)
class Conv2dProblem:
    """One 2-D convolution pass. Sizes follow PyTorch: x is N x C x H x W (stored NHWC), w is K x C x R x S."""

    kind: ConvKind
    n: int
    h: int
    w: int
    c: int
    k: int
    r: int
    s: int
    pad_h: int = 0
    pad_w: int = 0
    stride_h: int = 1
    stride_w: int = 1
    dilation_h: int = 1
    dilation_w: int = 1
    groups: int = 1
    element_a: DType = DType.F16
    element_b: DType = DType.F16
    element_out: DType = DType.F16
    element_acc: DType = DType.F32
    epilogue: Epilogue = Epilogue()

    def __post_init__(self) -> None:
        # Normalise enums given as strings ("fprop", "f16"), so problems built by hand or from JSON compare equal.
        object.__setattr__(self, "kind", ConvKind(self.kind))
        for f in ("element_a", "element_b", "element_out", "element_acc"):
            object.__setattr__(self, f, DType(getattr(self, f)))
        if self.epilogue.bias_dtype is self.element_out:  # one spelling per problem: None means the output's type
            object.__setattr__(self, "epilogue", dataclasses.replace(self.epilogue, bias_dtype=None))
        self.validate()

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def make(
        cls,
        kind: ConvKind | str,
        n: int,
        c: int,
        h: int,
        w: int,
        k: int,
        r: int,
        s: Optional[int] = None,
        *,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        dtype: DType | str = DType.F16,
        out_dtype: DType | str | None = None,
        acc_dtype: DType | str = DType.F32,
        epilogue: Epilogue = Epilogue(),
    ) -> "Conv2dProblem":
        """PyTorch-ordered shorthand: `make("fprop", N, C, H, W, K, R, stride=2, padding=1)`."""
        pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
        (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
        dtype = DType(dtype)
        return cls(
            kind=ConvKind(kind), n=n, h=h, w=w, c=c, k=k, r=r, s=r if s is None else s,
            pad_h=ph, pad_w=pw, stride_h=sh, stride_w=sw, dilation_h=dh, dilation_w=dw, groups=groups,
            element_a=dtype, element_b=dtype, element_out=DType(out_dtype or dtype), element_acc=DType(acc_dtype),
            epilogue=epilogue,
        )

    def replace(self, **changes) -> "Conv2dProblem":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        for name in ("n", "h", "w", "c", "k", "r", "s", "stride_h", "stride_w", "dilation_h", "dilation_w", "groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ProblemError(f"{name}: expected a positive integer, got {v!r}")
        for name in ("pad_h", "pad_w"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ProblemError(f"{name}: expected a non-negative integer, got {v!r}")
        if self.c % self.groups or self.k % self.groups:
            raise ProblemError(f"groups: expected a divisor of C={self.c} and K={self.k}, got {self.groups}")
        if self.p < 1 or self.q < 1:
            raise ProblemError(
                f"output size: expected at least 1x1, got P={self.p} Q={self.q} "
                f"(H={self.h} W={self.w} R={self.r} S={self.s} padding={self.pad_h},{self.pad_w} "
                f"stride={self.stride_h},{self.stride_w} dilation={self.dilation_h},{self.dilation_w})"
            )
        if self.element_a is not self.element_b:
            raise ProblemError(
                f"element_b: expected the same type as element_a ({self.element_a.value}), got {self.element_b.value}"
            )
        if self.element_acc is DType.BF16:
            raise ProblemError("element_acc: expected f32 (or f16 for fp16 fprop/dgrad), got bf16")
        if self.element_acc is DType.F16:
            if self.kind is ConvKind.WGRAD:
                raise ProblemError("element_acc: wgrad always accumulates in f32, got f16")
            if self.element_a is not DType.F16:
                raise ProblemError(f"element_acc: f16 accumulation needs f16 inputs, got {self.element_a.value} inputs")
        if self.element_a is DType.F32 and self.element_acc is not DType.F32:
            raise ProblemError("element_acc: f32 inputs (TF32 tensor ops) accumulate in f32")
        if self.epilogue.bias_dtype is not None and not self.epilogue.source.has_bias:
            raise ProblemError(f"epilogue: bias_dtype {self.epilogue.bias_dtype.value} given without a bias "
                               f"(source {self.epilogue.source.value})")
        if self.kind is not ConvKind.FPROP and self.epilogue != Epilogue():
            if self.epilogue.activation is not Activation.IDENTITY or self.epilogue.source.has_bias:
                raise ProblemError(
                    f"epilogue: {self.kind.value} takes only a plain or residual (accumulate-into) epilogue, "
                    f"got {self.epilogue.tag}"
                )

    # ------------------------------------------------------------------ derived sizes
    @property
    def p(self) -> int:
        return (self.h + 2 * self.pad_h - self.dilation_h * (self.r - 1) - 1) // self.stride_h + 1

    @property
    def q(self) -> int:
        return (self.w + 2 * self.pad_w - self.dilation_w * (self.s - 1) - 1) // self.stride_w + 1

    @property
    def element_bias(self) -> Optional[DType]:
        """The bias's element type (None without a bias)."""
        if not self.epilogue.source.has_bias:
            return None
        return self.epilogue.bias_dtype or self.element_out

    @property
    def is_strided(self) -> bool:
        """A stride above 1 in either direction."""
        return self.stride_h > 1 or self.stride_w > 1

    @property
    def is_dilated(self) -> bool:
        """A dilation above 1 in either direction."""
        return self.dilation_h > 1 or self.dilation_w > 1

    @property
    def is_strided_dgrad(self) -> bool:
        """The dgrad of a strided conv: every dx pixel takes only the taps its phase meets (strided-dgrad kernels; the
        3.x family's sub-pixel launches; channel padding to give them wide accesses)."""
        return self.kind is ConvKind.DGRAD and self.is_strided

    @property
    def is_depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.c == self.k

    @property
    def x_shape(self) -> tuple[int, int, int, int]:
        """Activation (input of fprop, output of dgrad), NHWC."""
        return (self.n, self.h, self.w, self.c)

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        """Filter, KRSC (C per group)."""
        return (self.k, self.r, self.s, self.c // self.groups)

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        """Output of fprop (input gradient of dgrad and wgrad), NPQK."""
        return (self.n, self.p, self.q, self.k)

    @property
    def a_shape(self) -> tuple[int, int, int, int]:
        return {ConvKind.FPROP: self.x_shape, ConvKind.DGRAD: self.y_shape, ConvKind.WGRAD: self.y_shape}[self.kind]

    @property
    def b_shape(self) -> tuple[int, int, int, int]:
        return {ConvKind.FPROP: self.w_shape, ConvKind.DGRAD: self.w_shape, ConvKind.WGRAD: self.x_shape}[self.kind]

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return {ConvKind.FPROP: self.y_shape, ConvKind.DGRAD: self.x_shape, ConvKind.WGRAD: self.w_shape}[self.kind]

    @property
    def gemm_mnk(self) -> tuple[int, int, int]:
        """The implicit GEMM's M, N and K (per group)."""
        cg, kg = self.c // self.groups, self.k // self.groups
        rs = self.r * self.s
        if self.kind is ConvKind.FPROP:
            return (self.n * self.p * self.q, kg, cg * rs)
        if self.kind is ConvKind.DGRAD:
            return (self.n * self.h * self.w, cg, kg * rs)
        return (kg, cg * rs, self.n * self.p * self.q)

    @property
    def flops(self) -> int:
        """Multiply-adds counted as 2 FLOPs, the same for all three kinds (the convention cuDNN numbers use)."""
        return 2 * self.n * self.p * self.q * self.k * (self.c // self.groups) * self.r * self.s

    @property
    def bytes_moved(self) -> int:
        """The fewest bytes a kernel must move: each input read once, the output written once (and read if summed into)."""
        a = math.prod(self.a_shape) * self.element_a.nbytes
        b = math.prod(self.b_shape) * self.element_b.nbytes
        out = math.prod(self.out_shape) * self.element_out.nbytes
        if self.epilogue.source.has_residual:
            out *= 2
        return a + b + out

    # ------------------------------------------------------------------ operand properties used by kernel rules
    @property
    def channel_dims(self) -> tuple[int, int, int]:
        """The contiguous (innermost) extent of A, B and the output, which bounds each operand's alignment."""
        return {
            ConvKind.FPROP: (self.c, self.c, self.k),
            ConvKind.DGRAD: (self.k, self.c, self.c),
            ConvKind.WGRAD: (self.k, self.c, self.c),
        }[self.kind]

    @property
    def int32_overflow(self) -> Optional[str]:
        """Why the kernels' 32-bit indexing cannot address this problem's tensors, or None."""
        for name, shape in (("A", self.a_shape), ("B", self.b_shape), ("output", self.out_shape)):
            if math.prod(shape) > INT32_MAX:
                return f"{name} has {math.prod(shape)} elements, past the kernels' int32 indexing (max {INT32_MAX})"
        return None

    @property
    def name(self) -> str:
        """Readable and unique: kind, sizes, conv parameters, types and epilogue."""
        geo = f"n{self.n}_h{self.h}w{self.w}_c{self.c}k{self.k}_r{self.r}s{self.s}"
        conv = f"p{self.pad_h}x{self.pad_w}_u{self.stride_h}x{self.stride_w}_d{self.dilation_h}x{self.dilation_w}"
        if self.groups > 1:
            conv += f"_g{self.groups}"
        types = f"{self.element_a.value}{self.element_b.value}_{self.element_out.value}_acc{self.element_acc.value}"
        return f"{self.kind.value}_{geo}_{conv}_{types}_{self.epilogue.tag}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["epilogue"] = {"activation": self.epilogue.activation.value, "source": self.epilogue.source.value}
        if self.epilogue.bias_dtype is not None:  # only when set: the dicts (decision keys) of other problems stay
            d["epilogue"]["bias_dtype"] = self.epilogue.bias_dtype.value
        return {k: (v.value if hasattr(v, "value") else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Conv2dProblem":
        d = dict(d)
        ep = d.pop("epilogue", None) or {}
        return cls(**d, epilogue=Epilogue(Activation(ep.get("activation", "identity")), SourceKind(ep.get("source", "none")),
                                          ep.get("bias_dtype")))


def max_alignment(extent: int, dtype: DType, address: Optional[int] = None) -> int:
    """The widest of 8/4/2/1 elements that divides `extent`, fits in 128 bits and that `address` allows."""
    for a in ALIGNMENTS:
        if a * dtype.bits > 128 or extent % a:
            continue
        if address is not None and address % (a * dtype.nbytes):
            continue
        return a
    return 1
