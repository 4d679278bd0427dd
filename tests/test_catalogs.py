"""Every preset catalog parses, names valid sources, and the catalog loader names missing and unknown keys."""

from __future__ import annotations

import pytest

from lora_manager.adapters.catalog import load_preset, preset_names
from lora_manager.adapters.sources import check_repo_id, is_local_source


@pytest.mark.parametrize("name", preset_names())
def test_preset_catalog_is_well_formed(name):
    catalog, root = load_preset(name)
    assert catalog.name == name and len(catalog.adapters) >= 5
    assert {"height", "width", "num_inference_steps", "guidance_scale"} <= set(catalog.generation)
    for spec in catalog.adapters:
        if is_local_source(spec.source):
            assert (root / spec.source).is_file(), spec.id
            assert spec.preview and (root / spec.preview).is_file(), spec.id
        else:
            check_repo_id(spec.source, spec.id, allow_local=False)  # raises on a malformed id
            assert spec.weight_name is None or spec.weight_name.endswith(".safetensors"), spec.id
    if name != "tiny":
        assert catalog.torch_dtype in ("float16", "bfloat16") and catalog.hardware
