"""The hotswap order, encoded once, for the engine and the benchmarks alike.

Order (each step needs the one before): `enable_lora_hotswap(target_rank=R)` -> first load (a zero template over the
union of every catalog adapter's modules, at rank R) -> `torch.compile` of the denoiser -> swaps (`slot.LiveSlot`),
which only write into the template's tensors (`copy_`/`fill_`), so compiled graphs stay valid and nothing recompiles.

With K slots the first load is K zero templates under the names slot0..slotK-1, all made active once before compile;
each slot is then swapped on its own, so a request can combine up to K adapters with a strength each. For mixed-adapter
batches (`rows` given) the slots are device slots instead: resident adapters that each row of a batch picks from
(`batched`), still written by the same in-place swaps.
"""

from __future__ import annotations

import torch
from torch import nn

from ..adapters.validate import lora_shapes
from ..quiet import quiet_loads
from .batched import install
from .rows import BatchRows
from .slot import LiveSlot

# dynamo's names for the denoiser's call arguments, first dimension: marked dynamic at compile, so one graph serves
# every batch size (sizes 0 and 1 still get their own)
BATCH_DIM = r"L\['(args|kwargs)'\].*:0"
SLOT = "slot0"  # the first (with one slot: the only) adapter name the model ever holds; every swap writes into one


def slot_names(slots: int) -> list[str]:
    return [f"slot{i}" for i in range(slots)]


def template_state_dict(
    components: dict[str, nn.Module], keys: set[tuple[str, str]], rank: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Zero LoRA weights at `rank` over `keys`, in the PEFT layout `load_lora_weights` accepts."""
    sd = {}
    for comp, module in sorted(keys):
        a_shape, b_shape = lora_shapes(components[comp].get_submodule(module), rank)
        sd[f"{comp}.{module}.lora_A.weight"] = torch.zeros(a_shape, dtype=dtype)
        sd[f"{comp}.{module}.lora_B.weight"] = torch.zeros(b_shape, dtype=dtype)
    return sd


def prepare_template(
    target,
    components: dict[str, nn.Module],
    keys: set[tuple[str, str]],
    rank: int,
    slots: int = 1,
    rows: BatchRows | None = None,
) -> list[LiveSlot]:
    """Steps 1 and 2 of the order on `target`, a pipeline (`load_lora_weights`) or one bare denoiser
    (`load_lora_adapter`, as the benchmarks use it; `components` then holds that denoiser alone): enable hotswap,
    then load one zero template per slot. With `rows`, every row of a batch picks its own slots
    (`batched.install`) instead of all slots adding up."""
    target.enable_lora_hotswap(target_rank=rank)
    dtype = next(iter(components.values())).dtype
    names = slot_names(slots)
    for name in names:  # a fresh state dict each time: a load may keep the tensors it is given
        sd = template_state_dict(components, keys, rank, dtype)
        # low_cpu_mem_usage=False: a normal load may otherwise alias the caller's tensors, and swaps would write into
        # them.
        with quiet_loads():
            if hasattr(target, "load_lora_weights"):
                target.load_lora_weights(sd, adapter_name=name, low_cpu_mem_usage=False)
            else:
                (prefix,) = components
                target.load_lora_adapter(sd, prefix=prefix, adapter_name=name, low_cpu_mem_usage=False)
    if rows is not None:
        install(components, names, rows)
    elif slots > 1:
        # diffusers activates only the last adapter loaded. set_adapters writes float scalings, so it runs before
        # LiveSlot turns them into the tensors that swaps write in place (a later set_adapters would recompile).
        target.set_adapters(names)
    return [LiveSlot(components, name) for name in names]


def compile_denoiser(denoiser: nn.Module, **compile_kwargs) -> None:
    """Step 3: compile in place (`nn.Module.compile`), so the module and its parameters stay the same objects."""
    denoiser.compile(**compile_kwargs)
