"""CPU tests of the `cutlass_byoc` torch.compile backend and its custom ops: registration, options, Inductor
compiling around the ops (training and inference), the ops' fake implementations and PyTorch reference."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cutlass_byoc.offload import OffloadOptions, Pass, cutlass_byoc_backend, last_report, make_backend
from cutlass_byoc.offload import library
from cutlass_byoc.ops import UnsupportedConvError
from cutlass_byoc.select import SelectMode

CL = torch.channels_last


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.c3 = nn.Conv2d(16, 16, 3, padding=1, groups=16)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        z = F.relu(self.c2(y) + y)
        return self.c3(z).mean((2, 3))


def _pair():
    torch.manual_seed(0)
    m, ref = Block(), Block()
    ref.load_state_dict(m.state_dict())
    return m, ref


def test_backend_is_registered_under_its_name():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "cutlass_byoc" in list_backends(exclude_tags=())
    assert lookup_backend("cutlass_byoc") is cutlass_byoc_backend


def test_options():
    o = OffloadOptions.from_any({"select": "tune"}, wgrad=False)
    assert o.select is SelectMode.TUNE and not o.wgrad and o.compile_time_select is SelectMode.CACHED
    assert OffloadOptions.from_any(None, select="heuristic").compile_time_select is SelectMode.HEURISTIC
    with pytest.raises(ValueError, match="unknown"):
        OffloadOptions.from_any({"tile": 128})


def test_torch_compile_with_inductor_trains_like_eager():
    """The string backend with options, Inductor compiling everything around the custom ops (CPU: the ops run
    their reference): loss and gradients as eager, report recorded."""
    m, ref = _pair()
    x = torch.randn(2, 8, 8, 8).contiguous(memory_format=CL)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="cutlass_byoc", options={"require_cuda": False, "select": "heuristic"})
    library.RUNTIME.clear()
    loss = compiled(x).square().sum()
    loss.backward()
    ref_loss = ref(x).square().sum()
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    for (n, p), r in zip(m.named_parameters(), ref.parameters()):
        err = (p.grad - r.grad).norm() / r.grad.norm().clamp_min(1e-12)
        assert err < 1e-4 or r.grad.norm() < 1e-5, f"{n}: {err:.2e}"
    rep = last_report()
    assert rep.count(Pass.FPROP) == 3 and rep.count(Pass.WGRAD) == 3 and rep.count(Pass.DGRAD) == 2
    assert rep.count(Pass.FPROP, offloaded=False) == 0  # the depthwise conv runs on the depthwise kernels
    assert sorted(e.kind.value for e in rep.offloaded if e.kernel.startswith("cb_dw_")) == ["dgrad", "fprop", "wgrad"]
    assert any(e.fused == ("bias", "residual", "relu") for e in rep.entries)
    assert library.RUNTIME.reference_calls >= 8  # 3 fprop + 2 dgrad + 3 wgrad ran (their CPU reference)


def test_eager_variant_inference_graph():
    m, ref = _pair()
    m.eval(), ref.eval()
    backend = make_backend(require_cuda=False, inductor=False, select="heuristic")
    torch._dynamo.reset()
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        out = torch.compile(m, backend=backend)(x)
        assert torch.allclose(out, ref(x), rtol=1e-5, atol=1e-6)
    (rep,) = backend.reports
    assert "forward" in rep.graph and rep.count(Pass.FPROP) == 3 and rep.count(Pass.WGRAD, None) == 0
    assert "offloaded" in rep.summary()


# ---------------------------------------------------------------------------------------------- the ops
def _fprop_args(out_dtype=None, residual=False):
    x = torch.randn(2, 8, 9, 9).contiguous(memory_format=CL)
    w = torch.randn(16, 8, 3, 3).contiguous(memory_format=CL)
    b = torch.randn(16, dtype=out_dtype or torch.float32)
    r = torch.randn(2, 16, 5, 5, dtype=out_dtype or torch.float32).contiguous(memory_format=CL) if residual else None
    return (x, w, None if residual else b, r, [2, 2], [1, 1], [1, 1], 1, "silu", out_dtype, "heuristic")


@pytest.mark.parametrize("residual", [False, True])
def test_fprop_op_reference_and_fake(residual):
    args = _fprop_args(residual=residual)
    torch.library.opcheck(library.conv2d_fprop, args, test_utils=("test_schema", "test_faketensor"))
    y = library.conv2d_fprop(*args)
    x, w, b, r = args[:4]
    ref = F.conv2d(x, w, b, 2, 1)
    ref = F.silu(ref + r if r is not None else ref)
    assert y.is_contiguous(memory_format=CL) and torch.allclose(y, ref, atol=1e-5)


def test_fprop_op_stores_out_dtype():
    args = _fprop_args(out_dtype=torch.float16)
    y = library.conv2d_fprop(*args)
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=CL)


def test_dgrad_wgrad_ops_match_torch_grad():
    x = torch.randn(2, 8, 9, 9).contiguous(memory_format=CL)
    w = torch.randn(16, 8, 3, 3).contiguous(memory_format=CL)
    dy = torch.randn(2, 16, 5, 5).contiguous(memory_format=CL)
    dargs = (dy, w, [2, 8, 9, 9], [2, 2], [1, 1], [1, 1], 1, None, "heuristic")
    wargs = (dy, x, [16, 8, 3, 3], [2, 2], [1, 1], [1, 1], 1, torch.float32, "heuristic")
    for op, args in ((library.conv2d_dgrad, dargs), (library.conv2d_wgrad, wargs)):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    dx = library.conv2d_dgrad(*dargs)
    dw = library.conv2d_wgrad(*wargs)
    assert dx.is_contiguous(memory_format=CL) and dw.is_contiguous(memory_format=CL)
    assert torch.allclose(dx, torch.nn.grad.conv2d_input(x.shape, w, dy, 2, 1), atol=1e-4)
    assert torch.allclose(dw, torch.nn.grad.conv2d_weight(x, w.shape, dy, 2, 1), atol=1e-4)
    # 16-bit inputs, fp32 gradient: accumulated and stored in fp32
    dw16 = library.conv2d_wgrad(dy.bfloat16(), x.bfloat16(), [16, 8, 3, 3], [2, 2], [1, 1], [1, 1], 1,
                                torch.float32, "heuristic")
    assert dw16.dtype == torch.float32
    exact = torch.nn.grad.conv2d_weight(x.bfloat16().double(), w.shape, dy.bfloat16().double(), 2, 1)
    assert torch.allclose(dw16.double(), exact, rtol=1e-5, atol=1e-4)


def test_torch_compile_with_inductor_inference_fuses_epilogues():
    """No gradient: Inductor's inference graph (silu decomposed as Inductor does) gets the pass too."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 16, 3, padding=1)).eval()
    backend = make_backend(require_cuda=False)
    torch._dynamo.reset()
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        out = torch.compile(m, backend=backend)(x)
        assert torch.allclose(out, m(x), rtol=1e-5, atol=1e-6)
    (rep,) = backend.reports
    assert [e.fused for e in rep.entries] == [("bias", "silu"), ("bias",)], rep.summary()


