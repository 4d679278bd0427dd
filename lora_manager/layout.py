"""The engine's layout, built and checked once: the slots one request combines, the adapters resident on the device,
and the requests one pipeline call runs. The scheduler, residency and compile read it from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    mix_slots: int = 1  # how many adapters one request may combine (hotswap slots, added up by PEFT)
    device_slots: int = 1  # how many adapters stay resident on the device
    max_batch: int = 1  # how many queued requests one pipeline call runs

    @property
    def mixed(self) -> bool:
        """Whether a pipeline call mixes requests for different adapters, each row picking its own device slot;
        otherwise one request's adapters fill the first slots, each at its strength."""
        return self.max_batch > 1

    @classmethod
    def of(cls, slots: int = 1, max_batch: int = 1, device_slots: int | None = None) -> Layout:
        """The layout of `LoraManager(slots=, max_batch=, device_slots=)`: `device_slots` defaults to
        max(slots, max_batch) with mixed batches, and must equal `slots` without them."""
        if slots < 1 or max_batch < 1:
            raise ValueError(f"slots and max_batch must be at least 1, got {slots} and {max_batch}.")
        mixed = max_batch > 1
        resident = device_slots or (max(slots, max_batch) if mixed else slots)
        if resident < slots or (not mixed and resident != slots):
            raise ValueError(
                f"device_slots ({resident}) must be at least slots ({slots}), and differ from it only with "
                "max_batch > 1."
            )
        return cls(slots, resident, max_batch)
