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
  use the same one adapter runs as one plain LoRA branch (no gather), planned once per batch (`BatchRows.write`);
  a small float32 layer instead runs each row with its merged weight (the base weight plus its adapters' B @ A,
  `MERGE_MAX_WEIGHTS`): kept per device slot for a single adapter at strength 1, made once per batch otherwise.

`index` and `strength` are tensors the engine writes in place before each pipeline call; a request combining up to
P adapters uses P picks, an unused pick has strength 0 and adds exactly 0. A layer that sees N rows (one per request:
the text encoder, called once on the prompts and once on the negative prompts) and one that sees 2N (the denoiser
under classifier-free guidance: diffusers concatenates [uncond rows; cond rows]) read the same buffers, sliced by
their input's row count.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch import nn

from .slot import LiveSlot
from .traced import traced_lora

Key = tuple[str, str]  # (component, module path)


class BatchRows:
    """Per-row adapter picks for the next pipeline call, in buffers written in place (never Python values baked into
    a graph): `index` [2B*P] (the device slot of each row's P picks), `strength` [2B, P], and `plan` [2, layers, 2B]
    on the CPU (each row's rank at each layer, and the one slot it uses there or -1), for batches of up to B
    requests. `write` repeats the call's N rows to fill all 2B, so a layer that sees n rows reads the first n: the N
    rows themselves (the text encoder, or a denoiser without guidance) or the N rows twice, which is exactly the
    [uncond; cond] batch of classifier-free guidance. Every batch size reads the same buffers through a slice of its
    own row count, so one compiled graph, dynamic in the batch dimension, serves them all."""

    def __init__(self, max_rows: int, picks: int, device: torch.device):
        self.picks = picks
        self.index = torch.zeros(2 * max_rows * picks, dtype=torch.long, device=device)
        self.strength = torch.zeros(2 * max_rows, picks, device=device)
        self.keys: list[Key] = []  # the template layers, in the order of `plan`'s second dimension (`install`)
        self.plan = torch.zeros(2, 0, 2 * max_rows, dtype=torch.long)
        self.active: list[bool] = []  # per layer: does any row of this batch compute there (eager layers skip)
        self.version = 0  # counts `write`s: eager layers plan their groups once per batch
        self._plan_lists: tuple[list[list[int]], list[list[int]]] = ([], [])  # `plan` as lists, for eager layers
        self._rank_lists: list[list[int]] = []  # `_ranks` as lists, for eager layers
        self.written: list[list[tuple[int, float]]] = []  # each row's (slot, strength) picks, as written
        self.single = False  # whether every row of this batch has at most one pick, at strength 1 (merged layers)
        # per layer and row, for `single` batches: the device slot whose merged weight the row runs, or D (the base)
        self.weight_index = torch.zeros(0, 0, dtype=torch.long)
        self._ranks = torch.zeros(0, 0, dtype=torch.long)  # [layers, D]: each device slot's rank at each layer
        # per device slot: its `LiveSlot.loads` when its column of `_ranks` was computed (keys eager layers' caches)
        self.loads: list[int] = []

    def bind(self, keys: list[Key], slots: int) -> None:
        """Size the plan for the template's layers (once, before any compile)."""
        self.keys = keys
        self.plan = torch.zeros(2, len(keys), self.strength.shape[0], dtype=torch.long)
        self.active = [False] * len(keys)
        self._ranks = torch.zeros(len(keys), slots, dtype=torch.long)
        self._rank_lists = self._ranks.tolist()
        self.loads = [-1] * slots

    @torch.no_grad()
    def write(self, rows: list[list[tuple[int, float]]], slots: list[LiveSlot] | None = None) -> None:
        """Set every row's (device slot, strength) picks, at most B rows, and plan each layer's rows for what the
        device `slots` hold (None: as at the last call). Unused picks get strength 0 (slot 0), which adds
        exactly nothing."""
        total = self.strength.shape[0]
        if not 0 < len(rows) <= total // 2:
            raise ValueError(f"a batch has 1 to {total // 2} rows, not {len(rows)}")
        flat_index, flat_strength = [0] * self.index.numel(), [0.0] * self.strength.numel()
        for n in range(total):
            for p, (slot, s) in enumerate(rows[n % len(rows)]):
                flat_index[n * self.picks + p], flat_strength[n * self.picks + p] = slot, s
        index, strength = torch.tensor(flat_index), torch.tensor(flat_strength).view(self.strength.shape)
        self.index.copy_(index, non_blocking=True)
        self.strength.copy_(strength, non_blocking=True)
        self.version += 1
        self.written = rows
        self.single = all(len(row) <= 1 and all(s == 1.0 for _, s in row) for row in rows)
        if slots is not None:
            self._hold(slots)
        if self.keys:
            self._plan(index.view(total, self.picks), strength)

    def _hold(self, slots: list[LiveSlot]) -> None:
        """Each slot's rank at each layer (0 where its adapter has no weights), recomputed for the slots written
        since (the slot's own `loads` count says so: a slot emptied by a failed write counts too)."""
        changed = [i for i, slot in enumerate(slots) if slot.loads != self.loads[i]]
        for i in changed:
            modules = slots[i].weights.modules if slots[i].weights is not None else {}
            self._ranks[:, i] = torch.tensor([modules[k].rank if k in modules else 0 for k in self.keys])
            self.loads[i] = slots[i].loads
        if changed:
            self._rank_lists = self._ranks.tolist()

    def _plan(self, picks: torch.Tensor, strength: torch.Tensor) -> None:
        """Per layer and row: the highest rank among the row's picks (0: the row skips the layer), and the slot of
        its only pick with weights there (-1 if none or several)."""
        ranks = self._ranks[:, picks] * (strength != 0)  # [layers, 2B, P]
        used = ranks > 0
        only = picks.expand_as(ranks).gather(2, used.to(torch.uint8).argmax(2, keepdim=True)).squeeze(2)
        self.plan[0].copy_(ranks.amax(2))
        self.plan[1].copy_(torch.where(used.sum(2) == 1, only, -1))
        self.weight_index = torch.where(self.plan[1] >= 0, self.plan[1], self._ranks.shape[1])
        self.active = (self.plan[0] > 0).any(1).tolist()
        self._plan_lists = (self.plan[0].tolist(), self.plan[1].tolist())

    def layer_plan(self, layer: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The first n rows' ranks and only slots at `layer` (`plan`, read once per batch)."""
        ranks, only = self._plan_lists
        return tuple(ranks[layer][:n]), tuple(only[layer][:n])

    def slot_ranks(self, layer: int) -> list[int]:
        """The rank at `layer` of the adapter each device slot holds (0: it has no weights there)."""
        return self._rank_lists[layer]


# What one more group costs beyond its multiply-adds (its gathers, launches and Python), in multiply-adds: rows of a
# low rank join a higher bucket's group when the columns they would compute for nothing cost less than that. Small
# matmuls run far below peak, so the CPU value is set from timing mixed batches of the tiny preset, where merging won;
# the CUDA value is an estimate from kernel launch latency, not yet timed (`python -m lora_manager gpu-check`).
GROUP_COST_MACS = {"cpu": 200_000_000, "cuda": 500_000_000}
# A conv layer's gathered group runs one convolution over the A of every adapter its rows use (each row keeping its
# own columns) when they are at most this many, else each row's own A as one grouped convolution: a grouped
# convolution runs far below a plain one's speed on the CPU, while the plain one computes every adapter for every row.
UNION_CONV_ADAPTERS = 3
# An eager float32 linear or conv layer with at most this many weights runs a batch with merged weights: each row's
# base weight plus its adapters' B @ A (each slot's merged weight kept while it holds its adapter, other mixes made
# once per batch), rows that share their picks in one call. At small widths a LoRA branch costs its operations' fixed
# overhead far more than its multiply-adds. Set from timing the tiny preset's mixed batches on the CPU; off on CUDA
# until timed.
MERGE_MAX_WEIGHTS = {"cpu": 1 << 17, "cuda": 0}
# A merged conv layer (other than 1x1) with at least this many distinct weights in a batch runs them as one grouped
# convolution, every row with its own weight; with fewer, one convolution per weight on its rows (timed on the CPU).
GROUPED_CONV_WEIGHTS = 3


@lru_cache(maxsize=4096)
def row_groups(
    ranks: tuple[int, ...], only: tuple[int, ...], group_rows: int = 0
) -> tuple[tuple[tuple[int, ...], int, int], ...]:
    """The rows of one layer call grouped by rank bucket (the next power of two): (rows, the group's highest rank,
    the one slot all its rows use or -1). A bucket joins the next one up when its rows times the ranks they would add
    is at most `group_rows`, what one more group costs in rank-rows at this layer; rows of rank 0 (no adapter of theirs
    targets the layer) form a bucket of their own that is otherwise left out, since their picks add exactly 0."""
    buckets: dict[int, list[int]] = {}
    for row, rank in enumerate(ranks):
        buckets.setdefault(1 << (rank - 1).bit_length() if rank else 0, []).append(row)
    merged: list[list[int]] = []
    for _, rows in sorted(buckets.items(), reverse=True):  # highest bucket first: lower ones join it if cheap
        if merged and sum(max(ranks[r] for r in merged[-1]) - ranks[r] for r in rows) <= group_rows:
            merged[-1] += rows
        elif ranks[rows[0]]:
            merged.append(rows)
    groups = []
    for rows in reversed(merged):
        slots = {only[r] for r in rows if ranks[r]}
        groups.append((tuple(sorted(rows)), max(ranks[r] for r in rows), slots.pop() if len(slots) == 1 else -1))
    return tuple(groups)


def _group_rows(x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor) -> int:
    """`GROUP_COST_MACS` at this layer in rank-rows (one row computing one more rank column), a power of two."""
    n = x.shape[0]
    if A.dim() == 5:
        per = (x.numel() // (n * x.shape[1])) * (A[0, 0].numel() + Bt.shape[-1])  # about H'W' x (in kh kw + out)
    else:
        per = (x.numel() // (n * x.shape[-1])) * (x.shape[-1] + Bt.shape[-1])  # tokens x (in + out)
    rows = GROUP_COST_MACS.get(x.device.type, GROUP_COST_MACS["cuda"]) // max(per, 1)
    return 1 << (rows.bit_length() - 1) if rows else 0


@dataclass(frozen=True)
class Group:
    """One group of a layer call's rows, its weights computed (`plan_groups`), ready to run (`run_groups`)."""

    rows: torch.Tensor | None  # the group's row numbers, None when it is every row
    rank: int
    slot: int  # the one adapter every row uses (its plain branch), else -1
    weight: torch.Tensor  # per row, in the stacks' dtype: [n] with `slot` or `union`, else [n, P] (each pick's)
    index: torch.Tensor | None = None  # gathered rows: their picks' slots, [n*P]
    union: tuple[list[int], torch.Tensor, torch.Tensor] | None = None  # conv rows on a few adapters (`_conv_blocks`)


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


def plan_groups(
    x: torch.Tensor,
    A: torch.Tensor,
    Bt: torch.Tensor,
    scaling: torch.Tensor,
    index: torch.Tensor,
    strength: torch.Tensor,
    ranks: tuple[int, ...],
    only: tuple[int, ...],
) -> list[Group]:
    """The rows of one layer call for `x`'s n rows, grouped by rank (`row_groups`), each group's weights computed:
    strength times scaling of each pick. Depends only on the batch's picks, so an eager layer plans once per batch."""
    n, picks = x.shape[0], strength.shape[1]
    index, strength = index[: n * picks].view(n, picks), strength[:n]
    # strengths and scalings are float32; the product is cast to the stacks' dtype (float16/bfloat16 pipelines), since
    # bmm refuses mixed dtypes and type promotion would otherwise turn the half-precision rows to float32
    weight = strength * scaling[index]  # [n, P]
    groups = []
    for rows, rank, slot in row_groups(ranks, only, _group_rows(x, A, Bt)):
        at = _rows_on(rows, x.device) if len(rows) < n else None
        picked, w = (index, weight) if at is None else (index.index_select(0, at), weight.index_select(0, at))
        if slot >= 0:  # the same adapter on every row: its strength and scaling per row
            groups.append(Group(at, rank, slot, (w * (picked == slot)).sum(1).to(A.dtype)))
            continue
        union = _conv_blocks(tuple(only[r] if ranks[r] else None for r in rows), x.device) if A.dim() == 5 else None
        if union is not None:  # each row's one pick here; the others weigh 0
            groups.append(Group(at, rank, -1, (w * (picked == union[2][:, None])).sum(1).to(A.dtype), union=union))
        else:
            groups.append(Group(at, rank, -1, w.to(A.dtype), index=picked.flatten()))
    return groups


def run_groups(
    x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, groups: list[Group], stride: list[int], padding: list[int]
) -> torch.Tensor:
    """The LoRA part of a layer's output for `x`'s rows, group by group (rows no group holds add nothing)."""
    if len(groups) == 1 and groups[0].rows is None:  # every row in one group: no gather, no scatter
        return _group(x, A, Bt, groups[0], stride, padding)
    out = x.new_zeros(_out_shape(x, A, Bt, stride, padding), dtype=A.dtype)
    for group in groups:
        out.index_copy_(0, group.rows, _group(x.index_select(0, group.rows), A, Bt, group, stride, padding))
    return out


@lru_cache(maxsize=1024)
def _rows_on(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A group's row numbers as an index tensor on `device`, made once per distinct group."""
    return torch.tensor(rows, device=device)


def _group(x, A, Bt, group: Group, stride, padding) -> torch.Tensor:
    """One group's LoRA output at its rank: one adapter's plain branch for all rows, a conv layer's rows on a few
    adapters as one convolution over their A (`_conv_rows`), or each row's picks gathered (a gather and two batched
    matmuls; conv layers: every row's own A as one grouped convolution)."""
    n, rank, slot = x.shape[0], group.rank, group.slot
    if slot >= 0:
        if A.dim() == 5:
            h = F.conv2d(x, A[slot, :rank], None, stride, padding) * group.weight[:, None, None, None]  # [n, r, H', W']
            return torch.matmul(Bt[slot, :rank].T, h.flatten(2)).view(n, -1, *h.shape[-2:])
        h = F.linear(x, A[slot, :rank]) * group.weight.view(n, *[1] * (x.dim() - 1))
        return torch.matmul(h, Bt[slot, :rank])
    if group.union is not None:
        return _conv_rows(x, A, Bt, group.weight, rank, *group.union, stride, padding)
    weight, picks = group.weight, group.weight.shape[1]
    Bt = Bt[:, :rank].index_select(0, group.index).view(n, picks * rank, -1)  # [n, P*R, out]
    A = A[:, :rank].index_select(0, group.index)  # [n*P, R, in(, kh, kw)]
    if A.dim() == 5:  # a Conv2d layer: every row's own A as one grouped convolution, B (1x1) as a batched matmul
        h = F.conv2d(x.reshape(1, -1, *x.shape[2:]), A.flatten(0, 1), None, stride, padding, groups=n)
        size = h.shape[-2:]
        h = (h.view(n, picks, rank, -1) * weight[:, :, None, None]).view(n, picks * rank, -1)  # [n, P*R, H'W']
        return torch.bmm(Bt.transpose(1, 2), h).view(n, -1, *size)
    A = A.view(n, picks * rank, -1)  # [n, P*R, in]
    h = torch.bmm(x.reshape(n, -1, x.shape[-1]), A.transpose(1, 2))  # [n, L, P*R]
    h = (h.view(n, -1, picks, rank) * weight[:, None, :, None]).view(n, -1, picks * rank)
    return torch.bmm(h, Bt).view(*x.shape[:-1], -1)


def _conv_rows(x, A, Bt, weight, rank: int, slots: list[int], block, own, stride, padding) -> torch.Tensor:
    """Rows each on one of a few adapters at a conv layer: one plain convolution with those adapters' A, each row then
    keeping its own adapter's columns (`block`, its slot `own`, -1 for none), and B as a batched matmul."""
    n = x.shape[0]
    h = F.conv2d(x, A[slots, :rank].flatten(0, 1), None, stride, padding)  # [n, U*R, H', W'], U = len(slots)
    size = h.shape[-2:]
    h = h.view(-1, rank, size.numel()).index_select(0, block) * weight[:, None, None]  # [n, R, H'W']
    Bt = Bt[:, :rank].index_select(0, own.clamp(min=0))  # [n, R, out]
    return torch.bmm(Bt.transpose(1, 2), h).view(n, -1, *size)


@lru_cache(maxsize=1024)
def _conv_blocks(
    owners: tuple[int | None, ...], device: torch.device
) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """For `_conv_rows`: per row of a group its one slot at this layer (-1: several, None: none) in, and out the slots
    the rows use, each row's block among their [n*U] column blocks and each row's slot (-1: none); None when a row
    combines adapters or they are more than `UNION_CONV_ADAPTERS`."""
    used = sorted({s for s in owners if s is not None})
    if -1 in used or len(used) > UNION_CONV_ADAPTERS:
        return None
    block = [row * len(used) + (used.index(s) if s is not None else 0) for row, s in enumerate(owners)]
    own = [s if s is not None else -1 for s in owners]
    return used, torch.tensor(block, device=device), torch.tensor(own, device=device)


def _out_shape(x, A, Bt, stride, padding) -> tuple[int, ...]:
    """The operator's output shape: a linear layer's rows with its out features, or a conv layer's output map."""
    if A.dim() == 5:
        size = [(x.shape[i + 2] + 2 * padding[i] - A.shape[3 + i]) // stride[i] + 1 for i in range(2)]
        return (x.shape[0], Bt.shape[-1], *size)
    return (*x.shape[:-1], Bt.shape[-1])


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
        # `Merged`: per device slot its adapter's merged weight (the base weight plus B @ A x scaling), then the base
        # weight itself, [D + 1, *weight]; made on a merged layer's first batch, a slot's entry remade after its swap
        self._weights: torch.Tensor | None = None
        self._made: list[int | None] = [None] * len(names)  # per slot: the `loads` count its entry was made at
        self._merging: bool | None = None  # `_merges`, asked once
        self._bias_rows: dict[int, torch.Tensor] = {}  # "grouped": the base bias repeated for n rows, by n
        # per slot: views of its Bt, its A as a matrix and its scaling (swaps write into them in place)
        self._slot_views = [(self.Bt[i], self.A[i].flatten(1), self.scaling[i]) for i in range(len(names))]
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
            return self._merged(x, plan)
        output = self.base_layer(x, *args, **kwargs)
        delta = run_groups(x.to(self.A.dtype), self.A, self.Bt, plan, self.stride, self.padding)
        return output + delta.to(output.dtype)

    def _plan(self, x: torch.Tensor) -> list[Group] | Merged:
        """This layer's plan for the batch's picks, made on its first call with `x`'s row count: the picks and
        slots do not change while a batch runs, and the denoiser calls the layer once per step."""
        rows = self.rows
        key = (rows.version, x.shape[0])
        if self._planned[0] != key:
            if self._merging is None:
                self._merging = self._merges(x)
            if self._merging:
                plan = self._merge(x.shape[0])
            else:
                ranks, only = rows.layer_plan(self.layer, x.shape[0])
                plan = plan_groups(x, self.A, self.Bt, self.scaling, rows.index, rows.strength, ranks, only)
            self._planned = (key, plan)
        return self._planned[1]

    def _merges(self, x: torch.Tensor) -> bool:
        """Whether this layer runs its batches with merged weights (`MERGE_MAX_WEIGHTS`): a plain float32 linear or
        conv layer whose LoRA A convolves as it does (same stride and padding, no dilation, groups or padding mode)."""
        base = self.base_layer
        if type(base) not in (nn.Linear, nn.Conv2d) or not self.A.dtype == base.weight.dtype == torch.float32:
            return False
        if isinstance(base, nn.Conv2d):
            plain = base.groups == 1 and base.padding_mode == "zeros" and all(d == 1 for d in base.dilation)
            if not plain or self.stride != list(base.stride) or self.padding != list(base.padding):
                return False
        return base.weight.numel() <= MERGE_MAX_WEIGHTS.get(x.device.type, 0)

    @torch.no_grad()
    def _merge(self, n: int) -> Merged:
        """The batch's weights, one per distinct set of picks (classifier-free guidance repeats the rows; rows without
        an adapter here share the base weight). A batch of single picks at strength 1, as the mixed batches of
        requests for one adapter each are, indexes the kept merged weights (`_weights`); any other batch adds
        strength x B @ A x scaling of each pick to the base weight."""
        rows = self.rows
        if self._weights is None:
            weight = self.base_layer.weight
            self._weights = weight.detach().unsqueeze(0).repeat(len(self._made) + 1, *[1] * weight.dim())
        if rows.single:
            return self._merge_single(n)
        written, ranks = rows.written, rows.slot_ranks(self.layer)
        keys = [tuple((slot, s) for slot, s in written[r % len(written)] if s != 0 and ranks[slot]) for r in range(n)]
        distinct = list(dict.fromkeys(keys))
        base = self.base_layer.weight
        weights = []
        for key in distinct:
            weight = base
            for slot, s in key:
                weight = torch.add(weight, self._slot_weight(slot) - base, alpha=s)
            weights.append(weight)
        if len(distinct) == 1:
            return Merged("one", weights)
        stacked = torch.stack([weights[distinct.index(k)] for k in keys]) if self._stacks(len(distinct)) else None
        return self._merged_plan(n, weights, stacked, [[r for r, k in enumerate(keys) if k == d] for d in distinct])

    def _merge_single(self, n: int) -> Merged:
        """`_merge` for a batch of single picks at strength 1: each row's weight is its slot's kept one, or the base."""
        only = self.rows.weight_index[self.layer, :n]
        slots = self.rows.layer_plan(self.layer, n)[1]
        distinct = list(dict.fromkeys(slots))
        weights = [self._slot_weight(slot) if slot >= 0 else self.base_layer.weight for slot in distinct]
        if len(distinct) == 1:
            return Merged("one", weights)
        stacked = self._weights.index_select(0, only) if self._stacks(len(distinct)) else None
        return self._merged_plan(n, weights, stacked, [[r for r, s in enumerate(slots) if s == d] for d in distinct])

    def _merged_plan(
        self, n: int, weights: list[torch.Tensor], stacked: torch.Tensor | None, rows: list[list[int]]
    ) -> Merged:
        """How a batch of several merged weights runs (`Merged`), given each distinct weight, every row's weight
        stacked [n, *weight] (where `_stacks`) and the rows of each distinct weight."""
        if weights[0].dim() == 2:  # linear: one batched matmul over every row's own weight
            return Merged("bmm", weights, stacked=stacked)
        if self._pointwise():  # a matmul per pixel
            return Merged("bmm", weights, stacked=stacked.flatten(2))
        if len(weights) >= GROUPED_CONV_WEIGHTS:
            bias = self.base_layer.bias
            if bias is not None and n not in self._bias_rows:
                self._bias_rows[n] = bias.detach().repeat(n)
            return Merged("grouped", weights, stacked=stacked.flatten(0, 1), bias=self._bias_rows.get(n))
        device = self.A.device  # a few weights: one call per weight, on its rows
        return Merged("rows", weights, rows=[_rows_on(tuple(r), device) for r in rows])

    def _stacks(self, weights: int) -> bool:
        """Whether a batch of this many distinct weights runs on every row's weight stacked (`_merged_plan`)."""
        return self.base_layer.weight.dim() == 2 or self._pointwise() or weights >= GROUPED_CONV_WEIGHTS

    def _pointwise(self) -> bool:
        """A 1x1 convolution with stride 1 and no padding: a matmul per pixel."""
        return self.base_layer.weight.shape[2:] == (1, 1) and self.stride == [1, 1] and self.padding == [0, 0]

    def _slot_weight(self, slot: int) -> torch.Tensor:
        """The base weight plus B @ A x scaling of the adapter `slot` holds at this layer (`_weights`), remade once
        after each swap into the slot (mixed batches load every adapter at strength 1: its scaling changes only with
        it)."""
        held = self.rows.loads[slot]
        entry = self._weights[slot]
        if self._made[slot] != held:
            rank, (Bt, A, scaling) = self.rows.slot_ranks(self.layer)[slot], self._slot_views[slot]
            entry.copy_(self.base_layer.weight)
            entry.view(entry.shape[0], -1).addmm_(Bt[:rank].T, A[:rank], alpha=scaling.item())
            self._made[slot] = held
        return entry

    def _merged(self, x: torch.Tensor, plan: Merged) -> torch.Tensor:
        """The layer's output with merged weights, run as the plan says (`Merged`)."""
        base = self.base_layer
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
