"""One seed with many adapters as one mixed batch against one by one (`serving.compare`), and the Space's Compare tab
handler over it: every batch image equals its request served alone, an engine of one request per call is not timed
twice, and a visitor compares only the adapters they may use. The browser test of the tab is in test_app.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from lora_manager import LoraManager
from lora_manager.errors import RequestError
from lora_manager.images import levels
from lora_manager.serving.additions import Additions
from lora_manager.serving.compare import Row, compare

from engine_helpers import ADAPTERS, load_tiny, make_catalog
from helpers import PROMPT

ROWS = [Row(name, f"{PROMPT}, {name}", 0.5 + 0.1 * i) for i, name in enumerate(ADAPTERS)]


@pytest.fixture(scope="module")
def batched(adapter_dir) -> LoraManager:
    return LoraManager(load_tiny(), make_catalog(adapter_dir), max_batch=4)


def test_the_batch_shares_pipeline_calls_and_each_image_equals_its_request_alone(batched):
    calls, t0 = batched.stats()["batches"], time.perf_counter()
    done = compare(batched, ROWS, seed=3, steps=2)
    wall = time.perf_counter() - t0
    assert [r.info["adapter"] for r in done.results] == [r.adapter_id for r in ROWS]
    assert 2 <= done.batch_calls < len(ROWS)  # six requests, four a call at most: fewer calls than one by one
    assert max(r.info["batch_size"] for r in done.results) > 1
    # one by one really ran each request in a pipeline call of its own, after the batch's calls
    assert batched.stats()["batches"] - calls == done.batch_calls + len(ROWS)
    assert done.solo_s is not None and 0 < done.batch_s and 0 < done.solo_s and done.batch_s + done.solo_s <= wall
    assert done.speedup is not None and done.max_levels <= 1
    for row, result in zip(ROWS, done.results, strict=True):
        alone = batched.generate(row.prompt, adapter=row.adapter_id, strength=row.strength, seed=3, steps=2)
        assert levels(result.image, alone.image) <= 1, row
    assert len({result.image.tobytes() for result in done.results}) == len(ROWS)  # every row ran its own adapter


def test_one_request_per_call_is_timed_once(manager):
    seen = []
    done = compare(manager, ROWS[:2], seed=1, steps=2, progress=lambda n, total: seen.append((n, total)))
    assert done.batch_calls == 2 and done.solo_s is None and done.speedup is None and done.max_levels is None
    assert seen == [(0, 2), (1, 2), (2, 2)]


def test_a_bad_request_is_refused_before_any_runs(batched):
    batches = batched.stats()["batches"]
    with pytest.raises(RequestError, match="seed"):
        compare(batched, ROWS[:2], seed=-1, steps=2)
    with pytest.raises(RequestError, match="strength"):
        compare(batched, [ROWS[0], Row("r4_attn", PROMPT, 9.0)], seed=0, steps=2)
    assert batched.stats()["batches"] == batches


def test_the_tab_compares_only_what_the_visitor_may_use(batched):
    from lora_manager.space import handlers

    additions = Additions()
    additions.add("owner", "r16_half", 1)  # as if this visitor had added it
    space = handlers.Space(batched, additions)
    owner, stranger = SimpleNamespace(session_hash="owner"), SimpleNamespace(session_hash="stranger")
    with pytest.raises(handlers.Refusal, match="Unknown adapter 'r16_half'"):
        handlers.compare(space, ["r4_attn", "r16_half"], PROMPT, True, 0, 2, stranger)
    for ids in ([], "r4_attn", [None], list(ADAPTERS) * 2 + ["x"], [f"a{i}" for i in range(handlers.COMPARE_MAX + 1)]):
        with pytest.raises(handlers.Refusal, match="adapter"):
            handlers.compare(space, ids, PROMPT, True, 0, 2, owner)
    items, markdown = handlers.compare(space, ["r16_half", "r4_attn", "r16_half"], PROMPT, True, 0, 2, owner)
    assert [caption for _, caption in items] == ["r16_half", "r4_attn"]
    assert "one mixed batch:" in markdown and "one by one:" in markdown


def test_the_tab_says_when_the_batch_ran_one_request_per_call(manager):
    from lora_manager.space import handlers

    items, markdown = handlers.compare(
        handlers.Space(manager, Additions()), ["r4_attn", "r7_conv"], PROMPT, False, 0, 2
    )
    assert [caption for _, caption in items] == ["r4_attn", "r7_conv"]
    assert "(2 pipeline calls for 2 images, 2 steps each)" in markdown and "not timed twice" in markdown, markdown
    assert "one by one:" not in markdown
