"""Per-batch metadata of mixed batches: each row's adapter picks, in buffers written in place before each pipeline
call, and each layer's plan of ranks and slots that the eager layers read once per batch."""

from __future__ import annotations

import torch

from .slot import LiveSlot

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
