"""Mixed-adapter batches: every row of a batch runs its own LoRA (gathered per-row LoRA, as S-LoRA/Punica BGMV do).

The hotswap template's D adapters (`slot0`..`slotD-1`, the device slots) are re-based onto one stack per module:
A [D, R, in(, kh, kw)], B transposed [D, R, out] and the scalings [D] (alpha / r of the adapter a slot holds). PEFT's
own tensors for each slot become views of those stacks, so `LiveSlot` swaps keep writing in place, and PEFT's
per-adapter branches are switched off: a forward hook on each template layer adds, for every row n of the input,

    sum over picks p:  B[index[n, p]] @ A[index[n, p]] @ x[n] * scaling[index[n, p]] * strength[n, p]

as one gather and two batched matmuls (for conv layers A is one grouped convolution over the rows), whatever D is.
`index` and `strength` (`BatchRows`) are tensors the engine writes in place before each pipeline call; a request
combining up to P adapters uses P picks, an unused pick has strength 0 and adds exactly 0. They hold one row per
request (N); a layer that sees 2N rows (the denoiser under classifier-free guidance: diffusers concatenates
[uncond rows; cond rows]) uses them twice, and the text encoder, called once on the prompts and once on the negative
prompts, sees N rows each time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch import nn


class BatchRows:
    """Per-row adapter picks for the next pipeline call. One set of buffers per batch size, written in place (never
    Python values baked into a graph): `index` [N*P] (the device slot of each row's P picks), `strength` [N, P], and
    the same for the 2N rows the denoiser sees under classifier-free guidance (`index2`, `strength2`), prepared here
    once per call rather than in every layer."""

    def __init__(self, sizes: list[int], picks: int, device: torch.device):
        self.picks = picks

        def buffers(n: int) -> tuple[torch.Tensor, ...]:
            index = torch.zeros(n * picks, dtype=torch.long, device=device)
            strength = torch.zeros(n, picks, device=device)
            return index, strength, index.repeat(2), strength.repeat(2, 1)

        self._buffers = {n: buffers(n) for n in sizes}
        self.index, self.strength, self.index2, self.strength2 = self._buffers[min(sizes)]

    @torch.no_grad()
    def write(self, rows: list[list[tuple[int, float]]]) -> None:
        """Set every row's (device slot, strength) picks; `len(rows)` must be one of `sizes`. Unused picks get
        strength 0 (slot 0), which adds exactly nothing."""
        index, strength, index2, strength2 = self._buffers[len(rows)]
        flat_index, flat_strength = [0] * index.numel(), [0.0] * strength.numel()
        for n, picks in enumerate(rows):
            for p, (slot, s) in enumerate(picks):
                flat_index[n * self.picks + p], flat_strength[n * self.picks + p] = slot, s
        new_index = torch.tensor(flat_index)
        new_strength = torch.tensor(flat_strength).view(strength.shape)
        for dst, src in ((index, new_index), (strength, new_strength), (index2, new_index.repeat(2)),
                         (strength2, new_strength.repeat(2, 1))):
            dst.copy_(src, non_blocking=True)
        self.index, self.strength, self.index2, self.strength2 = index, strength, index2, strength2


class GatheredLora:
    """One template layer's stacked LoRA tensors and the per-row forward over them."""

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
        # columns computed: the template rank, or (eager engines) the highest rank a resident adapter has in this
        # layer, since the columns above it are zero in every slot; 0 skips the layer
        self.rank = self.A.shape[1]
        conv = layer.lora_A[names[0]]
        self.conv = isinstance(conv, nn.Conv2d)
        self.stride, self.padding = (conv.stride, conv.padding) if self.conv else (None, None)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA part of the layer's output, each row with its own picks."""
        rows, n = self.rows, x.shape[0]
        # N rows (text encoder, or no guidance) or 2N (the denoiser's [uncond; cond] rows)
        index, strength = (rows.index, rows.strength) if n == rows.strength.shape[0] else (rows.index2, rows.strength2)
        picks, rank = strength.shape[1], self.rank
        weight = (strength * self.scaling.index_select(0, index).view(n, picks)).to(self.A.dtype)  # [n, P]
        A = self.A[:, :rank].index_select(0, index)  # [n*P, R, in(, kh, kw)]
        Bt = self.Bt[:, :rank].index_select(0, index).view(n, picks * rank, -1)  # [n, P*R, out]
        x = x.to(self.A.dtype)
        if self.conv:  # A per row as one grouped convolution over the rows, B (1x1) as a batched matmul
            h = F.conv2d(x.reshape(1, -1, *x.shape[2:]), A.flatten(0, 1), None, self.stride, self.padding, groups=n)
            size = h.shape[-2:]
            h = (h.view(n, picks, rank, -1) * weight[:, :, None, None]).view(n, picks * rank, -1)  # [n, P*R, H'W']
            return torch.bmm(Bt.transpose(1, 2), h).view(n, -1, *size)
        h = torch.bmm(x.reshape(n, -1, x.shape[-1]), A.view(n, picks * rank, -1).transpose(1, 2))  # [n, L, P*R]
        h = (h.view(n, -1, picks, rank) * weight[:, None, :, None]).view(n, -1, picks * rank)
        return torch.bmm(h, Bt).view(*x.shape[:-1], -1)

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            return output
        return output + self.delta(args[0]).to(output.dtype)


def install(
    components: dict[str, nn.Module], names: list[str], rows: BatchRows
) -> dict[tuple[str, str], GatheredLora]:
    """Re-base every template layer onto stacks and switch PEFT's own branches off (before compile: hooks and
    stacks are then part of the compiled graphs). Returns the layers by (component, module)."""
    layers = {}
    for comp, model in components.items():
        for module_name, layer in model.named_modules():
            if isinstance(layer, LoraLayer) and names[0] in layer.lora_A:
                gathered = GatheredLora(layer, names, rows)
                layer.set_adapter([], inference_mode=True)  # PEFT adds nothing; the hook adds every row's LoRA
                layer.register_forward_hook(gathered.hook)
                layers[(comp, module_name)] = gathered
    return layers


def _as_tensor(layer: LoraLayer, name: str) -> torch.Tensor:
    """PEFT keeps a scaling as a float unless prepared for hotswap; stacked, it becomes a tensor swaps write."""
    value = layer.scaling[name]
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), device=layer.lora_A[name].weight.device)
