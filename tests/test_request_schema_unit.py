"""The request schema alone: every form a request may name its adapters in (an id, ids, (id, strength) pairs, table
rows) becomes one Mix, and every other form is refused with the reason."""

from __future__ import annotations

import pytest

from lora_manager.errors import RequestError
from lora_manager.request_schema import normalize_mix

pytestmark = pytest.mark.unit


def test_normalize_mix_accepts_every_request_form_and_refuses_bad_ones():
    assert normalize_mix(None, 1.0, 2) == normalize_mix("", 1.0, 2) == normalize_mix([], 1.0, 2) == ()
    assert normalize_mix("a", 0.5, 1) == (("a", 0.5),)
    assert normalize_mix(["a", ("b", 0.3)], 0.8, 2) == (("a", 0.8), ("b", 0.3))
    assert normalize_mix([["a", 0.2], ["", 1.0]], 1.0, 1) == (("a", 0.2),)  # a blank row is an unused slot
    with pytest.raises(RequestError, match="'a' appears twice"):
        normalize_mix([("a", 0.5), "a"], 1.0, 3)
    with pytest.raises(RequestError, match="3 adapters requested but this engine has 2 hotswap slot"):
        normalize_mix(["a", "b", "c"], 1.0, 2)
    with pytest.raises(RequestError, match="an id or an"):
        normalize_mix([("a", 0.5, 1)], 1.0, 2)
    with pytest.raises(RequestError, match="must be an id"):
        normalize_mix(7, 1.0, 2)
