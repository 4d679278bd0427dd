"""AOTInductor for the denoiser, with the hotswap template's LoRA tensors left swappable.

`torch.compile` keeps the template swappable because dynamo guards on tensors, not on their values. An AOTInductor
package has no dynamo: it is a `.so` built once (minutes) and loaded in any process (well under a second). It stays
swappable only if the LoRA tensors (`lora_A`/`lora_B` of every LoRA layer, and the 0-dim scalings) are *constants the
caller binds* rather than values baked into the `.so`:

* `package_denoiser` exports the UNet with the template in place and compiles it with
  `aot_inductor.package_constants_in_so=False` (and no weights on disk either), so the package holds kernels only.
  PEFT keeps each scaling in a plain dict, which export would lift as an anonymous tensor constant; while exporting,
  every scaling is therefore registered as a (non-persistent) buffer under a fixed name, and the layer's `scaling`
  dict reads that buffer, so the scalings become named constants like any weight. Inductor would still inline 0-dim
  constants as literals (`GraphLowering.get_attr`), so `always_keep_tensor_constants=True` too; the package is
  checked afterwards to read every LoRA tensor and scaling as a constant (`_check_swappable`).
* `load_denoiser` loads the package and binds the pipeline's own tensors (base weights, LoRA tensors, scalings) with
  `load_constants(..., user_managed=True)`: the model keeps their pointers, so the engine's in-place swaps
  (`copy_`/`fill_`/`_foreach_copy_`) are what the next call reads, and no second copy of the weights exists. It then
  routes the UNet's forward through the package, so `pipe(...)` runs unchanged.

The package's shapes are fixed (batch rows, latent size, text length, dtype, device): `DenoiserShapes` names them,
the package carries them in its metadata, and a call with other shapes raises `AotShapeError` instead of computing
garbage. Only in-place writes stay visible: anything that replaces a bound tensor object (`pipe.to(...)`, a fresh
`load_lora_weights`) needs `load_denoiser` again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from ..errors import LoraManagerError
from .fusion import switch_of

SCALING_BUFFER = "lora_scaling_"  # + adapter name: the buffer a layer's scaling is exported under
_META_KEY = "lora_manager.aot"  # the package metadata entry that holds `DenoiserShapes` and the constants' layout
_FORMAT = 1


class AotShapeError(LoraManagerError):
    """A call that does not fit the shapes, dtypes or device the package was compiled for."""


class AotPackageError(LoraManagerError):
    """A package this process cannot serve: missing or unreadable, built by another torch or for another CPU or GPU,
    or reading tensors this denoiser does not have in the layout it expects."""


@dataclass(frozen=True)
class DenoiserShapes:
    """What an AOT package is compiled for. `batch` counts the UNet's rows: images x 2 under classifier-free
    guidance (guidance_scale > 1), so a package built for one guided image serves exactly that."""

    batch: int
    in_channels: int
    latent_height: int
    latent_width: int
    text_len: int
    text_dim: int
    dtype: str  # e.g. "float32"
    device: str  # the device type, e.g. "cpu" / "cuda"

    @classmethod
    def for_pipeline(cls, pipe, height: int, width: int, images: int = 1, guidance: bool = True) -> DenoiserShapes:
        """The shapes `pipe(prompt, height=, width=, num_images_per_prompt=images, guidance_scale=...)` gives its
        UNet (Stable-Diffusion-style pipelines: latents at 1/vae_scale_factor, prompt embeddings at the tokenizer's
        `model_max_length`)."""
        unet = pipe.unet
        factor = pipe.vae_scale_factor
        if height % factor or width % factor:
            raise AotShapeError(f"height and width must be multiples of {factor}, got {height}x{width}.")
        return cls(
            batch=images * (2 if guidance else 1),
            in_channels=unet.config.in_channels,
            latent_height=height // factor,
            latent_width=width // factor,
            text_len=pipe.tokenizer.model_max_length,
            text_dim=unet.config.cross_attention_dim,
            dtype=str(unet.dtype).removeprefix("torch."),
            device=unet.device.type,
        )

    def example_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sample, timestep, encoder_hidden_states) of these shapes, for export; timestep is one float per row."""
        dtype = getattr(torch, self.dtype)
        sample = torch.randn(
            self.batch, self.in_channels, self.latent_height, self.latent_width, dtype=dtype, device=device
        )
        timestep = torch.full((self.batch,), 500.0, device=device)
        text = torch.randn(self.batch, self.text_len, self.text_dim, dtype=dtype, device=device)
        return sample, timestep, text

    def describe(self) -> str:
        return (
            f"batch {self.batch} (images x 2 with guidance), latents {self.in_channels}x{self.latent_height}x"
            f"{self.latent_width}, text {self.text_len}x{self.text_dim}, {self.dtype} on {self.device}"
        )


