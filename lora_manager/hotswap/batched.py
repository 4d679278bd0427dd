"""Mixed-adapter batches: every row of a batch runs its own LoRA, at its own rank (as S-LoRA/Punica/LoRAX do).

The hotswap template's D adapters (`slot0`..`slotD-1`, the device slots) are re-based onto one stack per module:
A [D, R, in(, kh, kw)], B transposed [D, R, out] and the scalings [D] (alpha / r of the adapter a slot holds). PEFT's
own tensors for each slot become views of those stacks, so `LiveSlot` swaps keep writing in place, and each template
layer's forward becomes the base layer plus, for every row n of the input (PEFT's per-adapter branches stay off),

    sum over picks p:  B[index[n, p]] @ A[index[n, p]] @ x[n] * scaling[index[n, p]] * strength[n, p]

and how a layer computes that depends on where it runs, decided in `GatheredLora.forward` alone:

- compiled (any device): `traced.traced_lora`, plain tensor operations at the template rank, with no Python per
  layer and no CPU tensor read, so the graph stays whole (and capturable by CUDA graphs) for any mix of adapters;
- eager: the rows grouped by rank bucket (powers of two): each group computes only the columns its adapters use at
  this layer (its highest rank), a row whose adapters do not target the layer skips it, and a group whose rows all
  use the same one adapter runs as one plain LoRA branch (no gather), planned once per batch (`BatchRows.write`,
  `groups`); a small float32 layer instead runs each row with its merged weight (the base weight plus its adapters'
  B @ A, `merged.MERGE_MAX_WEIGHTS`): kept per device slot for a single adapter at strength 1, made once per batch
  otherwise.

`index` and `strength` are tensors the engine writes in place before each pipeline call; a request combining up to
P adapters uses P picks, an unused pick has strength 0 and adds exactly 0. A layer that sees N rows (one per request:
the text encoder, called once on the prompts and once on the negative prompts) and one that sees 2N (the denoiser
under classifier-free guidance: diffusers concatenates [uncond rows; cond rows]) read the same buffers, sliced by
their input's row count. The per-batch picks live in `rows`, the eager rank groups in `groups` and the merged weights
in `merged`; this module holds the layer that chooses among them.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from .groups import Group, plan_groups, run_groups
from .merged import Merged, MergedWeights, merges
from .rows import BatchRows, Key
from .traced import traced_lora


class GatheredLora:
    """One template layer's stacked LoRA tensors and the layer's forward over them: the base layer plus every row's
    LoRA (traced when compiled; eager, planned groups or merged weights). It replaces PEFT's forward, whose
    per-adapter branches would add nothing."""

    def __init__(self, layer: LoraLayer, names: list[str], rows: BatchRows, layer_index: int):
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
        self.rows, self.layer = rows, layer_index
        self._planned: tuple[tuple[int, int] | None, list[Group] | Merged] = (None, [])  # (batch version, rows): plan
        self._merged: MergedWeights | None = None  # a small layer's merged weights (`merged.merges`)
        self._asked = False  # whether `merges` was asked: on the first call, which gives the device
        self.base_layer = layer.get_base_layer()
        conv = layer.lora_A[names[0]]
        self.stride, self.padding = (list(conv.stride), list(conv.padding)) if isinstance(conv, nn.Conv2d) else ([], [])

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows = self.rows
        compiling = torch.compiler.is_compiling()
        if not compiling and not rows.active[self.layer]:  # eager: no row of this batch computes here
            return self.base_layer(x, *args, **kwargs)
        if compiling:  # traced: no Python per layer in the graph (`traced`)
            output = self.base_layer(x, *args, **kwargs)
            args = (self.scaling, rows.index, rows.strength, self.stride, self.padding)
            return output + traced_lora(x.to(self.A.dtype), self.A, self.Bt, *args).to(output.dtype)
        plan = self._plan(x)
        if isinstance(plan, Merged):
            return self._merged.run(x, plan)
        output = self.base_layer(x, *args, **kwargs)
        delta = run_groups(x.to(self.A.dtype), self.A, self.Bt, plan, self.stride, self.padding)
        return output + delta.to(output.dtype)

    def _plan(self, x: torch.Tensor) -> list[Group] | Merged:
        """This layer's plan for the batch's picks, made on its first call with `x`'s row count: the picks and
        slots do not change while a batch runs, and the denoiser calls the layer once per step."""
        rows = self.rows
        key = (rows.version, x.shape[0])
        if self._planned[0] != key:
            if not self._asked:
                self._asked = True
                if merges(self.base_layer, self.A, self.stride, self.padding, x.device):
                    args = (self.A, self.Bt, self.scaling, self.stride, self.padding, self.rows, self.layer)
                    self._merged = MergedWeights(self.base_layer, *args)
            if self._merged is not None:
                plan = self._merged.plan(x.shape[0])
            else:
                ranks, only = rows.layer_plan(self.layer, x.shape[0])
                plan = plan_groups(x, self.A, self.Bt, self.scaling, rows.index, rows.strength, ranks, only)
            self._planned = (key, plan)
        return self._planned[1]


def install(components: dict[str, nn.Module], names: list[str], rows: BatchRows) -> None:
    """Re-base every template layer onto stacks and give it the gathered forward (before compile: the forwards and
    stacks are then part of the compiled graphs), and size `rows`' plan for them (in the order the layers are found)."""
    layers: list[Key] = []
    for comp, model in components.items():
        for module_name, layer in model.named_modules():
            if isinstance(layer, LoraLayer) and names[0] in layer.lora_A:
                gathered = GatheredLora(layer, names, rows, len(layers))
                layer.set_adapter([], inference_mode=True)  # PEFT's own branches: none active
                layer.forward = gathered.forward
                layers.append((comp, module_name))
    rows.bind(layers, len(names))


def _as_tensor(layer: LoraLayer, name: str) -> torch.Tensor:
    """PEFT keeps a scaling as a float unless prepared for hotswap; stacked, it becomes a tensor swaps write."""
    value = layer.scaling[name]
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), device=layer.lora_A[name].weight.device)
