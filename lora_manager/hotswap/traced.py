"""The mixed-batch LoRA as plain tensor operations, for compiled graphs: no Python runs per layer, no CPU tensor is
read, and every shape but the batch's row count is fixed, so inductor fuses around it and CUDA graphs can capture a
whole step, the device slots, each row's picks (`index`) and strengths being buffers written before the call.

Each row computes at the template rank R (a slot's columns past its adapter's rank are zero and add exactly 0):

    linear:  gather each row's picks' A and B, then two batched matmuls    (P x R columns per row)
    conv:    one convolution with every device slot's A, each row weighing its own slots, then B as a matmul

A conv layer convolves with every slot's A because a grouped convolution (each row its own A) would have the row
count as its `groups`, which a compiled graph cannot keep dynamic: each batch size would recompile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def traced_lora(
    x: torch.Tensor,
    A: torch.Tensor,
    Bt: torch.Tensor,
    scaling: torch.Tensor,
    index: torch.Tensor,
    strength: torch.Tensor,
    stride: list[int],
    padding: list[int],
) -> torch.Tensor:
    """The LoRA part of a template layer's output for `x`'s n rows, each with its own P picks: `index` [>= n*P] the
    device slot of each pick, `strength` [>= n, P] (0 for an unused pick); A [D, R, in(, kh, kw)], Bt [D, R, out]."""
    n, picks = x.shape[0], strength.shape[1]
    index = index[: n * picks]
    # strengths and scalings are float32; their product is cast to the stacks' dtype (bmm refuses mixed dtypes)
    weight = strength[:n] * scaling[index].view(n, picks)  # [n, P]
    if A.dim() == 5:
        return _conv(x, A, Bt, index.view(n, picks), weight, stride, padding)
    rank = A.shape[1]
    rows_A = A.index_select(0, index).view(n, picks * rank, -1)  # [n, P*R, in]
    rows_Bt = Bt.index_select(0, index).view(n, picks * rank, -1)  # [n, P*R, out]
    h = torch.bmm(x.reshape(n, -1, x.shape[-1]), rows_A.transpose(1, 2))  # [n, L, P*R]
    h = (h.view(n, -1, picks, rank) * weight.to(A.dtype)[:, None, :, None]).view(n, -1, picks * rank)
    return torch.bmm(h, rows_Bt).view(*x.shape[:-1], -1)


def _conv(x, A, Bt, index, weight, stride, padding) -> torch.Tensor:
    """A conv layer's rows: every slot's A in one convolution, each row's slots weighted by its picks (others by 0)."""
    n, (slots, rank) = x.shape[0], A.shape[:2]
    per_slot = torch.zeros(n, slots, dtype=weight.dtype, device=weight.device).scatter_add_(1, index, weight)
    h = F.conv2d(x, A.flatten(0, 1), None, stride, padding)  # [n, D*R, H', W']
    size = h.shape[-2:]
    h = (h.view(n, slots, rank, -1) * per_slot.to(A.dtype)[:, :, None, None]).view(n, slots * rank, -1)
    return torch.matmul(Bt.flatten(0, 1).T, h).view(n, -1, *size)  # [out, D*R] @ [n, D*R, H'W']
