"""Pixel comparisons of generated images, in 8-bit levels: how far two images of the same request are apart."""

from __future__ import annotations

import numpy as np


def to_8bit(image) -> np.ndarray:
    """An image (PIL, uint8 array, or float array in [0, 1] as `output_type="np"` gives) as integer 8-bit levels."""
    array = np.asarray(image)
    return (array * 255).round().astype(int) if array.dtype.kind == "f" else array.astype(int)


def levels(a, b) -> int:
    """Largest per-pixel difference of two images, in levels of 255."""
    return int(np.abs(to_8bit(a) - to_8bit(b)).max())
