"""lora_manager.adapters.sources against the real huggingface_hub client, pointed at a local Hub emulator
(tests/hub_server.py).

huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE and the timeouts into `huggingface_hub.constants` at
import time, and the test process imported it long ago (test modules import diffusers). `hub_env` (hub_server.py)
therefore sets the environment variables, re-executes the library's own constants.py with them in a scratch module
and patches every value that differs into `huggingface_hub.constants` (monkeypatch undoes it); all the code used here
reads them as `constants.X` at call time. `hub_env` then checks that the endpoint, cache and offline flag really
changed.

No test can reach the real Hub: the autouse `net` fixture wraps `socket.getaddrinfo` (every outgoing connection of
the client goes through `socket.create_connection`), refuses any host but 127.0.0.1 and records each lookup, so a
test can also prove that nothing was contacted at all. The emulator records every request it gets.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hf_constants
from safetensors.torch import load_file, save_file

from lora_manager.adapters.sources import resolve
from lora_manager.errors import AdapterSourceError, AdapterTooLargeError, LoraManagerError

from hub_server import HubServer, Repo, commit_of, hub_env

TOKEN = "hf_localtestTOKENdoNotLeak0123456789"


@pytest.fixture(autouse=True)
def net(monkeypatch) -> list[str]:
    """Every host name the process looks up during the test; anything but the loopback address is refused."""
    hosts: list[str] = []
    real = socket.getaddrinfo

    def guarded(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else str(host)
        hosts.append(name)
        if name != "127.0.0.1":
            raise OSError(f"test tried to reach {name!r}; only the local Hub emulator may be contacted")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)
    return hosts


# -- repos ---------------------------------------------------------------------------------------------------------
def lora_bytes(tmp: Path, seed: int, rank: int = 4, dim: int = 32) -> bytes:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "unet.down.attn.to_q.lora_A.weight": torch.randn(rank, dim, generator=g),
        "unet.down.attn.to_q.lora_B.weight": torch.randn(dim, rank, generator=g),
    }
    path = tmp / f"lora_{seed}_{dim}.safetensors"
    save_file(tensors, str(path))
    return path.read_bytes()


@pytest.fixture(scope="module")
def blobs(tmp_path_factory) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("blobs")
    return {"a": lora_bytes(tmp, 1), "b": lora_bytes(tmp, 2), "big": lora_bytes(tmp, 3, rank=8, dim=256)}


def make_repos(blobs: dict[str, bytes]) -> dict[str, Repo]:
    a, b = blobs["a"], blobs["b"]
    return {
        "owner/lora": Repo({"main": {"lora.safetensors": a, "README.md": b"# lora"}, "v2": {"lora.safetensors": b}}),
        "owner/multi": Repo({"main": {"a.safetensors": a, "b.safetensors": b}}),
        "owner/pickle": Repo({"main": {"pytorch_lora_weights.bin": b"\x80\x02pickle", "README.md": b"#"}}),
        "owner/private": Repo({"main": {"lora.safetensors": a}}, token=TOKEN),
        "owner/broken": Repo({"main": {"lora.safetensors": a}}, fault="500"),
        "owner/slow": Repo({"main": {"lora.safetensors": a}}, fault="hang"),
        "owner/cut": Repo({"main": {"lora.safetensors": blobs["big"]}}, file_faults={"lora.safetensors": "cut"}),
    }


@pytest.fixture
def hub(blobs, tmp_path, monkeypatch):
    """A running emulator, HF_ENDPOINT pointing at it and a fresh HF_HOME (cache and token file) per test."""
    with HubServer(make_repos(blobs)) as server:
        hub_env(monkeypatch, HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf_home"))
        yield server


def cache_dir() -> Path:
    return Path(hf_constants.HF_HUB_CACHE)


def snapshot_files(repo_id: str) -> list[Path]:
    folder = cache_dir() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def resolve_error(*args, **kwargs) -> AdapterSourceError:
    with pytest.raises(AdapterSourceError) as info:
        resolve(*args, **kwargs)
    assert type(info.value) is AdapterSourceError
    return info.value


def messages(err: BaseException) -> str:
    """The error's message and those of every exception it was raised from."""
    out, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        out.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(out)