def test_first_call_of_a_signature_is_checked_later_calls_go_direct(monkeypatch):
    """A call signature's first call runs the checked public op; only once that succeeded do later calls go straight
    to ops.run_problem (output allocated from the problem, channels_last); a failing first call falls back (reason
    recorded) and is checked again next time."""
    from cutlass_byoc import ops

    sig = library._signature("fprop", (2, 16, 8, 8), (32, 16, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.float16,
                             torch.float16, operand_dtypes=("test",))
    library._VALIDATED.discard(sig)
    library.RUNTIME.clear()
    seen = []

    def checked(launch):
        seen.append("checked")
        if len(seen) == 1:
            raise UnsupportedConvError("input: planted failure")
        return torch.zeros(1)

    def run_problem(problem, a, b, out, source, config):
        seen.append("direct")
        assert problem.n == 2 and config is not None and source is None
        assert tuple(out.shape) == (2, 32, 8, 8) and out.is_contiguous(memory_format=torch.channels_last)
        assert out.dtype == torch.float16

    monkeypatch.setattr(ops, "run_problem", run_problem)
    x, w = torch.zeros(2, 16, 8, 8), torch.zeros(32, 16, 3, 3)
    call = lambda: library._call("fprop", sig, "heuristic", checked, lambda: (x, w, None),  # noqa: E731
                                 torch.float16, lambda: "planted")
    assert call() is None
    assert "planted failure" in library.RUNTIME.fallbacks["planted"]
    assert call().shape == (1,)
    assert call().shape == (2, 32, 8, 8)
    assert seen == ["checked", "checked", "direct"]
    library._VALIDATED.discard(sig)


def test_cudagraph_options_reach_inductor():
    from cutlass_byoc.offload.backend import inductor_patches

    assert inductor_patches(OffloadOptions()) == {}
    assert inductor_patches(OffloadOptions(cudagraphs=True)) == {"triton.cudagraphs": True}
    assert inductor_patches(OffloadOptions(mode="reduce-overhead"))["triton.cudagraphs"] is True


def test_torch_compile_mode_is_accepted():
    """torch.compile passes its mode to a named backend (options and mode are exclusive there): the backend turns
    "reduce-overhead" into Inductor's CUDA graphs (skipped by Inductor on CPU tensors)."""
    m, ref = _pair()
    x = torch.randn(2, 8, 8, 8).contiguous(memory_format=CL)
    torch._dynamo.reset()
    out = torch.compile(m, backend="cutlass_byoc", mode="reduce-overhead")(x)
    assert torch.allclose(out, ref(x), rtol=1e-4, atol=1e-5)
    assert last_report().count(Pass.FPROP) == 0  # require_cuda (the default): nothing offloaded off the GPU


def test_interleaved_rounds_take_turns_and_rotate_the_first():
    from cutlass_byoc.offload.bench import interleaved_rounds

    order = []
    times = interleaved_rounds(["a", "b", "c"], 3, lambda s: order.append(s) or float(len(order)))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times == [[1.0, 6.0, 8.0], [2.0, 4.0, 9.0], [3.0, 5.0, 7.0]]  # each stepper's own times, round order


def test_kernel_timeline_splits_busy_time_launch_gaps_and_host_gaps():
    from cutlass_byoc.offload.bench import HOST_GAP_US, kernel_timeline

    short = HOST_GAP_US / 2
    ks = [(0.0, 100.0, "a"), (50.0, 120.0, "overlaps a"), (60.0, 70.0, "inside a"),  # busy 0..120
          (120.0 + short, 200.0, "after a launch gap"),
          (500.0, 600.0, "after the host"), (600.0, 650.0, "back to back"), (1650.0, 1700.0, "after a long wait")]
    t = kernel_timeline(list(reversed(ks)), steps=1, top=2)  # the order recorded does not matter
    assert t["kernels"] == 7
    assert t["busy_ms"] * 1e3 == 120 + (200 - 120 - short) + 100 + 50 + 50
    assert t["launch_gap_ms"] * 1e3 == short and t["host_gaps"] == 2
    assert t["host_gap_ms"] * 1e3 == 300 + 1000
    # each with the kernel that ended the wait and the one before it (the last to end, not the last to start)
    assert t["longest_gaps"] == [[1000.0, "after a long wait", "back to back"],
                                 [300.0, "after the host", "after a launch gap"]]


def test_gpu_ms_by_source_splits_ours_from_cudnn_triton_and_aten():
    from cutlass_byoc.offload.bench import gpu_ms_by_source, kernel_source

    ours = ["cb_pingpong::cb_pingpong_kernel(cb_pingpong::Params)", "_ZN9cb_splitk21cb_split_wgrad_kernelEN7cutlass",
            "_ZN7cutlass13device_kernelINS_4conv6kernel13ConvUniversalI",
            "void (anonymous namespace)::cb_dw_fprop<8>()",
            # the depthwise template's kernels (a "cols" fprop per epilogue source, the wgrad reduction) and the
            # shared-memory im2col template's, as torch.profiler names them
            "void (anonymous namespace)::depthwise_kernel<0>((anonymous namespace)::Params)",
            "(anonymous namespace)::depthwise_kernel((anonymous namespace)::Params)",
            "(anonymous namespace)::reduce_kernel((anonymous namespace)::Params, int)",
            "(anonymous namespace)::im2col_smem_kernel((anonymous namespace)::Params)",
            # its wgrad kernel and the slices' sum after it (counted as "other" until the forty-third session)
            "(anonymous namespace)::im2col_smem_wgrad_kernel((anonymous namespace)::Params)",
            "(anonymous namespace)::reduce_slices_kernel(float const*, int, int, float, float*)"]
    vendor = ["sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc", "nvjet_sm90_hsh_64x64_64x13_2x1_v_bz",
              "void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_16x16_128x2_nn_align8>(Params)",
              "cutlass3x_sm90_tensorop_h64x128x16gemm_f16_f16_f16_void_f16_128x64x64_2x1x1_0_tnn_align8"]
    assert {kernel_source(n) for n in ours} == {"cutlass_byoc"}
    assert {kernel_source(n) for n in vendor} == {"cudnn/cublas"}
    assert kernel_source("triton_poi_fused_add_relu_3") == "triton"
    # Inductor names its kernels after the aten ops they fuse: those next to a convolution are still Triton's
    for name in ("triton_poi_fused_convolution_backward_threshold_backward_12", "triton_poi_fused_convolution_0",
                 "triton_red_fused_convolution_backward_native_batch_norm_backward_7", "triton_tem_fused_addmm_gemm_1"):
        assert kernel_source(name) == "triton", name
    assert kernel_source("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >") == "aten"
    assert kernel_source("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >(...)") == "aten"
    assert kernel_source("Memset (Device)") == "other"
    # PyTorch's own kernels in an anonymous namespace (the persistent softmax) are not ours
    softmax = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true, false>(float*)"
    assert kernel_source(softmax) == "other"
    ks = [(0.0, 400.0, ours[0]), (400.0, 500.0, vendor[0]), (500.0, 800.0, "triton_red_fused_1"),
          (900.0, 1000.0, ours[1]), (1000.0, 1200.0, "Memset (Device)")]
    assert gpu_ms_by_source(ks, steps=2) == {"cutlass_byoc": 0.25, "cudnn/cublas": 0.05, "triton": 0.15, "aten": 0.0,
                                             "other": 0.1}
    assert list(gpu_ms_by_source(ks, steps=2)) == ["cutlass_byoc", "cudnn/cublas", "triton", "aten", "other"]


def test_profile_breakdown_splits_the_conv_ops_per_step():
    """The offload bench's --profile split (bench.profile_breakdown) from torch.profiler-like averages."""
    import types

    from cutlass_byoc.offload import bench
    from cutlass_byoc.offload.bench import profile_breakdown

    def ev(key, count, cpu, gpu):
        return types.SimpleNamespace(key=key, count=count, cpu_time_total=cpu, device_time_total=gpu)

    from cutlass_byoc.offload import library

    # the names the profiler records for the ops an offloaded graph calls
    assert {op.name() for op in (library.FPROP, library.DGRAD, library.WGRAD)} <= set(bench.OFFLOADED_OPS)
    avg = [ev("cutlass_byoc::fprop_site", 10, 300.0, 2000.0), ev("cutlass_byoc::wgrad_site", 6, 120.0, 1000.0),
           ev("aten::convolution", 4, 80.0, 500.0), ev("aten::convolution_backward", 4, 100.0, 900.0),
           ev("aten::add_", 50, 400.0, 300.0), ev("cudaGraphLaunch", 6, 30.0, 0.0),
           ev("cudaLaunchKernel", 40, 90.0, 0.0)]
    kernels = [(i * 1000.0, (i + 1) * 1000.0, f"k{i}") for i in range(20)]  # back to back
    out = profile_breakdown(avg, kernels, steps=2, wall_ms=9.5)
    assert out["wall_ms"] == 9.5 and out["gpu_kernel_ms"] == 10.0  # 20 ms of kernels over 2 steps
    assert out["kernels"] == 10 and out["busy_ms"] == 10.0 and out["host_gap_ms"] == 0 == out["launch_gap_ms"]
    assert out["offloaded_calls"] == 8 and out["offloaded_cpu_ms"] == 0.21 and out["offloaded_gpu_ms"] == 1.5
    assert out["aten_conv_calls"] == 4 and out["aten_conv_cpu_ms"] == 0.09 and out["aten_conv_gpu_ms"] == 0.7
    assert out["graph_launches"] == 3 and out["kernel_launches"] == 20
    assert out["top_kernels"][0] == [0.5, 0.5, "k0"] and len(out["top_kernels"]) == 10
    assert out["gpu_ms_by_source"] == {"cutlass_byoc": 0.0, "cudnn/cublas": 0.0, "triton": 0.0, "aten": 0.0,
                                       "other": 10.0}
    assert out["triton_kernels"] == []
    long = "triton_poi_fused__native_batch_norm_legit_functional_add_native_batch_norm_backward_threshold_backward_17"
    both = profile_breakdown(avg, [(0.0, 1000.0, long), (1000.0, 3000.0, long[:-2] + "23"), (3000.0, 4000.0, "k")],
                             steps=1, wall_ms=4.0)
    assert both["triton_kernels"] == [[2.0, 1.0, long[:-2] + "23"], [1.0, 1.0, long]]  # whole names, all of them
    # every other source's kernels, whole names, by source (Triton's are triton_kernels)
    assert both["kernels_by_source"] == {"cutlass_byoc": [], "cudnn/cublas": [], "aten": [], "other": [[1.0, 1.0, "k"]]}
    assert out["kernels_by_source"]["other"] == out["top_kernels"] + [[0.5, 0.5, f"k{i}"] for i in range(10, 20)]


def test_device_work_leaves_out_annotation_ranges():
    """The GPU timeline's range for a host annotation (the optimizer's record_function) is no kernel: counted, it
    doubled its kernels' time in "other" and filled the gaps between them in the busy time."""
    import types

    from cutlass_byoc.offload.bench import device_work, kernel_timeline

    def ev(name, start, end, device="cuda", annotation=False):
        return types.SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                                     time_range=types.SimpleNamespace(start=start, end=end))

    events = [ev("aten::add_", 0.0, 5.0, device="cpu"),
              ev("Optimizer.step#SGD.step", 0.0, 400.0, annotation=True),
              # a GPU copy not marked itself is known by its host range's name
              ev("ProfilerStep#3", 0.0, 700.0, device="cpu", annotation=True), ev("ProfilerStep#3", 0.0, 700.0),
              ev("multi_tensor_apply_kernel", 0.0, 100.0), ev("multi_tensor_apply_kernel", 300.0, 400.0),
              ev("Memset (Device)", 500.0, 510.0), ev("empty", 600.0, 600.0)]
    work = device_work(events, "cuda")
    assert work == [(0.0, 100.0, "multi_tensor_apply_kernel"), (300.0, 400.0, "multi_tensor_apply_kernel"),
                    (500.0, 510.0, "Memset (Device)")]
    assert kernel_timeline(work, steps=1)["busy_ms"] * 1e3 < 400  # the gap between the two kernels is not busy


