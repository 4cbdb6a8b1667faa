"""Enumerations shared by problems, configs, templates and the runtime."""

from __future__ import annotations

import enum


class ConvKind(str, enum.Enum):
    """Which of the three convolution passes a kernel computes."""

    FPROP = "fprop"  # y  = conv(x, w)
    DGRAD = "dgrad"  # dx = conv_backward_input(dy, w)
    WGRAD = "wgrad"  # dw = conv_backward_weight(dy, x)

    @property
    def cutlass(self) -> str:
        return {"fprop": "Fprop", "dgrad": "Dgrad", "wgrad": "Wgrad"}[self.value]


class DType(str, enum.Enum):
    """Element types the kernels read, write or accumulate in."""

    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"

    @property
    def cutlass(self) -> str:
        return {"f16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t", "f32": "float"}[self.value]

    @property
    def bits(self) -> int:
        return {"f16": 16, "bf16": 16, "f32": 32}[self.value]

    @property
    def nbytes(self) -> int:
        return self.bits // 8

    @property
    def torch_name(self) -> str:
        return {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}[self.value]

    @classmethod
    def from_torch(cls, dtype) -> "DType":
        name = str(dtype).replace("torch.", "")
        for member in cls:
            if member.torch_name == name:
                return member
        raise ValueError(f"dtype: expected one of float16, bfloat16, float32, got {name}")


class MathOp(str, enum.Enum):
    """How the tensor cores multiply: plain for 16-bit inputs, TF32 for fp32 inputs."""

    F16 = "f16"  # mma.sync m16n8k16 on fp16
    BF16 = "bf16"  # mma.sync m16n8k16 on bf16
    TF32 = "tf32"  # mma.sync m16n8k8 on tf32 (fp32 operands rounded)


class KernelFamily(str, enum.Enum):
    """One template per family."""

    SM80_IMPLICIT_GEMM = "sm80_implicit_gemm"  # CUTLASS 2.x, mma.sync, runs on sm_80+
    SM90_TMA_WGMMA = "sm90_tma_wgmma"  # CUTLASS 3.x, TMA + wgmma, needs sm_90a
    DEPTHWISE_DIRECT = "depthwise_direct"  # direct depthwise kernels (groups == C == K)
    SM90_GEMM_1X1 = "sm90_gemm_1x1"  # 1x1 stride-1 convs as CUTLASS 3.x sm90 GEMMs (TMA, warp-specialized, stream-K)
    SMEM_IM2COL = "smem_im2col"  # fprop of few input channels: im2col rows gathered in shared memory, mma.sync

    @property
    def template(self) -> str:
        if self is KernelFamily.SM90_GEMM_1X1:
            return "gemm_sm90_1x1.cu.j2"
        return f"conv2d_{self.value}.cu.j2"


class IteratorAlgorithm(str, enum.Enum):
    ANALYTIC = "analytic"
    OPTIMIZED = "optimized"
    FEW_CHANNELS = "few_channels"  # fprop only, C % alignment == 0, small C
    FIXED_CHANNELS = "fixed_channels"  # fprop only, C == alignment

    @property
    def cutlass(self) -> str:
        return "cutlass::conv::IteratorAlgorithm::k" + "".join(p.capitalize() for p in self.value.split("_"))


class StrideSupport(str, enum.Enum):
    UNITY = "unity"
    STRIDED = "strided"

    @property
    def cutlass(self) -> str:
        return "cutlass::conv::StrideSupport::k" + self.value.capitalize()


class SplitKMode(str, enum.Enum):
    NONE = "none"
    SERIAL = "serial"  # slices take turns on the output tile, ordered by a semaphore in workspace
    PARALLEL = "parallel"  # fp32 partials in workspace, then a reduction kernel applies the epilogue
    # (depthwise wgrad) the splits of a channel block are one thread-block cluster, reduced in distributed shared
    # memory by the same kernel: no workspace, no second kernel; at most MAX_CLUSTER_SPLITS splits
    CLUSTER = "cluster"
    # (sm90 wgrad) the slices add their fp32 sums into one zeroed fp32 buffer, each tile with TMA's reduce-add store
    # (cp.reduce.async.bulk.tensor .add, performed in L2): no partials per slice and no pass summing them, but the
    # order of the adds, and so the sum's last bits, varies from run to run (nondeterministic, like cuDNN's atomic
    # wgrad); PARALLEL is its deterministic twin
    ATOMIC = "atomic"

    @property
    def cutlass(self) -> str:
        return {"none": "kSerial", "serial": "kSerial", "parallel": "kParallel", "cluster": "kParallel",
                "atomic": "kParallel"}[self.value]

    @property
    def fp32_sums(self) -> bool:
        """Whether the implicit-GEMM kernel stores fp32 sums (each slice's partials, or reduce-adds into one buffer)
        rather than the output in its own type: PARALLEL, ATOMIC."""
        return self in (SplitKMode.PARALLEL, SplitKMode.ATOMIC)


class Activation(str, enum.Enum):
    IDENTITY = "identity"
    RELU = "relu"
    SIGMOID = "sigmoid"
    SILU = "silu"
    HARDSWISH = "hardswish"
    GELU = "gelu"  # exact (erf) GELU, as torch.nn.functional.gelu's default
    RELU6 = "relu6"  # min(max(x, 0), 6) (MobileNet's clamp): the depthwise family only (see KernelConfig.static_error)

    @property
    def functor(self) -> str:
        """The CUTLASS 2.x thread-level epilogue functor computing act(alpha*acc + beta*C)."""
        return {
            "identity": "cutlass::epilogue::thread::LinearCombination",
            "relu": "cutlass::epilogue::thread::LinearCombinationRelu",
            "sigmoid": "cutlass::epilogue::thread::LinearCombinationSigmoid",
            "silu": "cutlass::epilogue::thread::LinearCombinationSilu",
            "hardswish": "cutlass::epilogue::thread::LinearCombinationHardSwish",
            "gelu": "cutlass::epilogue::thread::LinearCombinationGELU",
        }[self.value]  # (no relu6: the implicit-GEMM families do not take it)


class SourceKind(str, enum.Enum):
    """What the epilogue's C operand is: nothing, a per-output-channel bias, or a full residual tensor."""

    NONE = "none"
    BIAS = "bias"  # C broadcast along the output's channel dim (stride 0 elsewhere)
    RESIDUAL = "residual"  # C has the output's shape
    # A per-output-channel bias vector *and* a residual tensor in one epilogue: act(acc + bias + residual). Fprop only;
    # runs on the kernels with a bias-vector operand (KernelConfig.element_bias), which read the residual as C.
    BIAS_RESIDUAL = "bias_residual"

    @property
    def has_bias(self) -> bool:
        return self in (SourceKind.BIAS, SourceKind.BIAS_RESIDUAL)

    @property
    def has_residual(self) -> bool:
        return self in (SourceKind.RESIDUAL, SourceKind.BIAS_RESIDUAL)
