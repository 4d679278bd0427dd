"""What a new user hits first, where users run it: plain diffusers on the shipped folder, a forked GPU worker
(ZeroGPU's execution model), a server that runs for weeks, and the README's serve command on a 2-core machine."""

from __future__ import annotations

import base64
import functools
import gc
import inspect
import io
import multiprocessing
import os
import pickle
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from lora_manager.scheduler import WAIT_WINDOW, Request, Scheduler

from helpers import PROMPT, ROOT, TINY_MODEL, running_app
from servers import running_serve


def test_shipped_folder_runs_with_plain_diffusers_default_arguments():
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(TINY_MODEL)  # no dtype: each component as its config says
    pipe.set_progress_bar_config(disable=True)
    assert {pipe.unet.dtype, pipe.text_encoder.dtype, pipe.vae.dtype} == {torch.float32}
    image = pipe(PROMPT, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(0)).images[0]
    assert image.size == (64, 64) and np.asarray(image).std() > 0
    size = sum(p.stat().st_size for p in TINY_MODEL.parent.rglob("*") if p.is_file())
    assert size <= 25 * 2**20, size


def _generate_in_child(handler, conn) -> None:
    image, info = handler(PROMPT, [["r6_te", 0.8]], 1.0, 3, 4)
    conn.send((np.asarray(image), info["adapter"]))
    conn.close()


def _pickling_gpu(fn):
    """As `spaces.GPU` on ZeroGPU: the call's arguments travel to the GPU worker process by pickle."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        pickle.dumps(args)
        return fn(*args, **kwargs)

    return run


def test_app_generate_from_a_forked_child_equals_the_parent(manager, monkeypatch):
    """ZeroGPU runs each `spaces.GPU` call in a process forked from the app after start-up, its arguments pickled."""
    from lora_manager.space import layout

    monkeypatch.setattr(layout, "gpu", _pickling_gpu)
    demo = layout.build_demo(manager)
    handler = next(f.fn for f in demo.fns.values() if f.api_name == "generate")
    assert list(inspect.signature(handler).parameters) == [
        "prompt",
        "adapter",
        "strength",
        "seed",
        "steps",
        "request",
        "progress",
    ]
    manager.generate(PROMPT, adapter="r4_attn", steps=1)  # the worker thread has run before the fork
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_generate_in_child, args=(handler, child_end))
    child.start()
    assert parent_end.poll(120), "the forked child never answered"
    child_image, child_adapter = parent_end.recv()
    child.join(30)
    assert child.exitcode == 0 and child_adapter == "r6_te"
    image, _ = handler(PROMPT, [["r6_te", 0.8]], 1.0, 3, 4)
    assert np.array_equal(child_image, np.asarray(image))
    assert manager.stats()["live"] == ["r6_te"]  # the parent's own state is its own


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_scheduler_memory_and_stats_stay_flat_over_10000_requests():
    scheduler = Scheduler(lambda batch: [r.seed for r in batch], lambda: frozenset(), max_queue=10_000)
    adapters = [(), (("a", 1.0),), (("b", 0.5),)]

    def run(n: int, offset: int) -> None:
        futures = [scheduler.submit(Request(PROMPT, adapters[i % 3], offset + i)) for i in range(n)]
        assert [f.result(60) for f in futures] == list(range(offset, offset + n))

    run(2_000, 0)  # warm: allocator pools and the stats window fill up
    gc.collect()
    before = _rss_bytes()
    for k in range(1, 6):
        run(2_000, k * 2_000)
    gc.collect()
    grown = _rss_bytes() - before
    stats = scheduler.stats
    assert stats.completed == 12_000 and len(stats.waits_s) == WAIT_WINDOW
    assert stats.wait_percentile(50) <= stats.wait_percentile(95) <= stats.max_wait_s
    assert grown < 2 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over 10,000 requests"
    scheduler.close()


def test_serve_sizes_replicas_to_the_machine_or_refuses_with_the_flag():
    pytest.importorskip("ray")
    from lora_manager.serving.ray_app import size_replicas

    assert size_replicas(2, cpus=2, gpus=0, cpus_per_replica=None) == (1.0, 0.0)
    assert size_replicas(4, cpus=2, gpus=0, cpus_per_replica=None) == (0.5, 0.0)
    assert size_replicas(2, cpus=16, gpus=2, cpus_per_replica=None) == (8.0, 1.0)
    with pytest.raises(ValueError, match=r"need 4 CPUs, but Ray sees 2: pass --cpus-per-replica 0.5"):
        size_replicas(4, cpus=2, gpus=0, cpus_per_replica=1.0)
    with pytest.raises(ValueError, match=r"one GPU each, but Ray sees 2: pass --replicas 2"):
        size_replicas(4, cpus=16, gpus=2, cpus_per_replica=None)


@pytest.mark.ray
def test_readme_serve_command_answers_on_this_machine(tmp_path):
    """`python -m lora_manager serve --replicas 2`, exactly as the README gives it, on a 2-core machine."""
    pytest.importorskip("ray")
    command = "python -m lora_manager serve --replicas 2"
    assert command in (ROOT / "README.md").read_text()
    with running_serve(command.split()[4:], 8000, tmp_path / "serve.log") as url:
        body = {"prompt": PROMPT, "adapter": "frame", "strength": 1.0, "seed": 0, "steps": 2}
        r = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text[:500]
    image = Image.open(io.BytesIO(base64.b64decode(r.json()["image_png_base64"])))
    assert image.size == (64, 64) and r.json()["info"]["adapter"] == "frame"


@pytest.mark.app
def test_without_a_cpp_compiler_the_app_starts_eager_and_compile_says_why():
    """A slim image without g++: the app starts and serves (eager, the CPU default); `--compile` stops with one
    line saying why instead of a traceback."""
    from gradio_client import Client

    with running_app(CXX="/nonexistent/g++") as url:
        _, info = Client(url, verbose=False).predict(PROMPT, "frame", 1.0, 0, 2, api_name="/generate")
    assert info["compiled"] is False and info["adapter"] == "frame"
    env = {**os.environ, "CXX": "/nonexistent/g++", "HF_HUB_OFFLINE": "1", "LORA_PRESET": "tiny"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "app.py"), "--compile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("app.py: torch.compile on the CPU needs a C++ compiler")