def test_launchers_name_the_ops_around_launches_outside_graphs():
    import types

    from cutlass_byoc.offload.bench import launchers

    def ev(name, parent=None):
        return types.SimpleNamespace(name=name, cpu_parent=parent)

    step = ev("Optimizer.step#SGD.step")
    add, unscale = ev("aten::_foreach_add_", step), ev("aten::_amp_foreach_non_finite_check_and_unscale_")
    ex = ev("cudaLaunchKernelExC", add)  # its driver call (cuLaunchKernel) below is the same launch
    events = [step, add, unscale, ev("cudaLaunchKernel", add), ev("cudaLaunchKernel", add), ex,
              ev("cuLaunchKernel", ex), ev("cudaLaunchKernel", unscale), ev("cudaGraphLaunch", None),
              ev("cudaLaunchKernel", None)]
    events.append(ev("cudaLaunchKernel", ev("cudaStreamSynchronize", unscale)))  # inside another API call
    site = ev("cutlass_byoc::fprop_site")  # an op whose name starts like the API's is still the op
    events += [ev("cuLaunchKernelEx", site)] * 4
    assert launchers(events, steps=2) == [[2.0, "cutlass_byoc::fprop_site"], [1.5, "aten::_foreach_add_"],
                                          [1.0, "aten::_amp_foreach_non_finite_check_and_unscale_"],
                                          [0.5, "(no enclosing op)"]]


