"""Read a LoRA safetensors file into per-module (A, B, scale) tensors, using diffusers' own key conversions.

Pure functions: no model state is touched. Checks run cheapest first: file name, then header (format, unsupported
adapter kinds), then the tensors themselves.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.utils.peft_utils import get_peft_kwargs
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_peft,
    convert_unet_state_dict_to_peft,
)
from peft import LoraConfig
from peft.utils.other import get_pattern_key

from .errors import AdapterFormatError, AdapterIncompatibleError, AdapterSourceError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
KOHYA_PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_")
# Key fragments of adapter kinds that are not plain LoRA: the template cannot hold them.
UNSUPPORTED_KINDS = {
    "lokr": ("lokr_w1", "lokr_w2"),
    "loha": ("hada_w1", "hada_w2"),
    "DoRA": ("dora_scale", "lora_magnitude_vector"),
    "IA3": ("ia3_l",),
    "full fine-tune diff": (".diff", ".diff_b"),
}


@dataclass(frozen=True)
class FileHeader:
    """The safetensors header: tensor shapes and dtypes plus the `__metadata__` strings."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    metadata: dict[str, str]
    data_bytes: int


@dataclass(frozen=True)
class ModuleLora:
    """One LoRA'd module: A is [r, in(, kh, kw)], B is [out, r(, 1, 1)], scale = alpha / r (rsLoRA: alpha / sqrt r)."""

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
    format: str

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def alpha(self) -> float:
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


def detect_format(header: FileHeader, adapter_id: str) -> str:
    """Name the key layout, refusing adapter kinds that a LoRA template cannot hold."""
    keys = list(header.shapes)
    if not keys:
        raise AdapterFormatError(f"Adapter {adapter_id!r}: the file holds no tensors.", adapter_id)
    for kind, fragments in UNSUPPORTED_KINDS.items():
        if any(fr in k for k in keys for fr in fragments):
            raise AdapterFormatError(
                f"Adapter {adapter_id!r} is a {kind} adapter; only plain LoRA (A/B matrices) can be hotswapped. "
                "Merge it into a LoRA or pick another adapter.",
                adapter_id,
            )
    if all(k.startswith(KOHYA_PREFIXES) for k in keys):
        return "kohya"
    if any(".lora_A." in k or ".lora_B." in k for k in keys):
        return "peft"
    if any(".lora.down." in k or "_lora.down." in k or ".lora_linear_layer." in k for k in keys):
        return "diffusers"
    raise AdapterFormatError(
        f"Adapter {adapter_id!r}: no LoRA keys found (first key {keys[0]!r}); is this a LoRA file?", adapter_id
    )


def read_adapter(
    path: Path,
    adapter_id: str,
    pipeline_cls: type,
    components: dict[str, torch.nn.Module | None],
    dtype: torch.dtype,
) -> AdapterWeights:
    """Read, convert and split a LoRA file; `components` maps the pipeline's LoRA-loadable names to their models."""
    check_file_name(path, adapter_id)
    header = read_header(path, adapter_id)
    fmt = detect_format(header, adapter_id)
    try:
        out = pipeline_cls.lora_state_dict(
            str(path.parent), weight_name=path.name, use_safetensors=True, return_lora_metadata=True
        )
    except Exception as e:  # diffusers raises bare ValueError/KeyError on keys it cannot map
        raise AdapterFormatError(
            f"Adapter {adapter_id!r}: diffusers cannot read {path.name} for {pipeline_cls.__name__} ({e}). "
            "Is it a LoRA for this base model?",
            adapter_id,
        ) from e
    state_dict, alphas, metadata = out if len(out) == 3 else (out[0], None, out[1])
    modules: dict[tuple[str, str], ModuleLora] = {}
    claimed: set[str] = set()
    for comp, model in components.items():
        comp_keys = [k for k in state_dict if k.startswith(f"{comp}.")]
        if not comp_keys:
            continue
        claimed.update(comp_keys)
        comp_sd = {k.removeprefix(f"{comp}."): state_dict[k] for k in comp_keys}
        comp_alphas = _strip_prefix(alphas, comp)
        comp_meta = _strip_prefix(metadata, comp)
        for module, lora in _component_modules(comp, model, comp_sd, comp_alphas, comp_meta, adapter_id, dtype):
            modules[(comp, module)] = lora
    stray = sorted(set(state_dict) - claimed)
    if stray:
        raise AdapterIncompatibleError(
            f"Adapter {adapter_id!r} has weights for parts this {pipeline_cls.__name__} lacks (e.g. {stray[0]!r}); "
            "it was made for another kind of base model.",
            adapter_id,
        )
    if not modules:
        raise AdapterFormatError(f"Adapter {adapter_id!r}: no LoRA weights found in {path.name}.", adapter_id)
    return AdapterWeights(modules=modules, format=fmt)


def _strip_prefix(d: dict | None, prefix: str) -> dict | None:
    if not d:
        return None
    out = {k.removeprefix(f"{prefix}."): v for k, v in d.items() if k.startswith(f"{prefix}.")}
    return out or None


def _component_modules(comp, model, sd, alphas, metadata, adapter_id, dtype):
    """Mirror diffusers' per-component conversion and PEFT's per-module rank/alpha resolution."""
    if comp.startswith("text_encoder"):
        sd = convert_state_dict_to_peft(convert_state_dict_to_diffusers(sd))
        if model is None or not hasattr(model, "text_model"):  # transformers 5 flattened CLIPTextModel
            sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    elif "lora_A" not in next(iter(sd)):
        sd = convert_unet_state_dict_to_peft(sd)
    extra = sorted(k for k in sd if not k.endswith((".lora_A.weight", ".lora_B.weight")))
    if extra:
        raise AdapterFormatError(
            f"Adapter {adapter_id!r}: unsupported LoRA parameters such as {extra[0]!r} (LoRA bias or embeddings); "
            "only lora_A/lora_B weights can be hotswapped.",
            adapter_id,
        )
    ranks = {f"^{k}": v.shape[1] for k, v in sd.items() if k.endswith(".lora_B.weight") and v.ndim > 1}
    config = _lora_config(sd, ranks, alphas, metadata, adapter_id, is_unet=not comp.startswith("text_encoder"))
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
    """The LoraConfig diffusers would build for a normal load (metadata first, else ranks and network alphas)."""
    kwargs = metadata or get_peft_kwargs(ranks, network_alpha_dict=alphas, peft_state_dict=sd, is_unet=is_unet)
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


def _cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A private contiguous CPU copy: the cache must never share storage with anything the model may write."""
    return t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
