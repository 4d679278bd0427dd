"""Browser test of the Gradio app (Playwright + Debian chromium) against `python app.py` on localhost, offline.

Leaves a screenshot in test-artifacts/app.png.
"""

from __future__ import annotations

import io
import json
import re
from urllib.parse import urlparse

import httpx
import pytest
from PIL import Image

from lora_manager.images import levels

from helpers import APP_MARKS, CATALOG, PROMPT, ROOT, adapter_ids, running_app

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = [*APP_MARKS, pytest.mark.browser]
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOT = ROOT / "test-artifacts" / "app.png"
TIMEOUT_MS = 90_000


@pytest.fixture(scope="module")
def page():
    with running_app() as url, playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)
        blocked = []

        def local_only(route):  # nothing may leave the machine (e.g. web fonts)
            if urlparse(route.request.url).hostname in ("127.0.0.1", "localhost"):
                route.continue_()
            else:
                blocked.append(route.request.url)
                route.abort()

        page.route("**/*", local_only)
        page.goto(url)
        page.locator("#gallery").wait_for()
        yield page
        browser.close()
        if blocked:
            print("blocked non-local requests:", blocked)


def _select(page, index: int) -> str:
    """Click gallery item `index` (0 is 'No adapter', then the catalog's order); wait until the app shows its id."""
    adapter_id = adapter_ids()[index - 1]
    page.locator("#gallery button.thumbnail-item").nth(index).click()
    playwright.expect(page.locator("#adapter-id textarea, #adapter-id input").first).to_have_value(adapter_id)
    return adapter_id


def _name(adapter_id: str) -> str:
    return next(a["name"] for a in json.loads(CATALOG.read_text())["adapters"] if a["id"] == adapter_id)


def _generate(page, adapters: str) -> bytes:
    page.locator("#generate").click()
    panel = page.locator("#info-panel")
    playwright.expect(panel).to_contain_text(f"adapter: {adapters}", timeout=TIMEOUT_MS)
    playwright.expect(panel).to_contain_text("recompiles: 0")
    playwright.expect(panel).to_contain_text(" ms")
    src = page.locator("#output-image img").first.get_attribute("src")
    return page.request.get(src).body()


def test_generate_swap_and_add(page):
    page.locator("#gallery button.thumbnail-item").nth(2).wait_for()
    first = _select(page, 1)
    image1 = _generate(page, f"{first} at strength 1 ")
    assert "swap:" in page.locator("#info-panel").inner_text()

    second = _select(page, 2)
    image2 = _generate(page, f"{second} at strength 1 ")
    assert image1 and image2 and image1 != image2

    # Combine: the gallery's adapter in slot 1, the first catalog adapter picked in the "adapter 2" dropdown.
    page.get_by_text("Combine LoRAs").click()
    page.locator("#adapter-2 input").click()
    page.get_by_role("option", name=_name(first), exact=True).click()
    image3 = _generate(page, f"{second} at strength 1 + {first} at strength 1")
    assert image3 not in (image1, image2)

    page.get_by_text("Add a LoRA from the Hub").click()
    page.locator("#repo-id textarea, #repo-id input").first.fill("not a repo")
    page.locator("#add").click()
    playwright.expect(page.locator("#add-status")).to_contain_text("not a valid Hub repo id")

    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)


def _solo(url: str, adapter: dict, steps: int) -> Image.Image:
    """The adapter's image from /generate as the Compare tab asks for it: its trigger added, its catalog strength."""
    trigger, app = adapter.get("trigger", ""), urlparse(url)
    prompt = f"{PROMPT}, {trigger}" if trigger and trigger not in PROMPT else PROMPT
    data = [prompt, adapter["id"], adapter.get("strength", 1.0), 0, steps]
    answer = httpx.post(f"{app.scheme}://{app.netloc}/gradio_api/run/generate", json={"data": data}, timeout=300).json()
    return Image.open(io.BytesIO(httpx.get(answer["data"][0]["url"], timeout=60).content)).convert("RGB")


def test_compare_shows_every_adapter_from_one_mixed_batch(page):
    """The Compare tab with every adapter (its default): one captioned image each, equal to that adapter's image
    served alone, and the batch's time beside one by one's."""
    page.get_by_role("tab", name="Compare").click()
    steps = page.locator("#compare-steps input[type=number]")
    steps.fill("2")
    steps.press("Enter")
    # the number box sets the slider's value, which the click sends: wait until the slider shows it
    playwright.expect(page.locator("#compare-steps input[type=range]")).to_have_value("2")
    page.locator("#compare-run").click()
    timing = page.locator("#compare-timing")
    ran = f"pipeline calls for {len(adapter_ids())} images, 2 steps each"
    playwright.expect(timing).to_contain_text(ran, timeout=TIMEOUT_MS)
    playwright.expect(timing).to_contain_text("one by one:")
    playwright.expect(timing).to_contain_text("as fast")
    assert int(re.search(r"within (\d+) of 255 levels", timing.inner_text())[1]) <= 1
    items = page.locator("#compare-gallery button.thumbnail-item")
    assert items.locator(".caption-label").all_inner_texts() == adapter_ids()
    for adapter, item in zip(json.loads(CATALOG.read_text())["adapters"], items.all(), strict=True):
        src = item.locator("img").get_attribute("src")
        shown = Image.open(io.BytesIO(page.request.get(src).body())).convert("RGB")
        assert levels(shown, _solo(page.url, adapter, 2)) <= 1, adapter["id"]