def test_report_names_keep_what_tells_pytorch_kernels_apart():
    from cutlass_byoc.offload.bench import kernel_source, kernel_timeline, profile_breakdown, short_kernel_name

    ns = "at::native::(anonymous namespace)::"
    sgd = (f"void {ns}multi_tensor_apply_kernel<{ns}TensorListMetadata<3>, {ns}FusedSgdMathFunctor<float, 3>, "
           f"float, float>({ns}TensorListMetadata<3>, {ns}FusedSgdMathFunctor<float, 3>, float, float)")
    unscale = (f"void {ns}multi_tensor_apply_kernel<{ns}TensorListMetadata<1>, "
               f"{ns}UnaryOpListAlphaFunctor<float, 1, 1, 0>, float>")
    short = short_kernel_name(sgd)[:100]
    assert short.startswith("multi_tensor_apply_kernel<TensorListMetadata<3>, FusedSgdMathFunctor")
    assert short_kernel_name("triton_poi_fused_relu_3") == "triton_poi_fused_relu_3"
    assert short_kernel_name("cb_pingpong::cb_pingpong_kernel(cb_pingpong::Params)").startswith("cb_pingpong::")
    ks = [(0.0, 10.0, sgd), (20.0, 30.0, unscale), (1000.0, 1001.0, "(anonymous namespace)::depthwise_kernel(Params)")]
    out = profile_breakdown([], ks, steps=1, wall_ms=1.0)
    assert {k[2][:60] for k in out["top_kernels"][:2]} == {short_kernel_name(sgd)[:60], short_kernel_name(unscale)[:60]}
    assert kernel_timeline(ks, 1)["longest_gaps"][0][1] == "depthwise_kernel(Params)"
    # sources are told from the whole name: ours stays ours
    assert out["gpu_ms_by_source"]["cutlass_byoc"] == 0.001 and kernel_source(ks[2][2]) == "cutlass_byoc"


