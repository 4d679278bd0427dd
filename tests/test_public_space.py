"""A public Space as strangers use it, through the Gradio API (`gradio_client`), against a local Hub emulator with an
empty Hub cache: what a visitor adds is checked for size before any byte is fetched, leaves nothing behind when it is
refused, belongs to that visitor, and is bounded per visitor and in all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from helpers import CATALOG, PROMPT, running_app
from hub_server import HubServer, Repo

pytestmark = pytest.mark.app

PER_VISITOR, MAX_ADDITIONS = 2, 3
ADAPTERS = [a["source"] for a in json.loads(CATALOG.read_text())["adapters"]]


def lora(i: int) -> bytes:
    return (CATALOG.parent / ADAPTERS[i % len(ADAPTERS)]).read_bytes()


REPOS = {
    "huge/declared": Repo({"main": {"lora.safetensors": lora(0)}}, declared_sizes={"lora.safetensors": 5 * 2**29}),
    "broken/zeros": Repo({"main": {"big.safetensors": bytes(2 * 2**20)}}),
    **{f"good/l{i}": Repo({"main": {"lora.safetensors": lora(i)}}) for i in range(5)},
}


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """The app (per-visitor additions, 2 a visitor, 3 in all) on the Hub emulator, with its own empty Hub cache."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    with HubServer(REPOS) as hub:
        with running_app(
            HF_ENDPOINT=hub.url,
            HF_HOME=str(hf_home),
            HF_HUB_OFFLINE="0",
            LORA_ADDITIONS_PER_VISITOR=str(PER_VISITOR),
            LORA_MAX_ADDITIONS=str(MAX_ADDITIONS),
        ) as url:
            yield url, hub, hf_home / "hub"


def cached(hub_cache: Path, repo_id: str) -> list[Path]:
    """The repo's blobs in the Hub cache: what a download left on disk."""
    return sorted((hub_cache / f"models--{repo_id.replace('/', '--')}" / "blobs").glob("*"))


def add(client: Client, repo_id: str) -> str:
    return client.predict(repo_id, "", api_name="/add_adapter")


def generate(client: Client, adapter: str) -> dict:
    return client.predict(PROMPT, adapter, 1.0, 0, 2, api_name="/generate")[1]


def test_a_file_declared_too_large_is_refused_before_any_byte(space):
    url, hub, hub_cache = space
    status = add(Client(url, verbose=False), "huge/declared")
    assert status.startswith("**Refused:**") and "lora.safetensors is 2560.0 MiB, more than the" in status, status
    assert not [p for p in hub.paths("GET") if p.startswith("/huge/declared/resolve/")]
    assert cached(hub_cache, "huge/declared") == []


def test_a_refused_download_leaves_nothing_in_the_hub_cache(space):
    url, hub, hub_cache = space
    status = add(Client(url, verbose=False), "broken/zeros")
    assert status.startswith("**Refused:**") and "big.safetensors" in status, status
    assert [p for p in hub.paths("GET") if p.startswith("/broken/zeros/resolve/")]  # it was fetched, then refused
    assert cached(hub_cache, "broken/zeros") == []
    assert not (hub_cache / "models--broken--zeros" / "snapshots").exists() or not any(
        (hub_cache / "models--broken--zeros" / "snapshots").rglob("*.safetensors")
    )


def test_additions_are_private_capped_per_visitor_and_bounded_in_all(space):
    url, _, hub_cache = space
    one, two = Client(url, verbose=False), Client(url, verbose=False)
    assert "`l0`" in add(one, "good/l0")
    assert generate(one, "l0")["adapter"] == "l0"
    with pytest.raises(AppError, match=r"Unknown adapter 'l0'; available: \["):
        generate(two, "l0")  # another visitor's addition does not exist for this one
    assert "`l1`" in add(one, "good/l1")
    refused = add(one, "good/l2")
    assert "the limit per visitor here is 2" in refused, refused

    # the second visitor still adds; past 3 additions in all, the least recently used (l1) goes, files included
    assert "`l2`" in add(two, "good/l2")
    generate(one, "l0")  # l0 used again: l1 is now the oldest
    assert cached(hub_cache, "good/l1")
    assert "`l3`" in add(two, "good/l3")
    assert cached(hub_cache, "good/l1") == []
    with pytest.raises(AppError, match="Unknown adapter 'l1'"):
        generate(one, "l1")
    assert generate(one, "l0")["adapter"] == "l0" and generate(two, "l3")["adapter"] == "l3"


def test_shared_additions_are_everyones(tmp_path):
    with HubServer({"good/l4": REPOS["good/l4"]}) as hub:
        with running_app(
            HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="0", LORA_SHARED_ADDITIONS="1"
        ) as url:
            one, two = Client(url, verbose=False), Client(url, verbose=False)
            assert "`l4`" in add(one, "good/l4")
            assert generate(two, "l4")["adapter"] == "l4"


def test_the_additions_budget_counts_bytes_on_disk(tmp_path):
    """A file padded with metadata holds few tensor bytes but 3 MiB on disk: past the 2 MiB budget, the older
    addition goes, files included."""
    from helpers import padded

    repos = {"good/l4": REPOS["good/l4"], "pad/big": Repo({"main": {"lora.safetensors": padded(lora(1), 3 * 2**20)}})}
    with HubServer(repos) as hub:
        with running_app(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="0", LORA_ADDITIONS_MB="2") as url:
            client = Client(url, verbose=False)
            assert "`l4`" in add(client, "good/l4")
            assert "`big`" in add(client, "pad/big")
            with pytest.raises(AppError, match="Unknown adapter 'l4'"):
                generate(client, "l4")
            assert cached(tmp_path / "hub", "good/l4") == []
            assert generate(client, "big")["adapter"] == "big"
