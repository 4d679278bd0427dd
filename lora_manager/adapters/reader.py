"""Read a LoRA safetensors file into per-module (A, B, scale) tensors exactly as the pipeline's `load_lora_weights`
reads it.

Pure functions: no model state is touched. Checks run cheapest first: file name, then header (adapter kinds a LoRA
template cannot hold), then diffusers' own reading and key conversions, then the tensors themselves. Which files are
LoRAs and which modules their keys name is decided by diffusers' loaders, never by key patterns of this module.
"""

from __future__ import annotations

import json
import math
import re
import struct
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.loaders.lora_pipeline import FluxLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin
from diffusers.utils.peft_utils import get_peft_kwargs
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
)
from peft import LoraConfig
from peft.utils.other import get_pattern_key
from safetensors import safe_open

from ..errors import AdapterFormatError, AdapterIncompatibleError, AdapterSourceError, LoraManagerError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_")
# Key patterns of adapter kinds that are not plain LoRA: the template cannot hold them.
UNSUPPORTED_KINDS = {
    "lokr": re.compile(r"lokr_w[12]"),
    "loha": re.compile(r"hada_w[12]"),
    "DoRA": re.compile(r"dora_scale|lora_magnitude_vector"),
    "IA3": re.compile(r"ia3_l"),
    "full fine-tune diff": re.compile(r"\.diff(_b)?$"),
}
# diffusers' text-encoder loader reads ranks only from these layers; others get the most common rank.
TEXT_ENCODER_RANKED = (".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")


@dataclass(frozen=True)
class FileHeader:
    """The safetensors header: tensor shapes and dtypes plus the `__metadata__` strings."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    metadata: dict[str, str]
    data_bytes: int


@dataclass(frozen=True)
class ModuleLora:
    """One LoRA'd module: A is [r, in(, kh, kw)], B is [out, r(, 1, 1)], scale = alpha / r (rsLoRA: alpha / sqrt r),
    with r and alpha as PEFT resolves them from the config diffusers builds for the file."""

    A: torch.Tensor
    B: torch.Tensor
    alpha: float
    scale: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter converted once to the PEFT layout, keyed by (component, module path inside that component)."""

    modules: dict[tuple[str, str], ModuleLora]
    format: str  # the key layout's family, for people: "kohya", "peft", "peft+alpha", "diffusers", "xlabs", ...
    # The file's alpha where diffusers folded alpha / r into A and B while converting (Flux kohya and ComfyUI files);
    # the modules then hold alpha = r, scale 1, as diffusers loads them.
    folded_alpha: float | None = None

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def alpha(self) -> float:
        """The alpha of the largest-rank module as the file states it (its rank where the file states none)."""
        if self.folded_alpha is not None:
            return self.folded_alpha
        return max(self.modules.values(), key=lambda m: m.rank).alpha

    @property
    def nbytes(self) -> int:
        return sum(m.A.nbytes + m.B.nbytes for m in self.modules.values())

    @property
    def components(self) -> set[str]:
        return {c for c, _ in self.modules}

    @property
    def has_text_encoder(self) -> bool:
        return any(c.startswith("text_encoder") for c in self.components)


