"""Mixed batches on small float32 layers as merged weights: each row runs its base weight plus its adapters'
B @ A, kept per device slot for a single adapter at strength 1 and made once per batch otherwise, since at small
widths a LoRA branch costs its operations' fixed overhead far more than its multiply-adds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .groups import rows_on
from .rows import BatchRows

# An eager float32 linear or conv layer with at most this many weights runs a batch with merged weights: each row's
# base weight plus its adapters' B @ A (each slot's merged weight kept while it holds its adapter, other mixes made
# once per batch), rows that share their picks in one call. At small widths a LoRA branch costs its operations' fixed
# overhead far more than its multiply-adds. Set from timing the tiny preset's mixed batches on the CPU; off on CUDA
# until timed.
MERGE_MAX_WEIGHTS = {"cpu": 1 << 17, "cuda": 0}
# A merged conv layer (other than 1x1) with at least this many distinct weights in a batch runs them as one grouped
# convolution, every row with its own weight; with fewer, one convolution per weight on its rows (timed on the CPU).
GROUPED_CONV_WEIGHTS = 3


@dataclass(frozen=True)
class Merged:
    """A small layer's batch as merged weights (`MERGE_MAX_WEIGHTS`): one weight per distinct set of picks (the base
    weight plus those picks' B @ A), run as `how` says: "one" (a single weight: the plain layer), "bmm" (each row's
    weight, `stacked` [n, out, in], in one batched matmul: linear and 1x1 conv layers), "grouped" (each row's weight,
    `stacked` [n*out, in, kh, kw], as one grouped convolution) or "rows" (each weight on its `rows`: conv layers)."""

    how: str
    weights: list[torch.Tensor]
    stacked: torch.Tensor | None = None
    rows: list[torch.Tensor] | None = None
    bias: torch.Tensor | None = None  # "grouped": the base bias once per row


def merges(base: nn.Module, A: torch.Tensor, stride: list[int], padding: list[int], device: torch.device) -> bool:
    """Whether a layer runs its batches with merged weights (`MERGE_MAX_WEIGHTS`): a plain float32 linear or conv
    layer whose LoRA A convolves as it does (same stride and padding, no dilation, groups or padding mode)."""
    if type(base) not in (nn.Linear, nn.Conv2d) or not A.dtype == base.weight.dtype == torch.float32:
        return False
    if isinstance(base, nn.Conv2d):
        plain = base.groups == 1 and base.padding_mode == "zeros" and all(d == 1 for d in base.dilation)
        if not plain or stride != list(base.stride) or padding != list(base.padding):
            return False
    return base.weight.numel() <= MERGE_MAX_WEIGHTS.get(device.type, 0)


class MergedWeights:
    """One template layer's merged weights for mixed batches: plans a batch (`plan`) and runs it (`run`). Keeps, per
    device slot, its adapter's merged weight (the base weight plus B @ A x scaling), then the base weight itself, in
    one [D + 1, *weight] tensor made on the first batch, a slot's entry remade after each swap into it."""

    def __init__(
        self,
        base: nn.Module,
        A: torch.Tensor,
        Bt: torch.Tensor,
        scaling: torch.Tensor,
        stride: list[int],
        padding: list[int],
        rows: BatchRows,
        layer: int,
    ):
        self.base, self.stride, self.padding, self.rows, self.layer = base, stride, padding, rows, layer
        self._device = A.device
        self._weights: torch.Tensor | None = None
        self._made: list[int | None] = [None] * A.shape[0]  # per slot: the `loads` count its entry was made at
        self._bias_rows: dict[int, torch.Tensor] = {}  # "grouped": the base bias repeated for n rows, by n
        # per slot: views of its Bt, its A as a matrix and its scaling (swaps write into them in place)
        self._slot_views = [(Bt[i], A[i].flatten(1), scaling[i]) for i in range(A.shape[0])]

    @torch.no_grad()
    def plan(self, n: int) -> Merged:
        """The batch's weights, one per distinct set of picks (classifier-free guidance repeats the rows; rows without
        an adapter here share the base weight). A batch of single picks at strength 1, as the mixed batches of
        requests for one adapter each are, indexes the kept merged weights; any other batch adds strength x B @ A x
        scaling of each pick to the base weight."""
        rows = self.rows
        if self._weights is None:
            weight = self.base.weight
            self._weights = weight.detach().unsqueeze(0).repeat(len(self._made) + 1, *[1] * weight.dim())
        if rows.single:
            return self._plan_single(n)
        written, ranks = rows.written, rows.slot_ranks(self.layer)
        keys = [tuple((slot, s) for slot, s in written[r % len(written)] if s != 0 and ranks[slot]) for r in range(n)]
        distinct = list(dict.fromkeys(keys))
        base = self.base.weight
        weights = []
        for key in distinct:
            weight = base
            for slot, s in key:
                weight = torch.add(weight, self._slot_weight(slot) - base, alpha=s)
            weights.append(weight)
        if len(distinct) == 1:
            return Merged("one", weights)
        stacked = torch.stack([weights[distinct.index(k)] for k in keys]) if self._stacks(len(distinct)) else None
        return self._how(n, weights, stacked, [[r for r, k in enumerate(keys) if k == d] for d in distinct])

    def _plan_single(self, n: int) -> Merged:
        """`plan` for a batch of single picks at strength 1: each row's weight is its slot's kept one, or the base."""
        only = self.rows.weight_index[self.layer, :n]
        slots = self.rows.layer_plan(self.layer, n)[1]
        distinct = list(dict.fromkeys(slots))
        weights = [self._slot_weight(slot) if slot >= 0 else self.base.weight for slot in distinct]
        if len(distinct) == 1:
            return Merged("one", weights)
        stacked = self._weights.index_select(0, only) if self._stacks(len(distinct)) else None
        return self._how(n, weights, stacked, [[r for r, s in enumerate(slots) if s == d] for d in distinct])

    def _how(self, n: int, weights: list[torch.Tensor], stacked: torch.Tensor | None, rows: list[list[int]]) -> Merged:
        """How a batch of several merged weights runs (`Merged`), given each distinct weight, every row's weight
        stacked [n, *weight] (where `_stacks`) and the rows of each distinct weight."""
        if weights[0].dim() == 2:  # linear: one batched matmul over every row's own weight
            return Merged("bmm", weights, stacked=stacked)
        if self._pointwise():  # a matmul per pixel
            return Merged("bmm", weights, stacked=stacked.flatten(2))
        if len(weights) >= GROUPED_CONV_WEIGHTS:
            bias = self.base.bias
            if bias is not None and n not in self._bias_rows:
                self._bias_rows[n] = bias.detach().repeat(n)
            return Merged("grouped", weights, stacked=stacked.flatten(0, 1), bias=self._bias_rows.get(n))
        return Merged("rows", weights, rows=[rows_on(tuple(r), self._device) for r in rows])  # one call per weight

    def _stacks(self, weights: int) -> bool:
        """Whether a batch of this many distinct weights runs on every row's weight stacked (`_how`)."""
        return self.base.weight.dim() == 2 or self._pointwise() or weights >= GROUPED_CONV_WEIGHTS

    def _pointwise(self) -> bool:
        """A 1x1 convolution with stride 1 and no padding: a matmul per pixel."""
        return self.base.weight.shape[2:] == (1, 1) and self.stride == [1, 1] and self.padding == [0, 0]

    def _slot_weight(self, slot: int) -> torch.Tensor:
        """The base weight plus B @ A x scaling of the adapter `slot` holds at this layer, remade once after each swap
        into the slot (mixed batches load every adapter at strength 1: its scaling changes only with it)."""
        held = self.rows.loads[slot]
        entry = self._weights[slot]
        if self._made[slot] != held:
            rank, (Bt, A, scaling) = self.rows.slot_ranks(self.layer)[slot], self._slot_views[slot]
            entry.copy_(self.base.weight)
            entry.view(entry.shape[0], -1).addmm_(Bt[:rank].T, A[:rank], alpha=scaling.item())
            self._made[slot] = held
        return entry

    def run(self, x: torch.Tensor, plan: Merged) -> torch.Tensor:
        """The layer's output with merged weights, run as the plan says (`Merged`)."""
        base = self.base
        conv = isinstance(base, nn.Conv2d)
        run = base._conv_forward if conv else F.linear
        n = x.shape[0]
        if plan.how == "one":
            return run(x, plan.weights[0], base.bias)
        if plan.how == "bmm" and conv:  # [n, out, in] @ [n, in, H*W]
            flat = x.flatten(2)
            out = (
                torch.bmm(plan.stacked, flat)
                if base.bias is None
                else torch.baddbmm(base.bias[:, None], plan.stacked, flat)
            )
            return out.view(n, -1, *x.shape[2:])
        if plan.how == "bmm":  # [n, tokens, in] @ [n, in, out]
            rows, weight = x.reshape(n, -1, x.shape[-1]), plan.stacked.transpose(1, 2)
            out = torch.bmm(rows, weight) if base.bias is None else torch.baddbmm(base.bias, rows, weight)
            return out.view(*x.shape[:-1], -1)
        if plan.how == "grouped":  # every row its own group of channels
            out = F.conv2d(x.reshape(1, -1, *x.shape[2:]), plan.stacked, plan.bias, base.stride, base.padding, groups=n)
            return out.view(n, -1, *out.shape[2:])
        out = None
        for rows, weight in zip(plan.rows, plan.weights, strict=True):
            y = run(x.index_select(0, rows), weight, base.bias)
            out = y.new_empty((n, *y.shape[1:])) if out is None else out
            out.index_copy_(0, rows, y)
        return out
