"""The pipeline's dtype: as users name it, and the default for where it runs."""

from __future__ import annotations

import torch

from .specs import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_dtype(dtype: torch.dtype | str | None, catalog_dtype: str | None, device: torch.device) -> torch.dtype:
    """The pipeline's dtype: `dtype` as given (a torch.dtype or its name), else the catalog's on CUDA (half precision
    is what the GPU presets are sized for) and float32 on the CPU (where half precision runs, but slowly)."""
    if dtype is None:
        dtype = catalog_dtype if catalog_dtype and device.type == "cuda" else "float32"
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as users write it ("float16")."""
    return str(dtype).removeprefix("torch.")