def check_file_name(path: Path, adapter_id: str) -> None:
    """Refuse pickle files by name before a byte is read: loading them can run arbitrary code."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise AdapterSourceError(
            f"Adapter {adapter_id!r}: {path.name} is a pickle file ({path.suffix}); only .safetensors is accepted "
            "because unpickling can run arbitrary code. Convert it to safetensors first.",
            adapter_id,
        )
    if path.suffix.lower() != ".safetensors":
        raise AdapterSourceError(
            f"Adapter {adapter_id!r}: {path.name} is not a .safetensors file; give the path or weight_name of one.",
            adapter_id,
        )


def read_header(path: Path, adapter_id: str) -> FileHeader:
    """Parse the header by hand so that empty, truncated and corrupt files get a precise message."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterFormatError(
                f"Adapter {adapter_id!r}: {path.name} is empty or too short ({size} bytes).", adapter_id
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise AdapterFormatError(
                f"Adapter {adapter_id!r}: {path.name} has a corrupt header (claims {n} bytes, file has {size}); "
                "download it again.",
                adapter_id,
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterFormatError(
            f"Adapter {adapter_id!r}: {path.name} has a corrupt header ({e}); download it again.", adapter_id
        ) from e
    if not isinstance(header, dict):
        raise AdapterFormatError(f"Adapter {adapter_id!r}: {path.name} has a corrupt header.", adapter_id)
    metadata = header.pop("__metadata__", None) or {}
    try:
        shapes = {k: tuple(v["shape"]) for k, v in header.items()}
        dtypes = {k: v["dtype"] for k, v in header.items()}
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
    except (TypeError, KeyError) as e:
        raise AdapterFormatError(f"Adapter {adapter_id!r}: {path.name} has a corrupt header.", adapter_id) from e
    if 8 + n + end > size:
        raise AdapterFormatError(
            f"Adapter {adapter_id!r}: {path.name} is truncated ({size} bytes, header needs {8 + n + end}); "
            "download it again.",
            adapter_id,
        )
    return FileHeader(shapes=shapes, dtypes=dtypes, metadata=metadata, data_bytes=end)


def check_kind(header: FileHeader, adapter_id: str) -> None:
    """Refuse empty files and adapter kinds that a LoRA template cannot hold, by their key names."""
    keys = list(header.shapes)
    if not keys:
        raise AdapterFormatError(f"Adapter {adapter_id!r}: the file holds no tensors.", adapter_id)
    for kind, pattern in UNSUPPORTED_KINDS.items():
        if any(pattern.search(k) for k in keys):
            raise AdapterFormatError(
                f"Adapter {adapter_id!r} is a {kind} adapter; only plain LoRA (A/B matrices) can be hotswapped. "
                "Merge it into a LoRA or pick another adapter.",
                adapter_id,
            )


def format_family(keys: list[str]) -> str:
    """Name the key layout for people. Purely informational: which layouts are read is diffusers' decision."""
    if any(re.search(r"\.processor\.(qkv|proj)_lora\d?\.", k) for k in keys):
        return "xlabs"
    if any(k.startswith(("diffusion_model.", "text_encoders.")) for k in keys):
        return "comfyui"
    if all(k.startswith(KOHYA_PREFIXES) for k in keys):
        return "kohya"
    if any(".lora_A." in k or ".lora_B." in k for k in keys):
        return "peft+alpha" if any(k.endswith(".alpha") for k in keys) else "peft"
    if any(".lora.down." in k or "_lora.down." in k or ".lora_linear_layer." in k for k in keys):
        return "diffusers"
    return "other"


def read_adapter(
    path: Path,
    adapter_id: str,
    pipeline_cls: type,
    components: dict[str, torch.nn.Module | None],
    dtype: torch.dtype,
) -> AdapterWeights:
    """Read, convert and split a LoRA file as `pipeline_cls.load_lora_weights` does; `components` maps the pipeline's
    LoRA-loadable names to their models (None when only the file is inspected: SDXL then lacks the UNet config)."""
    check_file_name(path, adapter_id)
    header = read_header(path, adapter_id)
    check_kind(header, adapter_id)
    fmt = format_family(list(header.shapes))
    state_dict, alphas, metadata = _lora_state_dict(path, adapter_id, pipeline_cls, components, fmt)
    if not any("lora" in k for k in state_dict):  # diffusers' own test of a LoRA checkpoint
        raise AdapterFormatError(
            f"Adapter {adapter_id!r}: no LoRA weights in {path.name} (first key {next(iter(header.shapes))!r}); "
            "is this a LoRA file?",
            adapter_id,
        )
    if alphas and metadata:  # load_lora_adapter raises on this combination
        raise AdapterFormatError(
            f"Adapter {adapter_id!r}: {path.name} has both .alpha tensors and diffusers' LoRA metadata, which "
            f"{pipeline_cls.__name__}'s loader refuses as ambiguous; re-save it with only one of them.",
            adapter_id,
        )
    modules: dict[tuple[str, str], ModuleLora] = {}
    claimed: set[str] = set()
    for comp, model in components.items():
        comp_sd = _under(state_dict, comp)
        if not comp_sd:
            continue
        claimed.update(f"{comp}.{k}" for k in comp_sd)
        comp_meta = None if metadata is None else _under(metadata, comp)  # {} is not None: diffusers' defaults
        try:
            found = list(
                _component_modules(
                    comp, model, comp_sd, _under(alphas or {}, comp), comp_meta, adapter_id, pipeline_cls, dtype
                )
            )
        except LoraManagerError:
            raise
        except Exception as e:  # diffusers' and PEFT's conversions raise bare errors on keys they cannot map
            raise _diffusers_failed(e, adapter_id, f"the {comp} part of {path.name}", pipeline_cls, fmt) from e
        modules.update(((comp, module), lora) for module, lora in found)
    stray = sorted(set(state_dict) - claimed)
    if stray:
        raise AdapterIncompatibleError(
            f"Adapter {adapter_id!r} has weights for parts this {pipeline_cls.__name__} lacks (e.g. {stray[0]!r}); "
            "it was made for another kind of base model.",
            adapter_id,
        )
    if not modules:
        raise AdapterFormatError(f"Adapter {adapter_id!r}: no LoRA weights found in {path.name}.", adapter_id)
    folded = not alphas and metadata is None and any(k.endswith(".alpha") for k in header.shapes)
    return AdapterWeights(modules=modules, format=fmt, folded_alpha=_file_alpha(path, header) if folded else None)


def _lora_state_dict(path: Path, adapter_id: str, pipeline_cls: type, components: dict, fmt: str) -> tuple:
    """`lora_state_dict` with the arguments `pipeline_cls.load_lora_weights` gives it: SDXL's passes the UNet config
    (kohya files in SGM block names are renumbered with it), Flux's asks for the network alphas it otherwise drops."""
    kwargs = {"return_lora_metadata": True}
    if issubclass(pipeline_cls, StableDiffusionXLLoraLoaderMixin):
        kwargs["unet_config"] = getattr(components.get("unet"), "config", None)
    if issubclass(pipeline_cls, FluxLoraLoaderMixin):
        kwargs["return_alphas"] = True
    try:
        out = pipeline_cls.lora_state_dict(str(path.parent), weight_name=path.name, use_safetensors=True, **kwargs)
    except Exception as e:  # diffusers raises bare ValueError/KeyError/AssertionError on keys it cannot map
        raise _diffusers_failed(e, adapter_id, path.name, pipeline_cls, fmt) from e
    return out if len(out) == 3 else (out[0], None, out[1])  # loaders without network alphas return two


def _diffusers_failed(e: Exception, adapter_id: str, what: str, pipeline_cls: type, fmt: str) -> AdapterFormatError:
    """Name the adapter, the part, diffusers' failing step and the fix, also when diffusers' error has no message."""
    frames = traceback.extract_tb(e.__traceback__)
    inside = [f.name for f in frames if "diffusers" in Path(f.filename).parts] or [f.name for f in frames]
    detail = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} (no message)"
    return AdapterFormatError(
        f"Adapter {adapter_id!r}: diffusers cannot read {what} ({fmt} keys) for {pipeline_cls.__name__}: {detail} "
        f"in diffusers' {inside[-1]}. Its layers do not match what this pipeline's LoRA loader "
        "expects: use a LoRA made for this base model (not for another size or variant of it), or re-save it in the "
        "diffusers/PEFT layout.",
        adapter_id,
    )


