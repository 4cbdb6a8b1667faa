import pytest

from cutlass_byoc.problem import Conv2dProblem, Epilogue, ProblemError, max_alignment
from cutlass_byoc.types import Activation, ConvKind, DType, SourceKind


def resnet_3x3(kind="fprop", **kw):
    return Conv2dProblem.make(kind, 32, 64, 56, 56, 64, 3, padding=1, **kw)


def test_output_size_and_gemm_view_per_kind():
    p = Conv2dProblem.make("fprop", 32, 128, 56, 56, 128, 3, stride=2, padding=1)
    assert (p.p, p.q) == (28, 28)
    assert p.gemm_mnk == (32 * 28 * 28, 128, 128 * 9)
    assert p.replace(kind=ConvKind.DGRAD).gemm_mnk == (32 * 56 * 56, 128, 128 * 9)
    assert p.replace(kind=ConvKind.WGRAD).gemm_mnk == (128, 128 * 9, 32 * 28 * 28)
    assert p.flops == 2 * 32 * 28 * 28 * 128 * 128 * 9
    assert p.out_shape == (32, 28, 28, 128)
    assert p.replace(kind=ConvKind.DGRAD).out_shape == (32, 56, 56, 128)
    assert p.replace(kind=ConvKind.WGRAD).out_shape == (128, 3, 3, 128)


def test_stem_and_dilation_output_size():
    stem = Conv2dProblem.make("fprop", 32, 3, 224, 224, 64, 7, stride=2, padding=3)
    assert (stem.p, stem.q) == (112, 112)
    dil = Conv2dProblem.make("fprop", 1, 8, 20, 20, 8, 3, padding=2, dilation=2)
    assert (dil.p, dil.q) == (20, 20)
    assert dil.is_dilated and not stem.is_dilated and stem.is_strided and not dil.is_strided
    assert dil.replace(dilation_w=1).is_dilated and not dil.replace(dilation_h=1, dilation_w=1).is_dilated
    assert stem.replace(kind=ConvKind.DGRAD).is_strided_dgrad and not stem.is_strided_dgrad


def test_bytes_moved_counts_each_tensor_once():
    p = resnet_3x3()
    assert p.bytes_moved == 2 * (32 * 56 * 56 * 64 * 2 + 64 * 9 * 64)
    assert resnet_3x3(epilogue=Epilogue(source=SourceKind.RESIDUAL)).bytes_moved == p.bytes_moved + 32 * 56 * 56 * 64 * 2


@pytest.mark.parametrize(
    "changes, parameter",
    [
        (dict(n=0), "n:"),
        (dict(c=-3), "c:"),
        (dict(pad_h=-1), "pad_h:"),
        (dict(stride_w=0), "stride_w:"),
        (dict(groups=3), "groups:"),
        (dict(h=2, w=2, r=7, s=7), "output size:"),
        (dict(element_b=DType.BF16), "element_b:"),
        (dict(element_acc=DType.BF16), "element_acc:"),
    ],
)
def test_validation_names_the_parameter(changes, parameter):
    with pytest.raises(ProblemError, match=parameter):
        resnet_3x3().replace(**changes)


def test_wgrad_always_accumulates_in_fp32():
    with pytest.raises(ProblemError, match="element_acc: wgrad always accumulates in f32"):
        resnet_3x3("wgrad", acc_dtype="f16")
    assert resnet_3x3("wgrad", out_dtype="f16").element_acc is DType.F32
    # fprop/dgrad accumulate in fp16 only when asked, and only from fp16 inputs
    assert resnet_3x3("fprop", acc_dtype="f16").element_acc is DType.F16
    with pytest.raises(ProblemError, match="element_acc"):
        resnet_3x3("fprop", dtype="bf16", acc_dtype="f16")


def test_gradients_take_no_activation_epilogue():
    with pytest.raises(ProblemError, match="epilogue"):
        resnet_3x3("dgrad", epilogue=Epilogue(Activation.RELU))
    resnet_3x3("wgrad", epilogue=Epilogue(source=SourceKind.RESIDUAL))  # accumulate into an existing gradient


def test_alignment_is_the_widest_that_divides_the_channels():
    assert max_alignment(64, DType.F16) == 8
    assert max_alignment(12, DType.F16) == 4
    assert max_alignment(6, DType.F16) == 2
    assert max_alignment(3, DType.F16) == 1
    assert max_alignment(33, DType.F16) == 1
    assert max_alignment(64, DType.F32) == 4  # 128 bits at most
    assert max_alignment(64, DType.F16, address=0x1000 + 2) == 1
    assert max_alignment(64, DType.F16, address=0x1000 + 4) == 2


def test_channel_dims_per_kind():
    p = Conv2dProblem.make("fprop", 1, 7, 8, 8, 33, 3, padding=1)
    assert p.channel_dims == (7, 7, 33)
    assert p.replace(kind=ConvKind.DGRAD).channel_dims == (33, 7, 7)
    assert p.replace(kind=ConvKind.WGRAD).channel_dims == (33, 7, 7)


def test_int32_overflow_is_detected():
    big = Conv2dProblem.make("fprop", 256, 256, 256, 256, 64, 3, padding=1)
    assert "int32" in big.int32_overflow
    assert resnet_3x3().int32_overflow is None


def test_round_trip_and_name():
    p = resnet_3x3("dgrad", dtype="bf16", out_dtype="f32")
    assert Conv2dProblem.from_dict(p.to_dict()) == p
    assert p.name == "dgrad_n32_h56w56_c64k64_r3s3_p1x1_u1x1_d1x1_bf16bf16_f32_accf32_linear"
    assert len({p.name, p.replace(n=1).name, p.replace(element_out=DType.BF16).name}) == 3
