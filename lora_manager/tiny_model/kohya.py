"""Diffusers-format SD LoRA -> kohya/A1111 keys.

Many LoRAs in the wild use kohya's flat key format; shipping one such file
lets the manager's loading path be tested against it offline.
"""

from __future__ import annotations

import torch

_PREFIX = {"unet": "lora_unet_", "text_encoder": "lora_te_"}


def to_kohya(state_dict: dict[str, torch.Tensor], alphas: dict[str, float]) -> dict[str, torch.Tensor]:
    """Map `unet.<module>.lora_A.weight` (and `text_encoder.` keys) to kohya keys.

    `alphas` gives the LoRA alpha per component ("unet", "text_encoder"); kohya
    stores it as a scalar `.alpha` tensor per module, which is the only place
    diffusers reads alpha from in that format.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        component, rest = key.split(".", 1)
        module, kind = rest.rsplit(".lora_", 1)
        name = _PREFIX[component] + module.replace(".", "_")
        out[f"{name}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = tensor
        out[f"{name}.alpha"] = torch.tensor(float(alphas[component]), dtype=tensor.dtype)
    return out