def _under(d: dict, prefix: str) -> dict:
    """The entries of one component, its `prefix.` removed (as diffusers splits state dicts, alphas and metadata)."""
    return {k.removeprefix(f"{prefix}."): v for k, v in d.items() if k.startswith(f"{prefix}.")}


def _component_modules(comp, model, sd, alphas, metadata, adapter_id, pipeline_cls, dtype):
    """Mirror `load_lora_adapter` (denoisers) and `_load_lora_into_text_encoder` (text encoders): their key
    conversion, their rank dict, their LoraConfig; then PEFT's per-module rank/alpha resolution."""
    text = comp.startswith("text_encoder")
    if text:
        sd = convert_state_dict_to_peft(convert_state_dict_to_diffusers(sd))
        if model is None or not hasattr(model, "text_model"):  # transformers 5 flattened CLIPTextModel
            sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
        ranks = {
            k: v.shape[1]
            for k, v in sd.items()
            if k.endswith(".lora_B.weight") and k.removesuffix(".lora_B.weight").endswith(TEXT_ENCODER_RANKED)
        }
    else:
        if "lora_A" not in next(iter(sd)):
            sd = convert_unet_state_dict_to_peft(sd)
        ranks = {f"^{k}": v.shape[1] for k, v in sd.items() if "lora_B" in k and v.ndim > 1}
    extra = sorted(k for k in sd if not k.endswith((".lora_A.weight", ".lora_B.weight")))
    if extra:
        why = (
            f"{pipeline_cls.__name__}'s loader reads alpha from diffusers' metadata or kohya keys, not from .alpha "
            "tensors beside PEFT keys; re-save it with alpha in the metadata"
            if extra[0].endswith(".alpha")
            else "unsupported LoRA parameters (LoRA bias or embeddings); only lora_A/lora_B weights can be hotswapped"
        )
        raise AdapterFormatError(
            f"Adapter {adapter_id!r}: {comp}.{extra[0]} is not a LoRA A/B weight: {why}.", adapter_id
        )
    config = _lora_config(sd, ranks, alphas, metadata, adapter_id, is_unet=not text)
    for key in sorted(k for k in sd if k.endswith(".lora_A.weight")):
        module = key.removesuffix(".lora_A.weight")
        A, B = sd[key], sd.get(f"{module}.lora_B.weight")
        if B is None or A.shape[0] != B.shape[1]:
            raise AdapterFormatError(
                f"Adapter {adapter_id!r}: {comp}.{module} has lora_A {tuple(A.shape)} without a matching lora_B "
                f"({None if B is None else tuple(B.shape)}).",
                adapter_id,
            )
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        alpha = float(config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha))
        if r != A.shape[0]:
            raise AdapterFormatError(
                f"Adapter {adapter_id!r}: {comp}.{module} has rank {A.shape[0]} but its config says {r}.", adapter_id
            )
        scale = alpha / (math.sqrt(r) if config.use_rslora else r)
        yield module, ModuleLora(A=_cpu(A, dtype), B=_cpu(B, dtype), alpha=alpha, scale=scale)


