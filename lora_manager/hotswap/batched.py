"""Mixed-adapter batches: every row of a batch runs its own LoRA (gathered per-row LoRA, as S-LoRA/Punica BGMV do).

The hotswap template's D adapters (`slot0`..`slotD-1`, the device slots) are re-based onto one stack per module:
A [D, R, in(, kh, kw)], B transposed [D, R, out] and the scalings [D] (alpha / r of the adapter a slot holds). PEFT's
own tensors for each slot become views of those stacks, so `LiveSlot` swaps keep writing in place, and each template
layer's forward becomes the base layer plus, for every row n of the input (PEFT's per-adapter branches stay off),

    sum over picks p:  B[index[n, p]] @ A[index[n, p]] @ x[n] * scaling[index[n, p]] * strength[n, p]

as one gather and two batched matmuls, whatever D is (for conv layers: A as one convolution over every slot, then a
gather), in one custom operator.
`index` and `strength` (`BatchRows`) are tensors the engine writes in place before each pipeline call; a request
combining up to P adapters uses P picks, an unused pick has strength 0 and adds exactly 0. A layer that sees N rows
(one per request: the text encoder, called once on the prompts and once on the negative prompts) and one that sees
2N (the denoiser under classifier-free guidance: diffusers concatenates [uncond rows; cond rows]) read the same
buffers, sliced by their input's row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch import nn


class BatchRows:
    """Per-row adapter picks for the next pipeline call, in one pair of buffers written in place (never Python values
    baked into a graph): `index` [2B*P] (the device slot of each row's P picks) and `strength` [2B, P], for batches of
    up to B requests. `write` repeats the call's N rows to fill all 2B, so a layer that sees n rows reads the first n:
    the N rows themselves (the text encoder, or a denoiser without guidance) or the N rows twice, which is exactly
    the [uncond; cond] batch of classifier-free guidance. Every batch size reads the same buffers through a slice of
    its own row count, so one compiled graph, dynamic in the batch dimension, serves them all."""

    def __init__(self, max_rows: int, picks: int, device: torch.device):
        self.picks = picks
        self.index = torch.zeros(2 * max_rows * picks, dtype=torch.long, device=device)
        self.strength = torch.zeros(2 * max_rows, picks, device=device)

    @torch.no_grad()
    def write(self, rows: list[list[tuple[int, float]]]) -> None:
        """Set every row's (device slot, strength) picks, at most B rows. Unused picks get strength 0 (slot 0), which
        adds exactly nothing."""
        total = self.strength.shape[0]
        if not 0 < len(rows) <= total // 2:
            raise ValueError(f"a batch has 1 to {total // 2} rows, not {len(rows)}")
        flat_index, flat_strength = [0] * self.index.numel(), [0.0] * self.strength.numel()
        for n in range(total):
            for p, (slot, s) in enumerate(rows[n % len(rows)]):
                flat_index[n * self.picks + p], flat_strength[n * self.picks + p] = slot, s
        self.index.copy_(torch.tensor(flat_index), non_blocking=True)
        self.strength.copy_(torch.tensor(flat_strength).view(self.strength.shape), non_blocking=True)


@torch.library.custom_op("lora_manager::gathered_lora", mutates_args=())
def gathered_lora(
    x: torch.Tensor,
    A: torch.Tensor,
    Bt: torch.Tensor,
    scaling: torch.Tensor,
    index: torch.Tensor,
    strength: torch.Tensor,
    rank: int,
    stride: list[int],
    padding: list[int],
) -> torch.Tensor:
    """The LoRA part of a layer's output for the n rows of `x`, each row with its own picks (`BatchRows`), over the
    first `rank` columns of the stacks. One operator to torch.compile: dynamo traces one node per layer instead of
    every step below, which keeps the compile of a denoiser with a hundred LoRA layers short."""
    n, picks = x.shape[0], strength.shape[1]
    index, strength = index[: n * picks], strength[:n]
    # strengths and scalings are float32; the product is cast to the stacks' dtype (float16/bfloat16 pipelines), since
    # bmm refuses mixed dtypes and type promotion would otherwise turn the half-precision rows to float32
    weight = (strength * scaling.index_select(0, index).view(n, picks)).to(A.dtype)  # [n, P]
    Bt = Bt[:, :rank].index_select(0, index).view(n, picks * rank, -1)  # [n, P*R, out]
    if A.dim() == 5:  # [D, R, in, kh, kw]: a Conv2d layer
        # A of every device slot as one convolution (D*R output channels; nothing depends on the row count), then
        # each row's picks gathered; B (1x1) as a batched matmul
        h = F.conv2d(x, A[:, :rank].flatten(0, 1), None, stride, padding)  # [n, D*R, H', W']
        size = h.shape[-2:]
        h = h.view(n, A.shape[0], -1)  # [n, D, R*H'W']
        h = h.gather(1, index.view(n, picks, 1).expand(n, picks, h.shape[-1]))  # [n, P, R*H'W']
        h = (h.view(n, picks, rank, -1) * weight[:, :, None, None]).view(n, picks * rank, -1)  # [n, P*R, H'W']
        return torch.bmm(Bt.transpose(1, 2), h).view(n, -1, *size)
    A = A[:, :rank].index_select(0, index).view(n, picks * rank, -1)  # [n, P*R, in]
    h = torch.bmm(x.reshape(n, -1, x.shape[-1]), A.transpose(1, 2))  # [n, L, P*R]
    h = (h.view(n, -1, picks, rank) * weight[:, None, :, None]).view(n, -1, picks * rank)
    return torch.bmm(h, Bt).view(*x.shape[:-1], -1)


@gathered_lora.register_fake
def _(x, A, Bt, scaling, index, strength, rank, stride, padding):
    """The output's shape for tracing, without tracing the steps (contiguous, as `gathered_lora` returns it)."""
    if A.dim() == 5:
        size = [(x.shape[i + 2] + 2 * padding[i] - A.shape[3 + i]) // stride[i] + 1 for i in range(2)]
        return x.new_empty((x.shape[0], Bt.shape[-1], *size), dtype=A.dtype)
    return x.new_empty((*x.shape[:-1], Bt.shape[-1]), dtype=A.dtype)


class GatheredLora:
    """One template layer's stacked LoRA tensors and the layer's forward over them: the base layer plus every row's
    LoRA (`gathered_lora`). It replaces PEFT's forward, whose per-adapter branches would add nothing."""

    def __init__(self, layer: LoraLayer, names: list[str], rows: BatchRows):
        with torch.no_grad():
            self.A = torch.stack([layer.lora_A[n].weight.detach() for n in names])  # [D, R, in(, kh, kw)]
            # B transposed, [D, R, out]: a gather then feeds a batched matmul without a copy
            self.Bt = torch.stack([layer.lora_B[n].weight.detach().flatten(1).T for n in names])
            self.scaling = torch.stack([_as_tensor(layer, n) for n in names])  # [D]
        for i, n in enumerate(names):  # PEFT's tensors become views of the stacks: swaps write into them in place
            layer.lora_A[n].weight.data = self.A[i]
            b = self.Bt[i].T
            layer.lora_B[n].weight.data = b.view(*b.shape, *[1] * (layer.lora_B[n].weight.dim() - 2))
            layer.scaling[n] = self.scaling[i]
        self.rows = rows
        self.base_layer = layer.get_base_layer()
        # columns computed: the template rank, or (eager engines) the highest rank a resident adapter has in this
        # layer, since the columns above it are zero in every slot; 0 skips the layer
        self.rank = self.A.shape[1]
        conv = layer.lora_A[names[0]]
        self.stride, self.padding = (list(conv.stride), list(conv.padding)) if isinstance(conv, nn.Conv2d) else ([], [])

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        output = self.base_layer(x, *args, **kwargs)
        if self.rank == 0:
            return output
        rows = self.rows
        delta = gathered_lora(
            x.to(self.A.dtype),
            self.A,
            self.Bt,
            self.scaling,
            rows.index,
            rows.strength,
            self.rank,
            self.stride,
            self.padding,
        )
        return output + delta.to(output.dtype)


def install(components: dict[str, nn.Module], names: list[str], rows: BatchRows) -> dict[tuple[str, str], GatheredLora]:
    """Re-base every template layer onto stacks and give it the gathered forward (before compile: the forwards and
    stacks are then part of the compiled graphs). Returns the layers by (component, module)."""
    layers = {}
    for comp, model in components.items():
        for module_name, layer in model.named_modules():
            if isinstance(layer, LoraLayer) and names[0] in layer.lora_A:
                gathered = GatheredLora(layer, names, rows)
                layer.set_adapter([], inference_mode=True)  # PEFT's own branches: none active
                layer.forward = gathered.forward
                layers[(comp, module_name)] = gathered
    return layers


def _as_tensor(layer: LoraLayer, name: str) -> torch.Tensor:
    """PEFT keeps a scaling as a float unless prepared for hotswap; stacked, it becomes a tensor swaps write."""
    value = layer.scaling[name]
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), device=layer.lora_A[name].weight.device)
