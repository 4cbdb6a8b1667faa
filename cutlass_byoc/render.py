"""Render a kernel config into one CUDA translation unit through the family's Jinja template."""

from __future__ import annotations

import functools
from importlib import resources

import jinja2

from . import __version__
from .config import KernelConfig
from .types import Activation, KernelFamily, SplitKMode

#: Version of the extern "C" API in templates/conv2d_api.h.j2 (must match runtime.CbConv2dArgs).
ABI_VERSION = 1

_ACTIVATION_HEADERS = {
    Activation.IDENTITY: None,
    Activation.RELU: "linear_combination_relu.h",
    Activation.SIGMOID: "linear_combination_sigmoid.h",
    Activation.SILU: "linear_combination_silu.h",
    Activation.HARDSWISH: "linear_combination_hardswish.h",
    Activation.GELU: "linear_combination_gelu.h",
}


#: The activation as a CUTLASS functor of one value (cutlass/epilogue/thread/activation.h), for the bias-vector
#: epilogue's ElementwiseOp (GELU is the exact, erf one, as torch's default).
_ELEMENTWISE_OPS = {
    Activation.IDENTITY: "cutlass::epilogue::thread::Identity",
    Activation.RELU: "cutlass::epilogue::thread::ReLu",
    Activation.SIGMOID: "cutlass::epilogue::thread::Sigmoid",
    Activation.SILU: "cutlass::epilogue::thread::SiLu",
    Activation.HARDSWISH: "cutlass::epilogue::thread::HardSwish",
    Activation.GELU: "cutlass::epilogue::thread::GELU",
}


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    loader = jinja2.PackageLoader("cutlass_byoc.templates", ".")
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def template_text(name: str) -> str:
    return resources.files("cutlass_byoc.templates").joinpath(name).read_text()


def _swizzle(c: KernelConfig) -> str:
    if c.is_strided_dgrad:
        return f"cutlass::conv::threadblock::StridedDgradIdentityThreadblockSwizzle<{c.swizzle}>"
    # GemmSplitKIdentityThreadblockSwizzle does not compile with conv; the identity swizzle handles split-k.
    return f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<{c.swizzle}>"


def render(config: KernelConfig, compile_command: str) -> str:
    """The full source of `config`'s kernel library. `compile_command` is recorded in its header comment."""
    tmpl = environment().get_template(config.family.template)
    items = [(k, v) for k, v in config.to_dict().items() if v is not None]
    extra = {}
    if config.family is KernelFamily.SM90_GEMM_1X1:
        from .gemm1x1 import IM2COL_MAX_RSC, SCHEDULES, STREAMK_REDUCTION  # noqa: PLC0415

        kernel_schedule, epilogue_schedule, tile_scheduler = SCHEDULES[config.schedule]
        extra = dict(kernel_schedule=kernel_schedule, epilogue_schedule=epilogue_schedule, tile_scheduler=tile_scheduler,
                     reduction_mode=STREAMK_REDUCTION.get(config.schedule), max_rsc=IM2COL_MAX_RSC)
    elif config.family is KernelFamily.DEPTHWISE_DIRECT:
        from .depthwise import MAX_CLUSTER_SPLITS, pad_groups  # noqa: PLC0415

        extra = dict(zip(("halo_group", "dy_group"), pad_groups(config)), max_cluster_splits=MAX_CLUSTER_SPLITS)
    elif config.family is KernelFamily.SM90_TMA_WGMMA:
        from .sm90 import CHANNEL_STATS_SLOTS, SUBPIXEL_MAX_PHASES  # noqa: PLC0415

        extra = dict(subpixel_max_phases=SUBPIXEL_MAX_PHASES, stats_slots=CHANNEL_STATS_SLOTS)
    elif config.family is KernelFamily.SMEM_IM2COL:
        from .smem_im2col import MAX_SLICES, MAX_TAPS, N_TILES  # noqa: PLC0415

        extra = dict(max_taps=MAX_TAPS, n_tiles=N_TILES, max_slices=MAX_SLICES)
    return tmpl.render(
        c=config,
        version=__version__,
        template_name=config.family.template,
        config_items=items,
        config_json=config.to_json(),
        compile_command=compile_command,
        abi_version=ABI_VERSION,
        parallel=config.split_k_mode is SplitKMode.PARALLEL,
        atomic=config.split_k_mode is SplitKMode.ATOMIC,
        # (ReLU6 has neither: only the depthwise template takes it, with its own clamp)
        activation_header=None if config.element_bias else _ACTIVATION_HEADERS.get(config.activation),
        elementwise_op=_ELEMENTWISE_OPS.get(config.activation),
        swizzle=_swizzle(config),
        stride_support=config.stride_support.cutlass,
        **extra,
    )
