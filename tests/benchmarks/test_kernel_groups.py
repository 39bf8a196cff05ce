"""`throughput.py --profile`'s grouping of a step's kernels (benchmarks/kernel_groups.py), on kernel names a profiled
H200 or H100 step recorded: inductor's fused kernels go by the ops they hold, library and ATen kernels by their family,
and the part's time that no kernel covers is reported as such."""

import importlib.util
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("kernel_groups",
                                               Path(__file__).parents[2] / "benchmarks" / "kernel_groups.py")
kg = sys.modules["kernel_groups"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kg)

RECORDED = {  # a kernel name of a profiled compiled step -> the group it belongs to
    "nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN": "matmuls",
    "cutlass_80_simt_sgemm_128x32_8x5_nn_align1": "matmuls",
    "triton_tem_fused_flex_attention_backward_1": "flex attention",
    "triton_red_fused_flex_attention_backward_0": "flex attention",
    "triton_red_fused__to_copy_arange_argmax_eq_exp_gather_logsumexp_neg_squeeze_sub": "chunked CE",
    "triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_view_6": "norms",
    "triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_1": "other fused elementwise",
    "triton_per_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_cat_mean":
        "other fused elementwise",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1": "other attention",
    "fmha_cutlassB_bf16_aligned_128x128_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)": "other attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous)": "optimizer",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>":
        "eager elementwise",
    "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>>": "eager elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)":
        "copies and concatenations",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>":
        "copies and concatenations",
    "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)":
        "gathers and scatters",
    "void at::native::indexFuncLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true, at::native::":
        "gathers and scatters",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t":
        "reductions",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float": "top-k",
    "Memcpy DtoH (Device -> Pinned)": "other kernels",
}


def test_each_recorded_kernel_falls_in_its_group():
    assert {name: kg.group_of(name) for name in RECORDED} == RECORDED


def test_the_groups_sum_the_kernels_and_the_rest_of_the_wall_time_is_idle():
    kernels = [("nvjet_a", 300.0), ("nvjet_b", 64.0), ("triton_tem_fused_flex_attention_0", 70.0),
               ("triton_red_fused_x_logsumexp_y", 21.0)]
    groups = kg.kernel_groups(kernels, wall_ms=480.0)
    assert list(groups) == ["matmuls", "flex attention", "chunked CE", kg.IDLE]
    assert groups["matmuls"] == 364.0 and groups[kg.IDLE] == 25.0
    assert "matmuls 364.0 ms (76%)" in kg.describe(groups, 480.0)


def test_a_profile_without_device_kernels_has_none_to_group():
    """The host-side records (a CPU run's aten::mm, the launch records of GPU kernels) are not kernels."""
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a @ a
    assert any(e.key == "aten::mm" for e in prof.key_averages())
    assert kg.profiled_kernels(prof) == []
