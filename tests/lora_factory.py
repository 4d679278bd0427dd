"""Write real LoRA safetensors files with chosen ranks, alphas, targets and key formats, for a given pipeline."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import save_file

from lora_manager.tiny_model.kohya import to_kohya
from lora_manager.validate import lora_shapes

ATTN = ("to_q", "to_k", "to_v", "to_out.0")
ATTN_FF_CONV = ATTN + ("ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "conv1", "conv2")
TE_ATTN = ("q_proj", "k_proj", "v_proj", "out_proj")


def lora_layers(model: torch.nn.Module, suffixes, rank: int, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """Random A/B for every module whose name ends with one of `suffixes`, in PEFT layout.

    A ~ N(0, 1/fan_in) and B ~ N(0, scale^2/r), so B(A(x)) is about `scale` times x: a realistic style delta,
    not one that drives the network into a regime where rounding differences blow up.
    """
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, layer in model.named_modules():
        if name.endswith(tuple(suffixes)) and isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            a_shape, b_shape = lora_shapes(layer, rank)
            fan_in = a_shape[1] * (a_shape[2] * a_shape[3] if len(a_shape) == 4 else 1)
            sd[f"{name}.lora_A.weight"] = torch.randn(a_shape, generator=g) / fan_in**0.5
            sd[f"{name}.lora_B.weight"] = torch.randn(b_shape, generator=g) * scale / rank**0.5
    return sd


def write_adapter(
    pipe,
    path: Path,
    rank: int,
    alpha: float,
    suffixes=ATTN,
    te_rank: int | None = None,
    te_alpha: float | None = None,
    kohya: bool = False,
    seed: int = 0,
    scale: float = 0.3,
) -> Path:
    """Save an adapter as diffusers would (alpha in the metadata), or in kohya keys (alpha as `.alpha` tensors)."""
    unet = lora_layers(pipe.unet, suffixes, rank, seed, scale)
    te = lora_layers(pipe.text_encoder, TE_ATTN, te_rank, seed + 1, scale) if te_rank else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    if kohya:
        packed = {f"unet.{k}": v for k, v in unet.items()} | {f"text_encoder.{k}": v for k, v in te.items()}
        save_file(to_kohya(packed, {"unet": alpha, "text_encoder": te_alpha or 0.0}), str(path))
        return path
    meta = lambda sd, r, a: {"r": r, "lora_alpha": a, "target_modules": sorted({k.split(".lora_")[0] for k in sd})}
    StableDiffusionPipeline.save_lora_weights(
        str(path.parent),
        unet_lora_layers=unet,
        text_encoder_lora_layers=te or None,
        weight_name=path.name,
        unet_lora_adapter_metadata=meta(unet, rank, alpha),
        text_encoder_lora_adapter_metadata=meta(te, te_rank, te_alpha) if te else None,
    )
    return path


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a safetensors file through `edit(tensors, metadata)`, keeping diffusers' metadata unless edited."""
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors, metadata)
    save_file(tensors, str(dst), metadata=metadata)
    return dst
