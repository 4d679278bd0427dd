"""Write LoRA files in the key layouts that published files use, for the tiny SD 1.5, mini SDXL and mini Flux models.

Weights start in the PEFT layout (module path -> A, B) and are then written under each family's own names. The
original (non-diffusers) names are the inverse of diffusers' conversions: SGM/LDM block numbering for SDXL kohya
files (`lora_conversion_utils._maybe_map_sgm_blocks_to_diffusers`), BFL names with fused q/k/v for Flux kohya, ComfyUI
and XLabs files. Every file records the modules it means to change, so a wrong inverse shows up in the tests as a
refusal, a mismatch against plain diffusers, or a target set that differs from this record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_manager.adapters.inspection import ATTENTION
from lora_manager.adapters.validate import lora_shapes

Peft = dict[str, torch.Tensor]  # "<module>.lora_A.weight" / "<module>.lora_B.weight", one model's modules
Select = Callable[[str], bool]

SD_ATTN = ATTENTION
LOCON = SD_ATTN + (
    "ff.net.0.proj",
    "ff.net.2",
    "proj_in",
    "proj_out",
    "conv1",
    "conv2",
    "conv_shortcut",
    "time_emb_proj",
    "downsamplers.0.conv",
    "upsamplers.0.conv",
)
TE_LAYERS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
FLUX_ATTN = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
# SGM's middle_block.N: resnet, attention, resnet
SGM_MID = {("resnets", "0"): 0, ("attentions", "0"): 1, ("resnets", "1"): 2}


@dataclass(frozen=True)
class LoraFile:
    """A written file and what reading it must give."""

    path: Path
    family: str  # the format name the engine reports
    rank: int  # largest rank in the file
    alpha: float  # alpha of the largest-rank modules as the file states it; their rank where the file has none
    has_text_encoder: bool
    targets: frozenset[tuple[str, str]]  # (component, module path) pairs the file changes


def ends_with(*suffixes: str) -> Select:
    return lambda name: name.endswith(suffixes)


def random_lora(model: torch.nn.Module, select: Select, rank: int, seed: int, scale: float = 0.3) -> Peft:
    """Random A/B for every Linear/Conv2d module `select` accepts; B(A(x)) is about `scale` times x, a realistic
    style delta rather than one that drives the network into a regime where rounding differences blow up."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, layer in model.named_modules():
        if select(name) and isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            a_shape, b_shape = lora_shapes(layer, rank)
            fan_in = a_shape[1] * (a_shape[2] * a_shape[3] if len(a_shape) == 4 else 1)
            sd[f"{name}.lora_A.weight"] = torch.randn(a_shape, generator=g) / fan_in**0.5
            sd[f"{name}.lora_B.weight"] = torch.randn(b_shape, generator=g) * scale / rank**0.5
    assert sd, "selection matched no module"
    return sd


def modules_of(sd: Peft) -> list[str]:
    return sorted(k.removesuffix(".lora_A.weight") for k in sd if k.endswith(".lora_A.weight"))


def targets_of(parts: dict[str, Peft]) -> frozenset[tuple[str, str]]:
    return frozenset((comp, m) for comp, sd in parts.items() for m in modules_of(sd))


# ---- the families ---------------------------------------------------------------------------------------------------


def write_peft(
    pipeline_cls: type, path: Path, parts: dict[str, Peft], ranks: dict[str, int], alphas: dict[str, float]
) -> None:
    """What diffusers' `save_lora_weights` writes: `<component>.<module>.lora_A.weight`, each component's LoraConfig
    (r, lora_alpha, target_modules) in the `lora_adapter_metadata` header entry."""
    kwargs = {}
    for comp, sd in parts.items():
        kwargs[f"{comp}_lora_layers"] = sd
        kwargs[f"{comp}_lora_adapter_metadata"] = {
            "r": ranks[comp],
            "lora_alpha": alphas[comp],
            "target_modules": modules_of(sd),
        }
    pipeline_cls.save_lora_weights(str(path.parent), weight_name=path.name, **kwargs)


def write_peft_alpha_tensors(path: Path, parts: dict[str, Peft], alpha_of: Callable[[str, str], float]) -> None:
    """PEFT keys plus one scalar `<component>.<module>.alpha` tensor per module, no metadata (ai-toolkit and others)."""
    tensors = {f"{comp}.{k}": v for comp, sd in parts.items() for k, v in sd.items()}
    for comp, sd in parts.items():
        for m in modules_of(sd):
            tensors[f"{comp}.{m}.alpha"] = torch.tensor(float(alpha_of(comp, m)))
    save_file(tensors, str(path))


