"""Eager mixed-batch LoRA by rank group: a layer call's rows grouped by rank bucket, each group computing only the
columns its adapters use, a group whose rows all use one adapter as that adapter's plain branch."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

# What one more group costs beyond its multiply-adds (its gathers, launches and Python), in multiply-adds: rows of a
# low rank join a higher bucket's group when the columns they would compute for nothing cost less than that. Small
# matmuls run far below peak, so the CPU value is set from timing mixed batches of the tiny preset, where merging won;
# the CUDA value is an estimate from kernel launch latency, not yet timed (`python -m lora_manager gpu-check`).
GROUP_COST_MACS = {"cpu": 200_000_000, "cuda": 500_000_000}
# A conv layer's gathered group runs one convolution over the A of every adapter its rows use (each row keeping its
# own columns) when they are at most this many, else each row's own A as one grouped convolution: a grouped
# convolution runs far below a plain one's speed on the CPU, while the plain one computes every adapter for every row.
UNION_CONV_ADAPTERS = 3


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
        at = rows_on(rows, x.device) if len(rows) < n else None
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
def rows_on(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
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
