"""`drafter.fp8`: the drafter's linear layers trained with FP8 matmuls, row-wise scaled as torchao's float8
training recipe "rowwise" does (every operand e4m3, scales per row of the contracted operand, rounded up to a
power of two). The parameters stay float32 master weights: the optimizer never sees an FP8 tensor.

For `y = x @ W^T` (`x [M, K]`, `W [N, K]`) the three matmuls each quantise their operands along the dimension
they contract, so that every scale factors out of its dot products:
    forward      y  = x  @ W^T   x per token (over K),            W per output channel (over K)
    grad input   dx = dy @ W     dy per token (over N),           W per input channel (over N)
    grad weight  dW = dy^T @ x   dy per output channel (over M),  x per input channel (over M)
The grad-weight matmul contracts the token dimension, which `_scaled_mm` on CUDA needs to be a multiple of
16: both operands get zero rows up to the next multiple (zeros add nothing to the sum).

`drafter.fp8_grad_weight` chooses how the grad-weight matmul runs (`GRAD_WEIGHT_MODES`); the forward and the grad
input are row-wise in every mode:
    rowwise     as above: each operand's scales along the token dimension need a reduction over all tokens
                per column, fused with the transposed cast (two such passes per linear)
    tensorwise  dy and x each with one scale: the largest of their row-wise scales, which the forward and the
                grad input computed anyway (power-of-two, so exactly the scale of the whole tensor's amax);
                the transposed cast is then a plain element-wise pass. One outlier token coarsens every
                token's step, as in torchao's default (tensor-wise) recipe
    bf16        dW = dy^T @ x in the compute dtype (torchao's "grad weight in high precision"): no transposed
                cast at all, the matmul at bf16's speed
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import FP8, FP8_MAX, SCALED_MM_MULTIPLE, named_linears, quantize, scaled_mm

# The drafter's linears that drafter.fp8 trains in FP8: attention and MLP projections of its layers, and fc.
# Not the lm_head (the loss's chunked head), nor an architecture's other small projections.
FP8_LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_TOP_LINEARS = ("fc",)
GRAD_WEIGHT_MODES = ("rowwise", "tensorwise", "bf16")


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [R, C]` quantised per row, as a row-major e4m3 tensor and its power-of-two scales `[R, 1]`."""
    q, scale = quantize(x, dim=-1, power_of_2=True)
    return q.contiguous(), scale


def _columns_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [R, C]` quantised per column, as `_scaled_mm`'s second operand: the transpose of a row-major `[C, R]`
    (column-major) and the scales `[1, C]`."""
    q, scale = _rowwise(x.t())
    return q.t(), scale.reshape(1, -1)


def _transposed_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [R, C]` cast to e4m3 with one scale (a 0-dim tensor no smaller than every element's amax / 448), as the
    row-major `[C, R]`."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).t().contiguous()


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 16 (always through F.pad, also by 0: no branch on a dynamic size)."""
    return F.pad(x, (0, 0, 0, (-x.shape[0]) % SCALED_MM_MULTIPLE))


class Fp8Matmul(torch.autograd.Function):
    """`x [M, K] @ weight [N, K]^T` with FP8 matmuls forward and backward (the grad weight's as `grad_weight`, one
    of `GRAD_WEIGHT_MODES`), each into `out_dtype` (the compute dtype); the gradients return in the dtypes of `x`
    and `weight`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                grad_weight: str = "rowwise") -> torch.Tensor:
        x_q, x_scale = _rowwise(x)
        w_q, w_scale = _rowwise(weight)
        ctx.save_for_backward(x, weight, x_scale.amax() if grad_weight == "tensorwise" else None)
        ctx.out_dtype, ctx.grad_weight = out_dtype, grad_weight
        return scaled_mm(x_q, x_scale, w_q.t(), w_scale.reshape(1, -1), out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, x_tensor_scale = ctx.saved_tensors
        mode = ctx.grad_weight
        grad_x = grad_w = None
        if ctx.needs_input_grad[0] or mode == "tensorwise":
            g_q, g_scale = _rowwise(grad_out)
        if ctx.needs_input_grad[0]:
            wt_q, wt_scale = _columns_first(weight)  # W [N, K] per input channel: contracted over N
            grad_x = scaled_mm(g_q, g_scale, wt_q, wt_scale, ctx.out_dtype).to(x.dtype)
        if ctx.needs_input_grad[1]:
            if mode == "rowwise":
                gt_q, gt_scale = _rowwise(_pad_rows(grad_out).t())  # dy^T [N, M] per output channel
                xt_q, xt_scale = _columns_first(_pad_rows(x))  # x [M, K] per input channel: contracted over M
                grad_w = scaled_mm(gt_q, gt_scale, xt_q, xt_scale, ctx.out_dtype)
            elif mode == "tensorwise":
                g_tensor_scale = g_scale.amax()
                gt_q = _transposed_with_scale(_pad_rows(grad_out), g_tensor_scale)  # dy^T [N, M]
                xt_q = _transposed_with_scale(_pad_rows(x), x_tensor_scale)  # x^T [K, M]
                out = weight.dtype if weight.dtype == torch.float32 else ctx.out_dtype
                grad_w = torch._scaled_mm(gt_q, xt_q.t(), scale_a=g_tensor_scale, scale_b=x_tensor_scale,
                                          out_dtype=out)
            else:
                grad_w = grad_out.to(ctx.out_dtype).t() @ x.to(ctx.out_dtype)
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None


def compute_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear's output has here: autocast's when it is on, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Fp8TrainingLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same names) whose matmul runs through `Fp8Matmul`."""

    grad_weight: str = "tensorwise"  # use_fp8_training sets drafter.fp8_grad_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = compute_dtype_of(x)
        out = Fp8Matmul.apply(x.reshape(-1, self.in_features), self.weight, out_dtype, self.grad_weight)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out_dtype)


def fp8_drafter_linears(drafter: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the drafter linears `drafter.fp8` trains in FP8."""
    found = []
    for name, m in named_linears(drafter):
        leaf = name.rpartition(".")[2]
        if name in FP8_TOP_LINEARS or (name.startswith("layers.") and leaf in FP8_LAYER_LINEARS):
            found.append((name, m))
    return found


def use_fp8_training(drafter: nn.Module, grad_weight: str = "tensorwise") -> list[str]:
    """Swap the drafter's `fp8_drafter_linears` for `Fp8TrainingLinear`s holding the same Parameter objects (an
    optimizer, DDP or a checkpoint sees no change), their grad-weight matmul as `grad_weight`; returns their
    names. Call before `compile_layers`."""
    if grad_weight not in GRAD_WEIGHT_MODES:
        raise ValueError(f"grad_weight must be one of {GRAD_WEIGHT_MODES}, got {grad_weight!r}")
    names = []
    for name, m in fp8_drafter_linears(drafter):
        new = Fp8TrainingLinear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        new.weight, new.bias, new.grad_weight = m.weight, m.bias, grad_weight
        parent, _, child = name.rpartition(".")
        setattr(drafter.get_submodule(parent) if parent else drafter, child, new)
        names.append(name)
    return names