def write_kohya(
    path: Path,
    parts: dict[str, Peft],
    alphas: dict[str, float],
    prefixes: dict[str, str],
    rename: Callable[[str, str], str],
) -> None:
    """kohya-ss / A1111: `<prefix><module with '_' for '.'>.lora_down.weight`, `.lora_up.weight`, scalar `.alpha`."""
    tensors = {}
    for comp, sd in parts.items():
        for m in modules_of(sd):
            name = prefixes[comp] + rename(comp, m).replace(".", "_")
            tensors[f"{name}.lora_down.weight"] = sd[f"{m}.lora_A.weight"]
            tensors[f"{name}.lora_up.weight"] = sd[f"{m}.lora_B.weight"]
            tensors[f"{name}.alpha"] = torch.tensor(float(alphas[comp]))
    save_file(tensors, str(path))


def write_diffusers_old(path: Path, parts: dict[str, Peft]) -> None:
    """diffusers before PEFT: attention processors' `processor.to_q_lora.down.weight` in the UNet, `.lora.down.weight`
    elsewhere; `self_attn.to_q_lora.down.weight` and `mlp.fc1.lora_linear_layer.down.weight` in text encoders."""
    attn = {"to_q": "to_q_lora", "to_k": "to_k_lora", "to_v": "to_v_lora", "to_out.0": "to_out_lora"}
    te = {"q_proj": "to_q_lora", "k_proj": "to_k_lora", "v_proj": "to_v_lora", "out_proj": "to_out_lora"}
    tensors = {}
    for comp, sd in parts.items():
        for m in modules_of(sd):
            parent, leaf = m.rsplit(".", 1) if not m.endswith("to_out.0") else (m.removesuffix(".to_out.0"), "to_out.0")
            if comp.startswith("text_encoder"):
                parent = parent if parent.startswith("text_model.") else f"text_model.{parent}"
                name = f"{parent}.{te[leaf]}" if leaf in te else f"{parent}.{leaf}.lora_linear_layer"
            else:
                name = f"{parent}.processor.{attn[leaf]}" if leaf in attn else f"{m}.lora"
            tensors[f"{comp}.{name}.down.weight"] = sd[f"{m}.lora_A.weight"]
            tensors[f"{comp}.{name}.up.weight"] = sd[f"{m}.lora_B.weight"]
    save_file(tensors, str(path))


def text_model_name(text_encoder: torch.nn.Module) -> Callable[[str, str], str]:
    """Published text-encoder LoRAs name CLIP's modules `text_model.…`; transformers 5's CLIPTextModel has no
    `text_model` level, so the generator adds it back (diffusers strips it again when the model lacks it)."""
    flat = not hasattr(text_encoder, "text_model")
    return lambda comp, m: f"text_model.{m}" if flat and comp == "text_encoder" else m


def sgm_name(module: str, layers_per_block: int) -> str:
    """A diffusers UNet module path in SGM/LDM numbering, as kohya-ss writes SDXL LoRAs: `down_blocks.1.attentions.0`
    -> `input_blocks.4.1`, resnet convs -> `in_layers.2` / `out_layers.3` / `emb_layers.1` / `skip_connection`."""
    resnet = {
        "conv1": "in_layers.2",
        "conv2": "out_layers.3",
        "time_emb_proj": "emb_layers.1",
        "conv_shortcut": "skip_connection",
    }
    per_block = layers_per_block + 1  # SGM counts the down/upsampler as a layer of the block
    parts = module.split(".")
    if parts[0] == "mid_block":
        kind, rest = parts[1], parts[3:]
        head = f"middle_block.{SGM_MID[(kind, parts[2])]}"
    else:
        down, block, kind, layer, rest = parts[0] == "down_blocks", int(parts[1]), parts[2], int(parts[3]), parts[4:]
        if kind == "downsamplers":
            return f"input_blocks.{(block + 1) * per_block}.0.op"
        if kind == "upsamplers":
            head = f"output_blocks.{block * per_block + layers_per_block}.2"
        else:
            first = 1 + block * per_block if down else block * per_block  # input_blocks.0 is conv_in
            head = f"{'input' if down else 'output'}_blocks.{first + layer}.{0 if kind == 'resnets' else 1}"
    if kind == "resnets":
        rest = [resnet[rest[0]]]
    return ".".join([head, *rest])


# ---- Flux's original (BFL) layout: fused projections --------------------------------------------------------------

