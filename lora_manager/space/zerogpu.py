"""ZeroGPU: which process runs the GPU work, and the decorator that sends a handler there.

On ZeroGPU (the `spaces` package with SPACES_ZERO_GPU=true) a GPU is attached only inside functions decorated with
`spaces.GPU`, which run in a process forked from the main one; app.py imports `spaces` before anything imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

try:
    import spaces
except ImportError:  # not on a Space: GPU functions run as they are
    spaces = None

ZERO_GPU = os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")
ZERO_GPU_NOTE = (
    "On ZeroGPU the engine runs eager (torch.compile is unavailable there) and one request per pipeline "
    "call: the move to the GPU worker splits the stacked adapter tensors that mixed batches share."
)


def gpu(fn: Callable) -> Callable:
    """`fn` as a ZeroGPU function where `spaces` is installed (it runs as it is elsewhere)."""
    return spaces.GPU(fn) if spaces is not None else fn