class _BufferScalings(dict):
    """A LoRA layer's `scaling` dict whose tensor entries are read from the layer's buffers, so export traces them
    as named buffers (it re-parametrizes module attributes, never dict values). Holds the same tensors."""

    def __init__(self, layer: nn.Module, original: dict):
        super().__init__(original)
        self._layer = layer

    def __getitem__(self, name):
        value = super().__getitem__(name)
        if isinstance(value, torch.Tensor):
            return getattr(self._layer, SCALING_BUFFER + name)
        return value


def _lora_layers(unet: nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    for name, module in unet.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@contextlib.contextmanager
def _scalings_as_buffers(unet: nn.Module) -> Iterator[None]:
    """While exporting: every tensor scaling is also a non-persistent buffer (the same tensor, so nothing is copied
    and the UNet's state_dict is unchanged), read through `_BufferScalings`. Everything is undone on exit."""
    changed: list[tuple[LoraLayer, dict, list[str]]] = []
    try:
        for module_name, layer in _lora_layers(unet):
            names = [n for n, v in layer.scaling.items() if isinstance(v, torch.Tensor)]
            if len(names) != len(layer.scaling):
                raise TypeError(
                    f"{module_name}: float LoRA scalings would be baked into the package; prepare the "
                    f"template for hotswap first (enable_lora_hotswap before the first load)."
                )
            for n in names:
                layer.register_buffer(SCALING_BUFFER + n, layer.scaling[n], persistent=False)
            changed.append((layer, layer.scaling, names))
            layer.scaling = _BufferScalings(layer, layer.scaling)
        yield
    finally:
        for layer, original, names in changed:
            layer.scaling = original
            for n in names:
                delattr(layer, SCALING_BUFFER + n)


def live_constants(unet: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors a package of this UNet reads, by the fully qualified names export gives them: every parameter and
    buffer, and every LoRA scaling under its `_scalings_as_buffers` name. These are the model's own tensors."""
    out = {prefix + n: p for n, p in unet.named_parameters(remove_duplicate=False)}
    out.update({prefix + n: b for n, b in unet.named_buffers(remove_duplicate=False)})
    for module_name, layer in _lora_layers(unet):
        for n, value in layer.scaling.items():
            if isinstance(value, torch.Tensor):
                out[f"{prefix}{module_name}.{SCALING_BUFFER}{n}"] = value
    return out


def _layout(constants: dict[str, torch.Tensor]) -> dict[str, list]:
    return {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in sorted(constants.items())}


def package_denoiser(pipe, path: str | Path, shapes: DenoiserShapes, **inductor_configs: Any) -> Path:
    """Export and AOT-compile `pipe.unet` (with its hotswap template in place) for `shapes` into a `.pt2` package
    that holds kernels and no weights: every parameter, buffer, LoRA tensor and scaling is a constant that
    `load_denoiser` binds. Takes minutes on a CPU; returns the package path."""
    unet = pipe.unet
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if unet.training:
        raise ValueError("export the UNet in eval mode (dropout would be traced).")
    if any((switch := switch_of(layer)) is not None and switch.on for _, layer in _lora_layers(unet)):
        raise ValueError(
            "the UNet runs with an adapter merged into its base weights (the engine's fused path), so the export "
            "would not see the LoRA tensors: package from an engine built with fuse=False."
        )
    sample, timestep, text = shapes.example_inputs(unet.device)
    with _scalings_as_buffers(unet), torch.no_grad():
        # the UNet itself, not a wrapper module: the package's constants then carry the UNet's own names (its
        # state_dict keys), which is also what `spaces.aoti_patch` binds. return_dict=False: a tuple, not a dataclass.
        exported = torch.export.export(
            unet, (sample, timestep), {"encoder_hidden_states": text, "return_dict": False}, strict=False
        )
        # every scaling must be a named buffer of the export, never an anonymous lifted constant (= a baked value)
        live = live_constants(unet)
        anonymous = [n for n in exported.constants if n not in live]
        if anonymous:
            raise RuntimeError(f"export lifted tensors the package could not rebind: {anonymous[:5]}")
        layout = _layout(live)
    meta = {
        "format": _FORMAT,
        "torch": torch.__version__,
        "shapes": asdict(shapes),
        "constants": layout,
        "cuda_capability": cuda_capability(unet.device),
    }
    configs = {
        "aot_inductor.package_constants_in_so": False,  # kernels only: the caller's tensors are the weights
        "aot_inductor.package_constants_on_disk_format": None,
        "aot_inductor.metadata": {_META_KEY: json.dumps(meta)},
        # inductor inlines 0-dim (and tiny 1-d) constants as literals (`GraphLowering.get_attr`): the scalings would
        # be baked at their export-time values. Keep every constant a bound tensor instead.
        "always_keep_tensor_constants": True,
        # the joint-graph pass replaces constant-only subgraphs whose value is uniform (e.g. a transposed all-zero
        # template lora_A) by a `full` of the export-time value (`constant_fold_uniform_value`). Not seen with this
        # UNet on the CPU, but a zero template is exactly such a value: off, as `spaces.aoti_compile` has it too.
        "joint_graph_constant_folding": False,
        **inductor_configs,
    }
    if (
        configs.get("freezing")
        or configs.get("aot_inductor.use_runtime_constant_folding")
        or not configs["always_keep_tensor_constants"]
        or configs["aot_inductor.package_constants_in_so"]
    ):
        raise ValueError("these inductor configs would fold or bake the LoRA tensors into the package.")
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
    _check_swappable(open_package(path).get_constant_fqns(), unet, path)
    return path


def swappable_constants(unet: nn.Module, prefix: str = "") -> list[str]:
    """The fully qualified names of what a swap writes: every LoRA layer's lora_A / lora_B weights and scalings."""
    names = []
    for module_name, layer in _lora_layers(unet):
        for adapter in layer.lora_A:
            base = f"{prefix}{module_name}"
            names += [
                f"{base}.lora_A.{adapter}.weight",
                f"{base}.lora_B.{adapter}.weight",
                f"{base}.{SCALING_BUFFER}{adapter}",
            ]
    return names


def _check_swappable(fqns: list[str], unet: nn.Module, path: Path) -> None:
    """A LoRA tensor that is not among the package's constants was compiled in as a value: swaps would be ignored."""
    baked = sorted(set(swappable_constants(unet)) - set(fqns))
    if baked:
        raise RuntimeError(
            f"{path.name}: {len(baked)} LoRA tensor(s) are baked into the package, not bound, e.g. "
            f"{baked[:3]}; swaps would not reach them."
        )


@dataclass
class AotDenoiser:
    """A loaded package bound to a UNet's live tensors, installed as that UNet's forward (see `load_denoiser`)."""

    model: Any  # torch.export.pt2_archive._package.AOTICompiledModel
    unet: nn.Module
    shapes: DenoiserShapes
    path: Path
    load_s: float
    bound: dict[str, torch.Tensor]  # fqn -> the tensor the package reads (kept alive here too)
    calls: int = 0

    def check(self, sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor) -> None:
        s = self.shapes
        want = {
            "sample": (s.batch, s.in_channels, s.latent_height, s.latent_width),
            "encoder_hidden_states": (s.batch, s.text_len, s.text_dim),
        }
        for name, tensor in (("sample", sample), ("encoder_hidden_states", encoder_hidden_states)):
            if (
                tuple(tensor.shape) != want[name]
                or str(tensor.dtype).removeprefix("torch.") != s.dtype
                or tensor.device.type != s.device
            ):
                raise AotShapeError(
                    f"AOT denoiser {self.path.name} was compiled for {s.describe()}; got {name} "
                    f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}. Call the pipeline with the height, "
                    f"width, images per prompt and guidance it was packaged for, or package another."
                )

    def __call__(
        self,
        sample: torch.Tensor,
        timestep,
        encoder_hidden_states: torch.Tensor,
        timestep_cond=None,
        attention_mask=None,
        cross_attention_kwargs=None,
        added_cond_kwargs=None,
        down_block_additional_residuals=None,
        mid_block_additional_residual=None,
        down_intrablock_additional_residuals=None,
        encoder_attention_mask=None,
        class_labels=None,
        return_dict: bool = True,
    ):
        """`UNet2DConditionModel.forward`'s signature; what the package cannot express is refused, not ignored."""
        extras = dict(
            timestep_cond=timestep_cond,
            attention_mask=attention_mask,
            added_cond_kwargs=added_cond_kwargs,
            down_block_additional_residuals=down_block_additional_residuals,
            mid_block_additional_residual=mid_block_additional_residual,
            down_intrablock_additional_residuals=down_intrablock_additional_residuals,
            encoder_attention_mask=encoder_attention_mask,
            class_labels=class_labels,
        )
        given = [k for k, v in extras.items() if v is not None]
        if cross_attention_kwargs:  # e.g. {"scale": ...}: strength goes through the template's scalings instead
            given.append("cross_attention_kwargs")
        if given:
            raise AotShapeError(f"the AOT denoiser takes no {given}: package a model for them.")
        self.check(sample, timestep, encoder_hidden_states)
        t = torch.as_tensor(timestep, device=sample.device, dtype=torch.float32)
        if t.ndim == 0 or t.numel() == 1:
            t = t.reshape(()).repeat(self.shapes.batch)
        elif tuple(t.shape) != (self.shapes.batch,):
            raise AotShapeError(f"timestep of shape {tuple(t.shape)}; expected a scalar or ({self.shapes.batch},).")
        (out,) = self.model(
            sample.contiguous(),
            t.contiguous(),
            encoder_hidden_states=encoder_hidden_states.contiguous(),
            return_dict=False,
        )
        self.calls += 1
        if not return_dict:
            return (out,)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        return UNet2DConditionOutput(sample=out)

    def uninstall(self) -> None:
        """Back to the eager UNet forward."""
        if self.unet.__dict__.get("forward") is self:
            del self.unet.forward


_ISA_ORDER = ["DEFAULT", "AVX2", "AVX512"]


def open_package(path: str | Path):
    """The package's runner (`AOTICompiledModel`), without compiling anything.

    Not `torch._inductor.aoti_load_package`: on the CPU its `_load_aoti` calls `codecache.get_device_information`,
    whose `cpu_vec_isa.pick_vec_isa()` builds small C++ probes with the host compiler (seconds on a fresh machine, and
    a compiler the serving machine should not need) only to log a warning on mismatch. The loader it then
    constructs is the one built here; the ISA check is done below from torch's own CPU capability instead."""
    from torch.export.pt2_archive._package import AOTICompiledModel

    if not Path(path).is_file():
        raise AotPackageError(
            f"AOT package {str(path)[:200]!r}: no such file (build one with `python -m lora_manager aot-package`)."
        )
    try:
        model = AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1))
        meta = model.get_metadata()
    except RuntimeError as e:  # the C++ loader's errors: not a zip archive, no model inside, a broken .so
        raise AotPackageError(f"AOT package {Path(path).name!r} cannot be loaded: {str(e)[:300]}") from None
    if meta.get("AOTI_DEVICE_KEY") == "cpu":
        built = (meta.get("AOTI_CPU_ISA") or "DEFAULT").split()[0].upper()
        here = torch.backends.cpu.get_cpu_capability().upper()
        if built in _ISA_ORDER and here in _ISA_ORDER and _ISA_ORDER.index(built) > _ISA_ORDER.index(here):
            raise AotPackageError(f"{Path(path).name} was compiled for {built} CPUs; this one runs {here}.")
    return model