# (BFL name, diffusers modules it feeds) per double-stream block; sd-scripts, ComfyUI and XLabs all start from these.
FLUX_DOUBLE = (
    ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("img_attn.proj", ("attn.to_out.0",)),
    ("img_mlp.0", ("ff.net.0.proj",)),
    ("img_mlp.2", ("ff.net.2",)),
    ("img_mod.lin", ("norm1.linear",)),
    ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
    ("txt_attn.proj", ("attn.to_add_out",)),
    ("txt_mlp.0", ("ff_context.net.0.proj",)),
    ("txt_mlp.2", ("ff_context.net.2",)),
    ("txt_mod.lin", ("norm1_context.linear",)),
)
FLUX_SINGLE = (
    ("linear2", ("proj_out",)),
    ("modulation.lin", ("norm.linear",)),
)
# FLUX.1's fused single-block input projection; diffusers' kohya converter splits it with FLUX.1-dev's own sizes
# (3072 x 3 + 12288), so on any smaller model it fails inside diffusers.
FLUX_SINGLE_LINEAR1 = ("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
XLABS_DOUBLE = (
    ("processor.qkv_lora1", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("processor.proj_lora1", ("attn.to_out.0",)),
    ("processor.qkv_lora2", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
    ("processor.proj_lora2", ("attn.to_add_out",)),
)


@dataclass(frozen=True)
class Fused:
    """One LoRA on a fused projection: A [r, in] shared by the split modules, B [sum of their outputs, r]."""

    name: str  # BFL path, e.g. "double_blocks.0.img_attn.qkv"
    modules: tuple[str, ...]  # diffusers paths inside the transformer
    A: torch.Tensor
    B: torch.Tensor


def flux_fused(
    transformer: torch.nn.Module, rank: int, seed: int, double=FLUX_DOUBLE, single=FLUX_SINGLE, scale: float = 0.3
) -> list[Fused]:
    """Random fused LoRAs over every double- and single-stream block of `transformer`."""
    g = torch.Generator().manual_seed(seed)
    blocks = [
        (f"double_blocks.{i}", f"transformer_blocks.{i}", double) for i in range(len(transformer.transformer_blocks))
    ]
    blocks += [
        (f"single_blocks.{i}", f"single_transformer_blocks.{i}", single)
        for i in range(len(transformer.single_transformer_blocks))
    ]
    out = []
    for bfl, diffusers, table in blocks:
        for name, leaves in table:
            layers = [transformer.get_submodule(f"{diffusers}.{leaf}") for leaf in leaves]
            fan_in, fan_out = layers[0].in_features, sum(layer.out_features for layer in layers)
            A = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            B = torch.randn(fan_out, rank, generator=g) * scale / rank**0.5
            out.append(Fused(f"{bfl}.{name}", tuple(f"{diffusers}.{leaf}" for leaf in leaves), A, B))
    return out


def fused_targets(fused: list[Fused]) -> frozenset[tuple[str, str]]:
    return frozenset(("transformer", m) for f in fused for m in f.modules)


def write_flux_kohya(
    path: Path, fused: list[Fused], alpha: float, te: Peft | None = None, te_alpha: float = 0.0, comfyui: bool = False
) -> None:
    """sd-scripts (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`, text encoder `lora_te1_…`) or, with
    `comfyui`, ComfyUI's spelling of the same (`diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight`,
    `text_encoders.clip_l.transformer.text_model.…`). Alpha as scalar `.alpha` tensors."""

    def unet(name: str) -> str:
        return f"diffusion_model.{name}" if comfyui else "lora_unet_" + name.replace(".", "_")

    def clip(module: str) -> str:
        name = f"text_model.{module}"
        return f"text_encoders.clip_l.transformer.{name}" if comfyui else "lora_te1_" + name.replace(".", "_")

    tensors = {}
    entries = [(unet(f.name), f.A, f.B, alpha) for f in fused]
    entries += [(clip(m), te[f"{m}.lora_A.weight"], te[f"{m}.lora_B.weight"], te_alpha) for m in modules_of(te or {})]
    for name, A, B, a in entries:
        tensors[f"{name}.lora_down.weight"] = A
        tensors[f"{name}.lora_up.weight"] = B
        tensors[f"{name}.alpha"] = torch.tensor(float(a))
    save_file(tensors, str(path))


def write_xlabs(path: Path, fused: list[Fused]) -> None:
    """XLabs-AI: `double_blocks.0.processor.qkv_lora1.down.weight` / `.up.weight`, no alpha (scale 1)."""
    tensors = {}
    for f in fused:
        tensors[f"{f.name}.down.weight"] = f.A
        tensors[f"{f.name}.up.weight"] = f.B
    save_file(tensors, str(path))


# ---- one set of files per architecture ----------------------------------------------------------------------------


def sd15_files(pipe, folder: Path) -> dict[str, LoraFile]:
    """Every family StableDiffusionPipeline reads, each with its own rank and alpha."""
    cls, files = type(pipe), {}
    unet, te = pipe.unet, pipe.text_encoder

    parts = {
        "unet": random_lora(unet, ends_with(*LOCON), 8, seed=11),
        "text_encoder": random_lora(te, ends_with(*TE_LAYERS), 4, seed=12),
    }
    write_kohya(
        folder / "kohya_locon_te.safetensors",
        parts,
        {"unet": 4, "text_encoder": 6},
        {"unet": "lora_unet_", "text_encoder": "lora_te_"},
        text_model_name(te),
    )
    files["kohya_locon_te"] = LoraFile(folder / "kohya_locon_te.safetensors", "kohya", 8, 4, True, targets_of(parts))

    parts = {
        "unet": random_lora(unet, ends_with(*SD_ATTN), 6, seed=13),
        "text_encoder": random_lora(te, ends_with("q_proj", "v_proj"), 3, seed=14),
    }
    write_peft(
        cls,
        folder / "peft_meta_te.safetensors",
        parts,
        {"unet": 6, "text_encoder": 3},
        {"unet": 12, "text_encoder": 1.5},
    )
    files["peft_meta_te"] = LoraFile(folder / "peft_meta_te.safetensors", "peft", 6, 12, True, targets_of(parts))

    parts = {
        "unet": random_lora(unet, ends_with(*SD_ATTN, "proj_in", "ff.net.2"), 5, seed=15),
        "text_encoder": random_lora(te, ends_with(*TE_LAYERS), 2, seed=16),
    }
    write_diffusers_old(folder / "diffusers_old_te.safetensors", parts)
    files["diffusers_old_te"] = LoraFile(
        folder / "diffusers_old_te.safetensors", "diffusers", 5, 5, True, targets_of(parts)
    )
    return files


def sdxl_files(pipe, folder: Path) -> dict[str, LoraFile]:
    """Every family StableDiffusionXLPipeline reads: kohya in SGM and in diffusers block names (LoCon, both text
    encoders), PEFT with metadata, the older diffusers layout."""
    cls, files = type(pipe), {}
    unet, te1, te2 = pipe.unet, pipe.text_encoder, pipe.text_encoder_2
    layers = unet.config.layers_per_block
    te_names = text_model_name(te1)
    kohya_prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}

    def sgm(comp: str, m: str) -> str:
        return sgm_name(m, layers) if comp == "unet" else te_names(comp, m)

    parts = {
        "unet": random_lora(unet, ends_with(*LOCON), 8, seed=21),
        "text_encoder": random_lora(te1, ends_with(*TE_LAYERS), 4, seed=22),
        "text_encoder_2": random_lora(te2, ends_with(*TE_LAYERS), 4, seed=23),
    }
    write_kohya(
        folder / "kohya_sgm_locon_te.safetensors",
        parts,
        {"unet": 4, "text_encoder": 2, "text_encoder_2": 3},
        kohya_prefixes,
        sgm,
    )
    files["kohya_sgm_locon_te"] = LoraFile(
        folder / "kohya_sgm_locon_te.safetensors", "kohya", 8, 4, True, targets_of(parts)
    )

    parts = {"unet": random_lora(unet, ends_with(*SD_ATTN), 4, seed=24)}
    write_kohya(folder / "kohya_sgm_attn.safetensors", parts, {"unet": 8}, kohya_prefixes, sgm)
    files["kohya_sgm_attn"] = LoraFile(folder / "kohya_sgm_attn.safetensors", "kohya", 4, 8, False, targets_of(parts))

    parts = {
        "unet": random_lora(unet, ends_with(*SD_ATTN, "proj_in", "proj_out", "conv1"), 6, seed=25),
        "text_encoder": random_lora(te1, ends_with(*TE_LAYERS), 2, seed=26),
    }
    write_kohya(
        folder / "kohya_diffusers_names_te1.safetensors",
        parts,
        {"unet": 3, "text_encoder": 1},
        kohya_prefixes,
        te_names,
    )
    files["kohya_diffusers_names_te1"] = LoraFile(
        folder / "kohya_diffusers_names_te1.safetensors", "kohya", 6, 3, True, targets_of(parts)
    )

    parts = {
        "unet": random_lora(unet, ends_with(*SD_ATTN, "ff.net.0.proj", "ff.net.2"), 5, seed=27),
        "text_encoder": random_lora(te1, ends_with("q_proj", "k_proj", "v_proj"), 3, seed=28),
        "text_encoder_2": random_lora(te2, ends_with("q_proj", "k_proj", "v_proj"), 2, seed=29),
    }
    write_peft(
        cls,
        folder / "peft_meta_te12.safetensors",
        parts,
        {"unet": 5, "text_encoder": 3, "text_encoder_2": 2},
        {"unet": 10, "text_encoder": 3, "text_encoder_2": 4},
    )
    files["peft_meta_te12"] = LoraFile(folder / "peft_meta_te12.safetensors", "peft", 5, 10, True, targets_of(parts))

    parts = {"unet": random_lora(unet, ends_with(*SD_ATTN, "proj_in"), 3, seed=30)}
    write_diffusers_old(folder / "diffusers_old.safetensors", parts)
    files["diffusers_old"] = LoraFile(folder / "diffusers_old.safetensors", "diffusers", 3, 3, False, targets_of(parts))
    return files


def flux_files(pipe, folder: Path) -> dict[str, LoraFile]:
    """Every family FluxPipeline reads: PEFT with metadata, PEFT with `.alpha` tensors (ai-toolkit), kohya and ComfyUI
    (BFL names, fused q/k/v, alpha folded into the weights by diffusers), XLabs."""
    cls, files = type(pipe), {}
    transformer, te = pipe.transformer, pipe.text_encoder

    def is_double(module: str) -> bool:
        return module.startswith("transformer_blocks.")

    parts = {
        "transformer": random_lora(transformer, ends_with(*FLUX_ATTN), 4, seed=31),
        "text_encoder": random_lora(te, ends_with(*TE_LAYERS), 2, seed=32),
    }
    write_peft(
        cls,
        folder / "peft_meta_te.safetensors",
        parts,
        {"transformer": 4, "text_encoder": 2},
        {"transformer": 8, "text_encoder": 1},
    )
    files["peft_meta_te"] = LoraFile(folder / "peft_meta_te.safetensors", "peft", 4, 8, True, targets_of(parts))

    # ai-toolkit: every linear layer of the blocks; here double blocks at rank 8 / alpha 4, single blocks at rank 4 /
    # alpha 8, so both diffusers' rank_pattern and alpha_pattern come into play.
    double = random_lora(transformer, lambda n: is_double(n) and "norm" not in n, 8, seed=33)
    single = random_lora(
        transformer, lambda n: n.startswith("single_transformer_blocks.") and "norm" not in n, 4, seed=34
    )
    parts = {"transformer": double | single}
    write_peft_alpha_tensors(folder / "ai_toolkit.safetensors", parts, lambda comp, m: 4.0 if is_double(m) else 8.0)
    files["ai_toolkit"] = LoraFile(folder / "ai_toolkit.safetensors", "peft+alpha", 8, 4, False, targets_of(parts))

    fused = flux_fused(transformer, 6, seed=35)
    te_part = random_lora(te, ends_with(*TE_LAYERS), 3, seed=36)
    write_flux_kohya(folder / "kohya_te.safetensors", fused, alpha=3, te=te_part, te_alpha=6)
    files["kohya_te"] = LoraFile(
        folder / "kohya_te.safetensors",
        "kohya",
        6,
        3,
        True,
        fused_targets(fused) | targets_of({"text_encoder": te_part}),
    )

    fused = flux_fused(transformer, 5, seed=37, single=())
    write_flux_kohya(folder / "kohya.safetensors", fused, alpha=10)
    files["kohya"] = LoraFile(folder / "kohya.safetensors", "kohya", 5, 10, False, fused_targets(fused))

    fused = flux_fused(transformer, 8, seed=38)
    te_part = random_lora(te, ends_with("q_proj", "k_proj", "v_proj", "out_proj"), 4, seed=39)
    write_flux_kohya(folder / "comfyui_te.safetensors", fused, alpha=16, te=te_part, te_alpha=4, comfyui=True)
    files["comfyui_te"] = LoraFile(
        folder / "comfyui_te.safetensors",
        "comfyui",
        8,
        16,
        True,
        fused_targets(fused) | targets_of({"text_encoder": te_part}),
    )

    fused = flux_fused(transformer, 4, seed=40, double=XLABS_DOUBLE, single=())
    write_xlabs(folder / "xlabs.safetensors", fused)
    files["xlabs"] = LoraFile(folder / "xlabs.safetensors", "xlabs", 4, 4, False, fused_targets(fused))
    return files