def _lora_config(sd, ranks, alphas, metadata, adapter_id, is_unet: bool) -> LoraConfig:
    """The LoraConfig diffusers builds (`_create_lora_config`): the metadata when the file has any, else ranks and
    network alphas."""
    kwargs = (
        metadata
        if metadata is not None
        else get_peft_kwargs(ranks, network_alpha_dict=alphas, peft_state_dict=sd, is_unet=is_unet)
    )
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise AdapterFormatError(f"Adapter {adapter_id!r}: its LoRA config cannot be read ({e}).", adapter_id) from e
    if config.use_dora or config.lora_bias:
        raise AdapterFormatError(
            f"Adapter {adapter_id!r} uses {'DoRA' if config.use_dora else 'LoRA bias'}, which a plain LoRA template "
            "cannot hold; pick a plain LoRA.",
            adapter_id,
        )
    return config


def _file_alpha(path: Path, header: FileHeader) -> float:
    """The `.alpha` value of the file's largest-rank module (the first such in the file's key order)."""

    def rank(alpha_key: str) -> int:
        base = alpha_key.removesuffix(".alpha")
        down = (f"{base}.{s}" for s in ("lora_down.weight", "lora_A.weight", "down.weight"))
        return next((header.shapes[k][0] for k in down if k in header.shapes), 0)

    best = max((k for k in header.shapes if k.endswith(".alpha")), key=rank)
    with safe_open(str(path), "pt") as f:
        return float(f.get_tensor(best).item())


def _cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A private contiguous CPU copy: the cache must never share storage with anything the model may write."""
    return t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
