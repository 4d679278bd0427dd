"""Check an adapter against the base model and the hotswap template before a single weight is touched."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import AdapterIncompatibleError, AdapterValueError, LoraManagerError
from .reader import AdapterWeights

MAX_LISTED = 4  # problems spelled out in one message; the rest are counted


@dataclass(frozen=True)
class Problem:
    kind: type[LoraManagerError]
    text: str


def lora_shapes(layer: nn.Module, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of lora_A and lora_B for `layer` at `rank`, as PEFT builds them."""
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    if isinstance(base, nn.Linear):
        return (rank, base.in_features), (base.out_features, rank)
    if isinstance(base, nn.Conv2d):
        kh, kw = base.kernel_size
        return (rank, base.in_channels // base.groups, kh, kw), (base.out_channels, rank, 1, 1)
    raise TypeError(type(base).__name__)


def check_adapter(
    adapter_id: str,
    weights: AdapterWeights,
    components: dict[str, nn.Module],
    template: set[tuple[str, str]] | None,
    target_rank: int | None,
) -> None:
    """Collect every problem, then raise one error naming the adapter, the modules and the fix."""
    finite = _all_finite(weights)
    problems = [p for key, m in weights.modules.items() for p in _module_problems(key, m, components, finite)]
    uncovered = [
        k for k, m in weights.modules.items() if template is not None and k not in template and _fits(k, m, components)
    ]
    if uncovered:
        problems.append(_uncovered(uncovered))
    if target_rank is not None and weights.rank > target_rank:
        worst = max(weights.modules.items(), key=lambda kv: kv[1].rank)[0]
        problems.append(
            Problem(
                AdapterIncompatibleError,
                f"rank {weights.rank} (at {'.'.join(worst)}) > target_rank {target_rank}: restart with "
                f"--target-rank {weights.rank}, or add the adapter to the catalog so the template is sized for it",
            )
        )
    if problems:
        listed = "; ".join(p.text for p in problems[:MAX_LISTED])
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise problems[0].kind(f"Adapter {adapter_id!r} refused: {listed}{more}.", adapter_id)


def _all_finite(weights: AdapterWeights) -> bool:
    """Whether every weight is finite, in one call over them all (every read pays for it): each tensor's largest
    magnitude, which is NaN or Inf exactly when the tensor holds one."""
    tensors = [t for m in weights.modules.values() for t in (m.A, m.B)]
    return not tensors or bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors, math.inf))).all())


def _fits(key, m, components) -> bool:
    """Whether the module exists in the base model with the shapes the adapter's A and B have."""
    try:
        a_shape, b_shape = lora_shapes(components[key[0]].get_submodule(key[1]), m.rank)
    except (AttributeError, TypeError):
        return False
    return (tuple(m.A.shape), tuple(m.B.shape)) == (a_shape, b_shape)


def _uncovered(keys: list[tuple[str, str]]) -> Problem:
    """One problem for every module outside the template, with the fix said once."""
    names = ", ".join(".".join(k) for k in keys[:MAX_LISTED])
    more = f" and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
    return Problem(
        AdapterIncompatibleError,
        f"{len(keys)} of its modules are outside the hotswap template ({names}{more}): add the adapter (or one that "
        "targets the same modules) to the catalog and restart, so the template spans its modules",
    )


def _module_problems(key, m, components, finite: bool) -> list[Problem]:
    """One module's problems; `finite`: the adapter's weights are known to be finite (else each module is checked)."""
    comp, module = key
    name = f"{comp}.{module}"
    try:
        layer = components[comp].get_submodule(module)
    except AttributeError:
        return [
            Problem(AdapterIncompatibleError, f"{name} does not exist in this base model (made for another model?)")
        ]
    try:
        a_shape, b_shape = lora_shapes(layer, m.rank)
    except TypeError as e:
        return [Problem(AdapterIncompatibleError, f"{name} is a {e} layer; LoRA is supported on Linear and Conv2d")]
    problems = []
    if tuple(m.A.shape) != a_shape or tuple(m.B.shape) != b_shape:
        problems.append(
            Problem(
                AdapterIncompatibleError,
                f"{name} has lora_A {tuple(m.A.shape)} / lora_B {tuple(m.B.shape)} but this base model needs "
                f"{a_shape} / {b_shape}: the adapter was made for another base model",
            )
        )
    if not finite and not (torch.isfinite(m.A).all() and torch.isfinite(m.B).all()):
        problems.append(Problem(AdapterValueError, f"{name} holds NaN or Inf values: the file is broken"))
    return problems
