"""The catalog loader alone: a catalog with missing, unknown or duplicate entries, or an unknown preset, is refused
naming what is wrong (test_catalogs.py checks every shipped preset)."""

from __future__ import annotations

import pytest

from lora_manager.adapters.catalog import half_variant, load_preset
from lora_manager.specs import Catalog

pytestmark = pytest.mark.unit


def test_catalog_loader_names_missing_and_unknown_keys():
    with pytest.raises(ValueError, match=r"missing keys \['source'\]; unknown keys \['sauce'\]"):
        Catalog.from_dict({"name": "x", "base_model": "m", "adapters": [{"id": "a", "sauce": "b"}]})
    with pytest.raises(ValueError, match=r"duplicate adapter ids \['a'\]"):
        Catalog.from_dict({"name": "x", "base_model": "m", "adapters": [{"id": "a", "source": "s"}] * 2})
    with pytest.raises(ValueError, match="Unknown preset 'nope'"):
        load_preset("nope")


def test_half_variant_is_the_dtypes_weight_files_where_the_model_has_them(tmp_path):
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    assert [half_variant(str(tmp_path), d) for d in ("float16", "torch.bfloat16", "float32")] == [None] * 3
    (tmp_path / "unet" / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"")
    assert [half_variant(str(tmp_path), d) for d in ("torch.float16", "bfloat16", "float32")] == ["fp16", None, None]
