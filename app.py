"""Gradio Space for lora_manager: one pipeline, many LoRAs chosen per request, hotswapped without recompiling.

    python app.py [--preset tiny|sd15|sdxl|flux|path.json] [--dtype float16|bfloat16|float32]
                  [--compile/--no-compile] [--target-rank N] [--cache-mb N] [--slots K] [--max-batch B]
                  [--aot-package FILE] [--backend local|ray --ray-url URL] [--host 127.0.0.1] [--port 7860]
                  [--share]

Env fallbacks: LORA_PRESET, LORA_DTYPE, LORA_COMPILE (1/0; unset = on for CUDA only), LORA_SLOTS, LORA_MAX_BATCH,
GRADIO_SERVER_NAME, GRADIO_SERVER_PORT. The UI and the API share one function per action: `/generate` (prompt,
adapter, strength, seed, steps) -> (image, info), where adapter is '' (none), an id, or a list of ids or [id, strength]
pairs (up to K), and `/add_adapter` (repo_id, weight_name) -> status. The Space itself is `lora_manager.space`; this
file keeps the import order ZeroGPU needs and starts it.
"""

from __future__ import annotations

import os

# ZeroGPU (the `spaces` package with SPACES_ZERO_GPU=true): a GPU is attached only inside functions decorated with
# spaces.GPU, which run in a process forked from this one. `spaces` refuses to start once CUDA is initialized, and
# importing diffusers initializes it, so `spaces` comes first. transformers loads weights in worker threads, where
# spaces' CUDA placeholders do not reach: loads run on this thread instead.
if os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true"):
    os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
try:
    import spaces  # noqa: F401
except ImportError:  # not on a Space: GPU functions run as they are
    pass

from lora_manager.space.cli import main  # noqa: E402 (after `spaces`, as ZeroGPU needs)

if __name__ == "__main__":
    main()