def test_triton_time_splits_by_what_the_kernels_compute():
    """Inductor's kernels of a training step by role, named as in the forty-second session's ResNet-50 profile."""
    from cutlass_byoc.offload.bench import profile_breakdown, triton_ms_by_role

    names = {
        "triton_red_fused__native_batch_norm_legit_functional_9": "bn_statistics",
        "triton_per_fused__native_batch_norm_legit_functional_add_12": "bn_statistics",
        "triton_poi_fused__native_batch_norm_legit_functional_add_relu_13": "bn_apply",
        "triton_red_fused__native_batch_norm_legit_functional_native_batch_norm_backward_threshold_backward_59":
            "backward",
        "triton_poi_fused__native_batch_norm_legit_functional_add_convolution_backward_native_batch_norm_backward_"
        "threshold_backward_67": "backward",
        "triton_poi_fused_add_max_pool2d_with_indices_max_pool2d_with_indices_backward_69": "backward",
        "triton_poi_fused__to_copy_74": "other",
        "triton_poi_fused_max_pool2d_with_indices_6": "other",
    }
    ks = [(1000.0 * i, 1000.0 * i + 100.0 * (i + 1), name) for i, name in enumerate(names)]
    ks += [(9000.0, 9500.0, "cb_pingpong::cb_pingpong_kernel(cb_pingpong::Params)"),  # not Triton: left out
           (9500.0, 9600.0, "void at::native::reduce_kernel<512, 1>(...)")]
    want = {"backward": 0.0, "bn_statistics": 0.0, "bn_apply": 0.0, "other": 0.0}
    for (start, stop, _), role in zip(ks, names.values()):
        want[role] += (stop - start) / 2 / 1e3
    got = triton_ms_by_role(ks, steps=2)
    assert got == pytest.approx(want) and list(got) == list(want)
    assert profile_breakdown([], ks, steps=2, wall_ms=1.0)["triton_ms_by_role"] == got