def cuda_capability(device: torch.device) -> str | None:
    """The CUDA compute capability ("9.0") a package's kernels are compiled for; None on the CPU."""
    return ".".join(map(str, torch.cuda.get_device_capability(device))) if device.type == "cuda" else None


def check_capability(built: str | None, here: str | None, name: str) -> None:
    """A CUDA package runs only on the compute capability it was compiled for: refuse another with both named."""
    if built is not None and built != here:
        raise AotPackageError(
            f"{name} was compiled for CUDA compute capability {built}; this device has "
            f"{here or 'no CUDA'}. Build a package on this GPU with `python -m lora_manager "
            f"aot-package`."
        )


def read_metadata(model) -> dict[str, Any]:
    """The `package_denoiser` metadata of a loaded package (shapes, constants' layout, torch version)."""
    raw = model.get_metadata().get(_META_KEY)
    if raw is None:
        raise AotPackageError("not a lora_manager denoiser package (no lora_manager.aot metadata).")
    return json.loads(raw)


def load_denoiser(pipe, path: str | Path, install: bool = True) -> AotDenoiser:
    """Load a `package_denoiser` package (`open_package`) and bind `pipe.unet`'s own tensors to it by pointer
    (user-managed constants: zero copies, and in-place swaps are visible to the next call). With `install`,
    `pipe.unet.forward` is the package from now on, so `pipe(...)` runs it. No compilation happens here.

    Binding rather than loading weights from the package: the package holds no weights (nothing to keep in sync
    with the checkpoint, a small file), the pipeline keeps a single copy in memory, and the template's tensors that
    the engine writes into are by construction the ones the package reads. The price: the UNet must stay as it is
    (same tensor objects, same device, contiguous) for as long as the package is used."""
    path = Path(path)
    unet = pipe.unet
    if any(switch_of(layer) is not None for _, layer in _lora_layers(unet)):
        raise ValueError(
            "this UNet's engine merges a one-adapter call's adapters into the base weights, and the package runs "
            "the LoRA branch over them too: build the engine with fuse=False (or pass aot_package=)."
        )
    t0 = time.perf_counter()
    model = open_package(path)
    meta = read_metadata(model)
    if meta["torch"] != torch.__version__:
        raise AotPackageError(f"{path.name} was built with torch {meta['torch']}, this is {torch.__version__}.")
    check_capability(meta.get("cuda_capability"), cuda_capability(unet.device), path.name)
    shapes = DenoiserShapes(**meta["shapes"])
    live = live_constants(unet)
    wanted = model.get_constant_fqns()
    missing = [n for n in wanted if n not in live]
    if missing:
        raise AotPackageError(
            f"{path.name} reads {len(missing)} tensor(s) this UNet does not have, e.g. {missing[:3]}; "
            f"was it packaged from another model or template (target rank, adapter modules)?"
        )
    _check_swappable(wanted, unet, path)
    bound = {n: live[n] for n in wanted}
    layout = meta["constants"]
    for n, t in bound.items():
        shape, dtype = layout.get(n, (None, None))
        if [list(t.shape), str(t.dtype).removeprefix("torch.")] != [shape, dtype]:
            raise AotPackageError(
                f"{n}: the package expects {shape} {dtype}, the UNet has {list(t.shape)} {t.dtype} "
                f"(another target rank or dtype?)."
            )
        if not t.is_contiguous() or t.device.type != shapes.device:
            raise AotPackageError(f"{n}: bound tensors must be contiguous and on {shapes.device}.")
    model.load_constants(bound, check_full_update=True, user_managed=True)
    aot = AotDenoiser(model, unet, shapes, path, time.perf_counter() - t0, bound)
    if install:
        unet.forward = aot  # an instance attribute: nn.Module.__call__ (and so the pipeline) calls it
    return aot


def file_digest(path: str | Path) -> str:
    """sha256 of a package, to show that serving never rewrites it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


__all__ = [
    "AotDenoiser",
    "AotPackageError",
    "AotShapeError",
    "DenoiserShapes",
    "file_digest",
    "live_constants",
    "load_denoiser",
    "open_package",
    "package_denoiser",
    "read_metadata",
    "swappable_constants",
]