def resolve_paths(hub: HubServer, repo_id: str, method: str | None = None) -> list[str]:
    return [p for p in hub.paths(method) if p.startswith(f"/{repo_id}/resolve/")]


# -- downloads -----------------------------------------------------------------------------------------------------
def test_download_lands_in_hf_cache_and_revisions_pin(hub, blobs, net):
    path = resolve("owner/lora", "ad", weight_name="lora.safetensors")
    main = commit_of("owner/lora", "main")
    assert path == cache_dir() / "models--owner--lora" / "snapshots" / main / "lora.safetensors"
    assert path.read_bytes() == blobs["a"]
    assert set(load_file(str(path))) == {"unet.down.attn.to_q.lora_A.weight", "unet.down.attn.to_q.lora_B.weight"}
    assert "/owner/lora/resolve/main/lora.safetensors" in hub.paths("GET")
    assert set(net) == {"127.0.0.1"}  # requests really went to the emulator, and only there

    v2 = resolve("owner/lora", "ad", weight_name="lora.safetensors", revision="v2")
    assert v2.parent.name == commit_of("owner/lora", "v2") and v2.read_bytes() == blobs["b"]
    pinned = resolve("owner/lora", "ad", weight_name="lora.safetensors", revision=main)
    assert pinned == path and pinned.read_bytes() == blobs["a"]
    assert "/owner/lora/resolve/v2/lora.safetensors" in hub.paths("HEAD")


def test_repo_with_one_safetensors_needs_no_weight_name(hub, blobs):
    path = resolve("owner/lora", "ad")
    assert path.name == "lora.safetensors" and path.read_bytes() == blobs["a"]
    assert "/api/models/owner/lora" in hub.paths("GET")  # listed through the emulator's model_info endpoint
    assert resolve("owner/lora", "ad", revision="v2").read_bytes() == blobs["b"]
    assert "/api/models/owner/lora/revision/v2" in hub.paths("GET")


def test_repo_with_several_safetensors_needs_weight_name(hub):
    err = resolve_error("owner/multi", "multi_ad")
    assert "'multi_ad'" in str(err) and "a.safetensors" in str(err) and "b.safetensors" in str(err)
    assert "pass weight_name" in str(err)
    assert resolve_paths(hub, "owner/multi") == []  # refused before any download


def test_pickle_only_repo_is_refused(hub):
    err = resolve_error("owner/pickle", "pk")
    assert "no .safetensors file" in str(err) and "pytorch_lora_weights.bin" in str(err) and "refused" in str(err)
    assert resolve_paths(hub, "owner/pickle") == []


# -- Hub errors ----------------------------------------------------------------------------------------------------
def test_missing_repo(hub):
    err = resolve_error("owner/nope", "gone", weight_name="lora.safetensors")
    assert "repo 'owner/nope' not found, or private" in str(err)
    err = resolve_error("owner/nope", "gone")
    assert "repo 'owner/nope' not found, or private" in str(err)
    assert "/owner/nope/resolve/main/lora.safetensors" in hub.paths("HEAD")


def test_missing_file_and_revision(hub):
    err = resolve_error("owner/lora", "ad", weight_name="other.safetensors")
    assert "file 'other.safetensors' not found in 'owner/lora'; check weight_name" in str(err)
    err = resolve_error("owner/lora", "ad", weight_name="lora.safetensors", revision="v9")
    assert "revision 'v9' not found in 'owner/lora'" in str(err)


def test_private_repo_needs_token(hub, blobs, monkeypatch):
    err = resolve_error("owner/private", "priv", weight_name="lora.safetensors")
    assert "not found, or private (set HF_TOKEN" in str(err)
    asked = [r for r in hub.requests if r.path.startswith(("/owner/private/", "/api/models/owner/private"))]
    assert asked and all("authorization" not in r.headers for r in hub.requests), hub.requests  # asked, no token

    monkeypatch.setenv("HF_TOKEN", TOKEN)  # read by huggingface_hub at call time
    hub.clear()
    path = resolve("owner/private", "priv", weight_name="lora.safetensors")
    assert path.read_bytes() == blobs["a"]
    assert resolve("owner/private", "priv").read_bytes() == blobs["a"]  # listing is authenticated too
    seen = [r for r in hub.requests if r.path.startswith(("/owner/private/", "/api/models/owner/private"))]
    assert {r.method for r in seen} == {"HEAD", "GET"}
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in seen)