def test_top_kernels_ranks_names_by_summed_gpu_time():
    from cutlass_byoc.offload.bench import top_kernels

    ks = [(0.0, 300.0, "conv"), (400.0, 500.0, "relu"), (600.0, 800.0, "relu"), (900.0, 1000.0, "sgd"),
          (1000.0, 1400.0, "conv")]
    assert top_kernels(ks, steps=2, top=2) == [[0.35, 1.0, "conv"], [0.15, 1.0, "relu"]]


def test_inductor_kernels_groups_triton_kernels_by_the_ops_they_fuse():
    """scripts/inductor_kernels.py compares two compiles' Triton kernels by name without Inductor's counter."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "inductor_kernels.py"
    spec = importlib.util.spec_from_file_location("inductor_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = [[0.5, 2.0, "triton_red_fused__native_batch_norm_legit_functional_3"],
         [0.25, 1.0, "triton_red_fused__native_batch_norm_legit_functional_9"],
         [0.1, 1.0, "triton_poi_fused__to_copy_4"]]
    b = [[0.7, 3.0, "triton_red_fused__native_batch_norm_legit_functional_11"], [0.2, 1.0, "triton_poi_fused_add"]]
    rows = mod.triton_by_ops(a, b)
    assert rows[0] == {"ops": "triton_poi_fused_add", "a": [0.0, 0.0], "b": [0.2, 1.0], "ms_diff": 0.2}
    by = {r["ops"]: r for r in rows}
    assert by["triton_red_fused__native_batch_norm_legit_functional"] == {
        "ops": "triton_red_fused__native_batch_norm_legit_functional", "a": [0.75, 3.0], "b": [0.7, 3.0],
        "ms_diff": -0.05}
    assert by["triton_poi_fused__to_copy"]["ms_diff"] == -0.1 and len(rows) == 3


def test_bench_dynamic_modes_compile_like_their_static_twins():
    """The offload bench's dynamic modes (a smaller batch after the first step, then the full batch through the
    dynamic graph): inductor-dynamic is plain torch.compile, cutlass_byoc-dynamic the backend with the case's
    options; both selectable."""
    from cutlass_byoc.offload import bench

    assert {"inductor-dynamic", "cutlass_byoc-dynamic"} <= set(bench.EXTRA_MODES)
    assert 0 < bench.DYNAMIC_FRACTION < 1
    m = torch.nn.Conv2d(3, 8, 3)
    run, backend = bench.compile_mode(m, "inductor-dynamic")
    assert backend is None and run is not m
    run, backend = bench.compile_mode(m, "cutlass_byoc-dynamic", {"select": "heuristic"})
    assert backend is not None and backend.options.select.value == "heuristic" and not backend.options.cudagraphs


def test_bench_optimizers():
    """The offload bench's optimizers (--optimizers): sgd is PyTorch's default SGD with momentum, sgd-fused the same
    update with fused=True, which GradScaler steps without reading its found-inf flag on the host; a row's label
    names the optimizer unless it is the default one, and its record carries it."""
    from cutlass_byoc.offload import bench

    params = [torch.nn.Parameter(torch.zeros(3))]
    plain, fused = bench.make_optimizer("sgd", params), bench.make_optimizer("sgd-fused", params)
    for opt in (plain, fused):
        assert isinstance(opt, torch.optim.SGD)
        assert opt.defaults["lr"] == bench.BENCH_LR == 1e-4 and opt.defaults["momentum"] == 0.9
    assert fused.defaults["fused"] and getattr(fused, "_step_supports_amp_scaling", False)
    assert not plain.defaults.get("fused") and not getattr(plain, "_step_supports_amp_scaling", False)
    with pytest.raises(ValueError, match="adam"):
        bench.make_optimizer("adam", params)
    row = bench.BenchRow("resnet50", "cutlass_byoc-cudagraphs", 9.0, 1.0, 1.0, 0.0, 0.0, 0.0, batch=32,
                         optimizer="sgd-fused")
    assert row.label == "cutlass_byoc-cudagraphs [sgd-fused]" and row.record()["optimizer"] == "sgd-fused"
    row.optimizer = "sgd"
    assert row.label == "cutlass_byoc-cudagraphs" and row.record()["optimizer"] == "sgd"
    row.optimizer, row.training = "", False  # inference: no optimizer
    assert "optimizer" not in row.record()
    assert bench.OPTIMIZERS[0] == "sgd"  # the default, and what rows published without the field ran


def test_bench_counts_the_updates_gradscaler_skipped():
    """A timed training step must run the update it claims: the bench's GradScaler starts at the compared first
    step's LOSS_SCALE and never grows, so each halving of its scale over the timed steps is one update skipped for
    non-finite gradients; a row records the count and its line says so."""
    from cutlass_byoc.offload import bench

    made = []
    with mock.patch.object(torch.amp, "GradScaler", lambda *a, **kw: made.append((a, kw))):
        bench.make_scaler()
        bench.make_scaler(enabled=False)
    assert made[0][0] == ("cuda",) and made[0][1]["init_scale"] == bench.LOSS_SCALE
    assert made[0][1]["growth_interval"] >= 1_000_000 and made[0][1]["enabled"] and not made[1][1]["enabled"]
    assert bench.skipped_updates(4096.0, 4096.0) == 0
    assert bench.skipped_updates(4096.0, 512.0) == 3 and bench.skipped_updates(4096.0, 2048.0) == 1
    assert bench.skipped_updates(4096.0, 8192.0) == 0 and bench.skipped_updates(None, 1.0) == 0
    row = bench.BenchRow("resnet50", "inductor-cudagraphs", 9.0, 1.0, 1.0, 0.0, 0.0, 0.0, batch=32,
                         optimizer="sgd-fused")
    assert "skipped_updates" not in row.record() and "skipped" not in row.line()  # not counted (inference, bf16)
    row.skipped_updates = 0
    assert row.record()["skipped_updates"] == 0 and "skipped" not in row.line()
    row.skipped_updates = 57
    assert row.record()["skipped_updates"] == 57 and "57 of the timed updates skipped" in row.line()


def test_report_counts_untuned_problems_and_names_decisions_made_elsewhere(tmp_cache, monkeypatch, caplog):
    """select="cached" on a GPU whose cache holds decisions from another GPU (a cache copied from another machine):
    the convs run the model's launch, and the report and one warning say so, naming where the decisions came from.
    The GPU is injected (this test runs anywhere); the partition itself is the CPU trace of explain()."""
    import logging
    import sys

    from cutlass_byoc import decisions as dec_mod
    from cutlass_byoc.heuristics import default_launch
    from cutlass_byoc.offload.trace import explain

    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.ReLU(),
                          nn.Conv2d(32, 32, 1, bias=False)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    opts = OffloadOptions(require_cuda=False, strict=True, select="cached")
    _, rep = explain(model, x, options=opts)  # no GPU: nothing to count
    assert rep.untuned == 0 and rep.tuned_elsewhere == {}
    problems = list(dict.fromkeys(rep.problems))
    assert len(problems) == 2
    h200, h100 = dec_mod.GpuInfo("NVIDIA H200", 90), dec_mod.GpuInfo("NVIDIA H100 80GB HBM3", 90)
    dec_mod.record_decision(problems[0], default_launch(problems[0]), 10.0, gpu=h200)
    monkeypatch.setattr(dec_mod, "current_gpu", lambda: h100)
    # the module (the package exports a function of its name)
    monkeypatch.setattr(sys.modules["cutlass_byoc.offload.partition"], "_warned_elsewhere", set())
    with caplog.at_level(logging.WARNING, logger="cutlass_byoc.offload"):
        _, rep = explain(model, x, options=opts)
    assert rep.untuned == 2, rep.summary()
    assert rep.tuned_elsewhere == {"tuned on NVIDIA H200 (sm_90)": [problems[0]]}
    assert "2 problems untuned" in rep.summary() and "decisions tuned on NVIDIA H200 (sm_90) only" in rep.summary()
    assert sum("no decision for NVIDIA H100 80GB HBM3" in r.message for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cutlass_byoc.offload"):
        explain(model, x, options=opts)
    assert not any("no decision for" in r.message for r in caplog.records)  # once per process and cause
    # tuned here: nothing left to say
    for p in problems:
        dec_mod.record_decision(p, default_launch(p), 10.0, gpu=h100)
    _, rep = explain(model, x, options=opts)
    assert rep.untuned == 0 and rep.tuned_elsewhere == {}
    # heuristic selection is untuned by request: not counted
    _, rep = explain(model, x, options=OffloadOptions(require_cuda=False, strict=True, select="heuristic"))
    assert rep.untuned == 0