def test_token_never_in_error_messages(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    errors = [
        resolve_error("owner/nope", "x", weight_name="lora.safetensors"),
        resolve_error("owner/lora", "x", weight_name="other.safetensors"),
        resolve_error("owner/broken", "x", weight_name="lora.safetensors"),
        resolve_error("owner/multi", "x"),
    ]
    monkeypatch.setenv("HF_TOKEN", TOKEN + "wrong")
    wrong = resolve_error("owner/private", "x", weight_name="lora.safetensors")
    assert "refused access" in str(wrong) and "HTTP 401" in str(wrong) and "HF_TOKEN" in str(wrong)
    errors.append(wrong)
    assert any(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests)  # it was sent
    for err in errors:
        assert TOKEN not in messages(err) and TOKEN not in repr(err.args)


def test_server_error_fails_fast(hub):
    start = time.monotonic()
    err = resolve_error("owner/broken", "br", weight_name="lora.safetensors")
    assert "the Hub answered HTTP 500 for owner/broken/lora.safetensors; retry later" in str(err)
    err = resolve_error("owner/broken", "br")
    assert "HTTP 500 for owner/broken; retry later" in str(err)
    assert time.monotonic() - start < 3  # one request each, not huggingface_hub's back-off
    assert len(resolve_paths(hub, "owner/broken", "HEAD")) == 1
    assert hub.paths("GET").count("/api/models/owner/broken") == 1


def test_timeout_is_bounded(blobs, tmp_path, monkeypatch):
    with HubServer(make_repos(blobs), hang_s=6.0) as hub:
        hub_env(monkeypatch, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_ETAG_TIMEOUT="1")
        assert hf_constants.HF_HUB_ETAG_TIMEOUT == 1
        start = time.monotonic()
        err = resolve_error("owner/slow", "slow", weight_name="lora.safetensors")
        assert "the Hub did not answer in time for owner/slow/lora.safetensors" in str(err)
        err = resolve_error("owner/slow", "slow")
        assert "the Hub did not answer in time for owner/slow;" in str(err)
        assert time.monotonic() - start < 5  # two 1 s timeouts, shorter than the server's 6 s hang
        assert len(resolve_paths(hub, "owner/slow", "HEAD")) == 1
    assert snapshot_files("owner/slow") == []


def test_connection_cut_mid_download_leaves_no_cached_file(hub, blobs):
    err = resolve_error("owner/cut", "cut", weight_name="lora.safetensors")
    assert "download of owner/cut/lora.safetensors failed (RemoteProtocolError" in str(err)
    assert "retry later" in str(err)
    assert len(resolve_paths(hub, "owner/cut", "GET")) >= 2  # huggingface_hub retried before giving up
    repo_cache = cache_dir() / "models--owner--cut"
    assert snapshot_files("owner/cut") == []
    assert [p for p in (repo_cache / "blobs").rglob("*") if p.is_file()] == []  # no partial blob, not even .incomplete

    hub.repos["owner/cut"].file_faults.clear()  # the link is back
    path = resolve("owner/cut", "cut", weight_name="lora.safetensors")
    assert path.read_bytes() == blobs["big"]
    assert snapshot_files("owner/cut") == [path]


def test_cached_file_survives_hub_errors(hub, blobs):
    path = resolve("owner/lora", "ad", weight_name="lora.safetensors")
    hub.repos["owner/lora"].fault = "500"
    assert resolve("owner/lora", "ad", weight_name="lora.safetensors") == path
    assert resolve("owner/lora", "ad") == path  # the listing falls back to the cached snapshot
    hub.stop()  # Hub unreachable (connection refused), HF_HUB_OFFLINE not set
    assert resolve("owner/lora", "ad", weight_name="lora.safetensors") == path
    err = resolve_error("owner/multi", "m", weight_name="a.safetensors")
    assert "download of owner/multi/a.safetensors failed (ConnectError" in str(err)


# -- offline -------------------------------------------------------------------------------------------------------
def test_offline_uses_prefilled_cache(blobs, tmp_path, monkeypatch, net):
    home = str(tmp_path / "hf_home")
    with HubServer(make_repos(blobs)) as hub:
        hub_env(monkeypatch, HF_ENDPOINT=hub.url, HF_HOME=home)
        online = resolve("owner/lora", "ad", weight_name="lora.safetensors")
        online_v2 = resolve("owner/lora", "ad", weight_name="lora.safetensors", revision="v2")
        assert resolve("owner/lora", "ad") == online
        assert "/owner/lora/resolve/main/lora.safetensors" in hub.paths("GET")

    hub_env(monkeypatch, HF_HOME=home, HF_HUB_OFFLINE="1")
    net.clear()
    assert resolve("owner/lora", "ad", weight_name="lora.safetensors") == online
    assert online.read_bytes() == blobs["a"]
    assert resolve("owner/lora", "ad", weight_name="lora.safetensors", revision="v2") == online_v2
    assert resolve("owner/lora", "ad") == online  # no weight_name: the cached snapshot's one safetensors

    err = resolve_error("owner/lora", "ad", weight_name="other.safetensors")
    assert "owner/lora/other.safetensors is not in the local Hub cache" in str(err)
    err = resolve_error("owner/multi", "m")
    assert "owner/multi is not in the local Hub cache" in str(err)
    assert net == []  # offline: not even a name lookup


# -- validation before any request -----------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["a", "a/b/c", "bad id/x", "a--b/c", "-a/b", "a/b.", "a/../b"])
def test_malformed_repo_id(hub, net, source):
    err = resolve_error(source, "bad", allow_local=False)
    assert f"{source!r} is not a valid Hub repo id" in str(err) and "'bad'" in str(err)
    assert hub.requests == [] and net == []


@pytest.mark.parametrize(
    "source", ["../etc/passwd", "/etc/passwd", "C:\\Windows\\x.safetensors", "./x.safetensors", "~/x.safetensors"]
)
def test_local_path_refused_where_only_repo_ids_are_allowed(hub, net, source):
    err = resolve_error(source, "ui", allow_local=False)
    assert "local paths are not accepted here" in str(err) and "'owner/name'" in str(err)
    assert hub.requests == [] and net == []


@pytest.mark.parametrize("suffix", [".bin", ".ckpt", ".pt"])
def test_pickle_file_refused(hub, net, tmp_path, suffix):
    local = tmp_path / f"weights{suffix}"
    local.write_bytes(b"\x80\x02not really a pickle")
    for args in ((str(local), "pk"), (str(tmp_path), "pk", local.name), ("owner/lora", "pk", f"lora{suffix}")):
        err = resolve_error(*args)
        assert f"is a pickle file ({suffix})" in str(err) and "unpickling can run arbitrary code" in str(err)
    assert hub.requests == [] and net == []


def test_local_file_resolves_without_the_hub(hub, net, tmp_path, blobs):
    (tmp_path / "mine.safetensors").write_bytes(blobs["a"])
    assert resolve("mine.safetensors", "loc", base_dir=tmp_path) == tmp_path / "mine.safetensors"
    assert resolve(str(tmp_path), "loc", weight_name="mine.safetensors") == tmp_path / "mine.safetensors"
    err = resolve_error(str(tmp_path / "absent.safetensors"), "loc")
    assert "no such file" in str(err)
    assert hub.requests == [] and net == []


# -- sizes ---------------------------------------------------------------------------------------------------------
def test_a_file_over_max_bytes_is_refused_from_its_declared_size(hub, blobs, tmp_path):
    """The size comes from the metadata request: a refused Hub file is never fetched; a local one is not read."""
    hub.repos["owner/huge"] = Repo(
        {"main": {"lora.safetensors": blobs["a"]}}, declared_sizes={"lora.safetensors": 3 * 2**30}
    )
    with pytest.raises(AdapterTooLargeError, match=r"'ad': lora.safetensors is 3072.0 MiB, more than the 1.0 MiB"):
        resolve("owner/huge", "ad", max_bytes=2**20)
    assert resolve_paths(hub, "owner/huge", "GET") == [] and snapshot_files("owner/huge") == []
    assert resolve("owner/lora", "ad", max_bytes=len(blobs["a"])).read_bytes() == blobs["a"]  # at the limit: served
    local = tmp_path / "big.safetensors"
    local.write_bytes(blobs["big"])
    with pytest.raises(AdapterTooLargeError, match="big.safetensors is"):
        resolve(str(local), "ad", max_bytes=len(blobs["big"]) - 1)


def test_an_adapter_refused_after_download_leaves_the_cache_as_it_was(hub, blobs, adapter_dir):
    """`register` deletes what a refused Hub file brought into the cache, and keeps what was there before."""
    from lora_manager import LoraManager

    from engine_helpers import load_tiny, make_catalog

    hub.repos["owner/zeros"] = Repo({"main": {"lora.safetensors": bytes(4096)}})
    m = LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn",)))
    before = snapshot_files("owner/lora")
    resolve("owner/lora", "ad", weight_name="lora.safetensors")  # cached before the refusal
    with pytest.raises(LoraManagerError):
        m.register("zeros", "owner/zeros")
    assert resolve_paths(hub, "owner/zeros", "GET") and not list(cache_dir().glob("models--owner--zeros/blobs/*"))
    with pytest.raises(LoraManagerError):  # the file is a LoRA for another model: refused, but was cached before
        m.register("other", "owner/lora", weight_name="lora.safetensors")
    assert len(snapshot_files("owner/lora")) == len(before) + 1
    assert m.adapter_byte_limit() > 2**20 and m.adapter_byte_limit(2**20) == 2**20


def test_disk_bytes_count_what_a_registration_downloaded(hub, adapter_dir):
    """A file padded with metadata holds few tensor bytes but many on disk: `disk_bytes` reports the files its
    registration brought into the Hub cache (what a Space's additions budget counts), and 0 for what was there."""
    from lora_manager import LoraManager

    from engine_helpers import load_tiny, make_catalog
    from helpers import padded

    data = padded((adapter_dir / "r4_attn.safetensors").read_bytes(), 2**20)
    hub.repos["owner/padded"] = Repo({"main": {"lora.safetensors": data}})
    m = LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn",)))
    info = m.register("padded", "owner/padded")
    on_disk = sum(p.stat().st_size for p in cache_dir().glob("models--owner--padded/blobs/*"))
    assert info.disk_bytes >= on_disk == len(data) > 2**20 > info.bytes
    assert m.register("again", "owner/padded").disk_bytes == 0  # the same file, already cached
    assert m.register("local", str(adapter_dir / "r4_attn.safetensors")).disk_bytes == 0


def test_a_refused_registration_keeps_the_files_of_one_from_the_same_repo_meanwhile(hub, adapter_dir):
    """While a slow file of a repo downloads and is then refused, another visitor registers another file of the same
    repo: the refusal removes only what it downloaded itself, and the other adapter keeps its file."""
    import threading

    from lora_manager import LoraManager

    from engine_helpers import load_tiny, make_catalog

    files = {"good.safetensors": (adapter_dir / "r4_attn.safetensors").read_bytes(), "zeros.safetensors": bytes(4096)}
    hub.repos["owner/pair"] = Repo({"main": files}, file_faults={"zeros.safetensors": "slow"})
    m = LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn",)))
    refused: list[BaseException] = []

    def register_zeros() -> None:
        try:
            m.register("zeros", "owner/pair", weight_name="zeros.safetensors")
        except LoraManagerError as e:
            refused.append(e)

    slow = threading.Thread(target=register_zeros)
    slow.start()
    deadline = time.monotonic() + 10
    while not resolve_paths(hub, "owner/pair", "GET") and time.monotonic() < deadline:
        time.sleep(0.02)  # until the slow download has begun
    m.register("good", "owner/pair", weight_name="good.safetensors")
    slow.join()
    assert len(refused) == 1 and "zeros" not in m.registry
    good = [p for p in snapshot_files("owner/pair") if p.name == "good.safetensors"]
    assert len(good) == 1 and good[0].read_bytes() == files["good.safetensors"]
    assert m.registry.reread("good").modules  # the registered adapter can still be read from its file
