# %% [markdown]
# # Many LoRAs, one per request: hotswap without reloading or recompiling
#
# > *"I have ~10 LoRAs and pick one per request. The `hotswap` docs say that if the adapters have different ranks
# > and/or alphas, I need to call an additional method before loading. Which method?"*
#
# **The method is `enable_lora_hotswap(target_rank=R)`**, with `R` the highest rank of any LoRA you will load. Call it
# *before the first* `load_lora_weights`, in this order:
#
# ```python
# pipe.enable_lora_hotswap(target_rank=64)                   # 1. before any LoRA is loaded
# pipe.load_lora_weights(first_lora, adapter_name="style")   # 2. first load: padded to rank 64
# pipe.unet.compile()                                        # 3. compile once (optional)
# pipe.load_lora_weights(next_lora, adapter_name="style",    # 4. every later LoRA: same name,
#                        hotswap=True)                       #    weights copied in place
# ```
#
# It pads every `lora_A`/`lora_B` to rank `R` and turns each `scaling` (alpha / rank) from a Python float into a
# tensor, so another rank or alpha changes only *values*, nothing `torch.compile` recompiles for. You need it with
# `torch.compile` when ranks or alphas differ (without it, each new rank or alpha recompiles: deep dive B); eager,
# hotswap works without it. It reaches only the UNet/transformer: text-encoder LoRAs cannot be hotswapped (8.4).
#
# The rest of the question, in short:
#
# - *Keep LoRAs in CPU memory, move one in on demand?* Section 2 is a complete plain-diffusers recipe, run here.
# - *Reload per request, or all resident with `set_adapters`?* Reloading recreates the LoRA modules every time. All
#   resident holds every LoRA in device memory and computes every *active* one; compiled, each new active set compiles
#   once, and past dynamo's `recompile_limit` (8) new sets run eager (section 3).
# - *Concurrent requests with different LoRAs?* Keep the adapter with the request; swap only between generations
#   (section 6).
#
# Every number is measured by this run, on a tiny model that ships with the repository (CPU, offline, a few
# minutes). Main path: **2** the recipe and `LoraManager`; **3** the options; **4** `target_rank`; **5** compile;
# **6** concurrency; **7** GPU. Then **8** pitfalls, reproduced; deep dives **A** (padding cost on real models) and
# **B** (recompiles, counted).

# %% [markdown]
# ## Setup
#
# The base model (`lora_manager/presets/tiny`: a Stable-Diffusion-architecture pipeline trained on coloured shapes)
# and six LoRAs ship with the repository; install it first (`pip install -e .`).

# %%
import contextlib
import json
import logging
import os
import random
import re
import tempfile
import time
import warnings

T_START = time.perf_counter()
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "lora_manager").is_dir())  # the checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is local
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the text encoder's loader
# tqdm's notice that Jupyter widgets are missing, and PEFT's each time a second adapter joins a model (which the
# strategies below do on purpose): neither says anything about this tutorial
warnings.filterwarnings("ignore", message="IProgress not found")
warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")

import diffusers
import matplotlib.pyplot as plt
import numpy as np
import peft
import torch
from diffusers import DiffusionPipeline, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.utils import logging as diffusers_logging
from IPython.display import Markdown, display
from PIL import Image, ImageDraw
from torch._dynamo.utils import counters
from transformers.utils import logging as transformers_logging

from lora_manager import LoraManager, LoraManagerError
from lora_manager.images import levels  # largest per-pixel difference of two images, in 8-bit levels

diffusers_logging.disable_progress_bar()
transformers_logging.disable_progress_bar()
# diffusers' warnings show where they teach something, inside `logged` blocks below; elsewhere they are its notice
# that a UNet-only LoRA file has no text-encoder keys, on every load
diffusers_logging.set_verbosity_error()
# One intra-op thread: this model's ops are too small to gain from more, and on a shared CPU a second thread
# waiting for a busy core stalls every op.
torch.set_num_threads(1)
print(
    f"torch {torch.__version__} | diffusers {diffusers.__version__} | peft {peft.__version__} | "
    f"{torch.get_num_threads()} CPU thread"
)

# Helpers. Their names stay clear of the recipe's (it defines pipe, lora, name, PROMPT, ...), which runs next.
RESULTS = []  # every number the recap shows and notebooks/figures/results.json holds


def record(key, label, value):
    RESULTS.append({"key": key, "label": label, "value": value})


def r2(x):  # ms and s as recorded: 2 decimals below 10, else 1
    return round(float(x), 2 if abs(x) < 10 else 1)


def ms_since(t0):
    return (time.perf_counter() - t0) * 1e3


def short(e):  # first line of an exception, trimmed
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"


def mean_diff(a, b):  # mean absolute pixel difference, in levels of 255
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


NOTICE = re.compile("No LoRA keys associated to")  # diffusers, for every LoRA file without text-encoder keys
SITE_PACKAGES = re.compile(r"/\S*?/site-packages/")


@contextlib.contextmanager
def logged(limit=240, loggers=("diffusers",)):
    # Collect these loggers' records and Python warnings in the block, then print each one, shortened: a failed
    # hotswap logs every key of the model in one record. Outside these blocks both go to stderr as usual.
    records, caught, saved = [], [], {}
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    for n in loggers:
        log = logging.getLogger(n)
        saved[n], log.handlers = (log.handlers, log.level), [handler]
        log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for n, (handlers, level) in saved.items():
            logging.getLogger(n).handlers = handlers
            logging.getLogger(n).setLevel(level)
        lines = [(f"logged [{r.levelname} {r.name}]", r.getMessage()) for r in records]
        lines = [(source, message) for source, message in lines if not NOTICE.match(message)]
        lines += [(f"warning [{w.category.__name__}]", str(w.message)) for w in caught]
        for source, message in lines:
            text = SITE_PACKAGES.sub("", " ".join(message.split()))  # a library's file by its package path
            more = f" … ({len(text)} characters)" if len(text) > limit else ""
            print(f"  {source}: {text[:limit]}{more}")


def show(images, titles, scale=3):
    # One row of images, upscaled with NEAREST so the 64x64 pixels stay crisp, captions underneath.
    w, h = images[0].width * scale, images[0].height * scale
    row = Image.new("RGB", (w * len(images), h + 34), "white")
    draw = ImageDraw.Draw(row)
    for i, (img, title) in enumerate(zip(images, titles, strict=True)):
        row.paste(img.resize((w, h), Image.NEAREST), (i * w, 0))
        for j, line in enumerate(str(title).split("\n")[:2]):
            draw.text((i * w + 4, h + 3 + 15 * j), line, fill="black")
    display(row)


def table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    display(Markdown("\n".join(lines)))


# %% [markdown]
# ## 2. The plain-diffusers recipe
#
# The cell after next is the README's recipe, copied from README.md when this notebook is generated, so the two
# cannot differ. It reads each LoRA once into CPU memory, loads a zero LoRA over the union of their modules at the
# highest rank, compiles the UNet with inductor (this notebook's only inductor compile), then swaps in the six LoRAs
# under `error_on_recompile`, saving one image each to `out/recipe`.

# %%
os.chdir(ROOT)  # the recipe's paths (lora_manager/presets/tiny/...) are relative to the repository root
graphs_before_recipe = counters["stats"]["unique_graphs"]
fxcache_before_recipe = {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
t_recipe = time.perf_counter()

# %% README recipe
# build_notebook.py writes README.md's "## Plain diffusers recipe" block into this cell, so the notebook runs the
# recipe as the README prints it. Here, for the linter, the names of the recipe that later cells use:
LORAS = OUT = PROMPT = SEED = SIZE = STEPS = denoiser = loras = pipe = None

# %% [markdown]
# What that cost, and one more image from the same compiled pipeline:

# %%
recipe_s = time.perf_counter() - t_recipe
recipe_graphs = counters["stats"]["unique_graphs"] - graphs_before_recipe
hits, misses = (counters["inductor"][k] - v for k, v in fxcache_before_recipe.items())
INDUCTOR_CACHE = "cold (empty)" if hits == 0 else f"warm ({hits} of {hits + misses} graphs from the cache)"
pipe.set_progress_bar_config(disable=True)
with torch._dynamo.config.patch(error_on_recompile=True):
    t0 = time.perf_counter()
    pipe(PROMPT, num_inference_steps=STEPS, height=SIZE, width=SIZE, generator=torch.Generator("cpu").manual_seed(SEED))
    recipe_image_s = time.perf_counter() - t0
print(
    f"recipe cell: {recipe_s:.1f} s for {len(LORAS)} reads, one compile ({recipe_graphs} graph, inductor cache "
    f"{INDUCTOR_CACHE}) and {len(LORAS)} images of {STEPS} steps; one more image: {recipe_image_s:.2f} s"
)
record("recipe_cell_s", "README recipe cell: 6 LoRA reads, one inductor compile, 6 images of 20 steps, s", r2(recipe_s))
record("recipe_image_s", "one more 20-step image from the recipe's compiled pipeline, s", r2(recipe_image_s))
record("recipe_graphs", "graphs the recipe compiled for its 6 LoRAs (1: no recompile)", recipe_graphs)

# %% [markdown]
# Each image must equal `LoraManager`'s (below) for the same adapter, prompt, seed, steps and size, within 2 levels
# of 255. Both use guidance 7.5, the pipeline's default and the preset's:

# %%
import inspect

RECIPE_RUN = dict(prompt=PROMPT, seed=SEED, steps=STEPS, size=SIZE)  # the recipe's settings, before we reuse names
recipe_images = {Path(f).stem: Image.open(Path(OUT) / f"{Path(f).stem}.png").convert("RGB") for f in LORAS}
del pipe, denoiser, loras  # the recipe's compiled pipeline and its LoRAs: done with them

m = LoraManager.from_preset("tiny", compile=False)
guidance = inspect.signature(StableDiffusionPipeline.__call__).parameters["guidance_scale"].default
assert m.generation_defaults["guidance_scale"] == guidance == 7.5
manager_images = {
    a: m.generate(
        RECIPE_RUN["prompt"],
        adapter=a,
        seed=RECIPE_RUN["seed"],
        steps=RECIPE_RUN["steps"],
        height=RECIPE_RUN["size"],
        width=RECIPE_RUN["size"],
    ).image
    for a in recipe_images
}
recipe_levels = {a: levels(recipe_images[a], manager_images[a]) for a in recipe_images}
show(list(recipe_images.values()), [f"{a}\nvs manager: {d}" for a, d in recipe_levels.items()])
print(
    f"prompt {RECIPE_RUN['prompt']!r}, seed {RECIPE_RUN['seed']}, {RECIPE_RUN['steps']} steps, "
    f"{RECIPE_RUN['size']}x{RECIPE_RUN['size']}; recipe vs LoraManager, levels of 255: {recipe_levels}"
)
assert max(recipe_levels.values()) <= 2
record(
    "recipe_vs_manager_levels",
    "README recipe vs LoraManager, same settings, largest difference (levels of 255)",
    max(recipe_levels.values()),
)

# %% [markdown]
# ### What `LoraManager` adds
#
# The same technique, packaged for a server: every catalog LoRA read once into CPU memory, a zero template over the
# union of their modules (text encoder included) at the largest rank, an optional compile, then swaps that are a few
# `torch._foreach_copy_` calls into the template's tensors. All checks run before the first write, so a refused LoRA
# changes nothing (section 8). Adapter and strength come with each request:

# %%
PRESET = ROOT / "lora_manager" / "presets" / "tiny"
CATALOG = json.loads((PRESET / "catalog.json").read_text())
GEN = CATALOG["generation"]  # 64x64, 10 steps, guidance 7.5
TRIGGER = {a["id"]: a["trigger"] for a in CATALOG["adapters"]}
PROMPT = "a white diamond on a green background"  # from here on, the notebook's own prompt (with a trigger word)


def prompt_for(adapter):  # the adapter's trigger word brings its style out
    return PROMPT + (f", {TRIGGER[adapter]}" if adapter else "")


def lora(name):  # from here on, a LoRA file by name
    return str(PRESET / "adapters" / f"{name}.safetensors")


pipe = DiffusionPipeline.from_pretrained(PRESET / "model", dtype=torch.float32)  # a plain, eager pipeline
pipe.set_progress_bar_config(disable=True)


def run(pipe, prompt, seed=0, **kwargs):
    return pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), **{**GEN, **kwargs}).images[0]


table(
    ["id", "rank", "alpha", "modules", "text encoder", "format"],
    [(a.id, a.rank, f"{a.alpha:g}", a.num_modules, a.has_text_encoder, a.format) for a in m.adapters()],
)
grid = {None: m.generate(PROMPT, seed=0)}
for a in m.adapters():
    grid[a.id] = m.generate(prompt_for(a.id), adapter=a.id, seed=0)
show([r.image for r in grid.values()], [f"{k or 'no LoRA'}\nswap {r.info['swap_ms']:.1f} ms" for k, r in grid.items()])

# %% [markdown]
# ## 3. The three options, measured
#
# On the UNet alone (the part that changes), with `stripes`, `dots` and `frame` (ranks 5, 12, 32), through the
# functions `pipe.load_lora_weights` calls for the UNet (`lora_manager/bench/strategies.py`). A step is one UNet call
# on a batch of 2; a request is 10 steps. This CPU is shared, so each timing is the fastest of several runs.

# %%
from lora_manager.adapters.reader import read_adapter
from lora_manager.bench import strategies as S

LOADER = StableDiffusionPipeline  # its lora_state_dict / load_lora_into_unet = load_lora_weights for the UNet
CPU = torch.device("cpu")


def fresh_unet():
    return UNet2DConditionModel.from_pretrained(PRESET / "model" / "unet", dtype=torch.float32).eval()


def bench_adapter(name, unet):
    path = Path(lora(name))
    return S.BenchAdapter(name, path, read_adapter(path, name, LOADER, {"unet": unet}, torch.float32))


def best(timing):  # fastest sample of a strategies.Timing, in ms
    return min(timing.samples_ms)


base_unet = fresh_unet()
SAME = [bench_adapter(n, base_unet) for n in ["stripes", "dots", "frame"]]
ALL = SAME + [bench_adapter(n, base_unet) for n in ["checker", "outline"]]
g = torch.Generator().manual_seed(0)
latent = GEN["height"] // pipe.vae_scale_factor
INPUTS = dict(
    sample=torch.randn(2, 4, latent, latent, generator=g),
    timestep=torch.tensor(500),
    encoder_hidden_states=torch.randn(
        2, pipe.tokenizer.model_max_length, base_unet.config.cross_attention_dim, generator=g
    ),
)
VARIANTS = {"no LoRA": (base_unet, None)}  # (UNet, its set_adapters before a forward); timed together below

# %% [markdown]
# ### Option 1: `load_lora_weights` per request

# %%
reload = S.measure_reload(fresh_unet(), SAME, LOADER, repeats=3)
print(f"delete_adapters + load_lora_weights : {best(reload.delete_load):6.1f} ms per switch")
print(f"unload_lora_weights + load          : {best(reload.unload_load):6.1f} ms per switch")
print(f"  of which reading the file          : {best(reload.read_file):6.1f} ms")
record("reload_ms", "reload per request (delete_adapters + load_lora_weights), ms", r2(best(reload.delete_load)))
record("reload_unload_ms", "reload per request (unload_lora_weights + load), ms", r2(best(reload.unload_load)))

# %% [markdown]
# ### Option 2: all resident, switched with `set_adapters`
#
# Ten LoRAs loaded (our five files, twice, under ten names). PEFT computes only the *active* adapters: all active with
# the unused at weight 0, each step computes all of them; with `set_adapters("x")`, one.

# %%
COUNTS, N = (1, 2, 5, 10), 10
u_res = fresh_unet()
RESIDENT = [f"resident{i}" for i in range(N)]
for i, adapter_name in enumerate(RESIDENT):
    S.load_file(u_res, LOADER, ALL[i % len(ALL)].path, adapter_name)


def all_active(n):  # the first n active, all but the first at weight 0
    return lambda: u_res.set_adapters(RESIDENT[:n], [1.0] + [0.0] * (n - 1))


all_on = S.timed(lambda i: all_active(N)(), 5, CPU)
one = S.timed(lambda i: u_res.set_adapters(RESIDENT[i % N]), 5, CPU)
lora_mib = sum(p.nbytes for n, p in u_res.named_parameters() if "lora_" in n) / 2**20
print(
    f"set_adapters, {N} resident: all active {best(all_on):.1f} ms | one active ('x') {best(one):.1f} ms | "
    f"LoRA tensors held: {lora_mib:.1f} MiB (on a GPU: device memory)"
)
VARIANTS.update({f"{n} active": (u_res, all_active(n)) for n in COUNTS})
VARIANTS["one active"] = (u_res, lambda: u_res.set_adapters("resident0"))
record("set_adapters_max_ms", f"set_adapters with {N} resident, all active, ms", r2(best(all_on)))
record("set_adapters_one_ms", f"set_adapters('x') with {N} resident, one active, ms", r2(best(one)))

# %% [markdown]
# **The trap under `torch.compile`**: the active set is part of the compiled graph's guards. Each new set compiles
# once, a set seen before reuses its graph, and dynamo keeps at most `torch._dynamo.config.recompile_limit` graphs per
# function: past it, every new set runs eager, with one warning. We cycle through the ten single-adapter sets on one
# block of this UNet (`down_blocks.1`: about a second per graph; the whole UNet takes over ten, section 5), compiled
# with the eager backend plus a counter of compiled-graph runs. Guards decide recompiles before any backend runs, so
# inductor would recompile at the same calls.

# %%
BLOCK = "down_blocks.1"  # resnets + cross-attention: every one of our LoRAs has layers here


def block_inputs(unet, size):  # the block's arguments in one eager UNet forward at size x size
    got, lat = {}, size // pipe.vae_scale_factor
    hook = unet.get_submodule(BLOCK).register_forward_pre_hook(lambda m, a, k: got.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        S.forward(unet, {**INPUTS, "sample": torch.randn(2, 4, lat, lat, generator=g)})
    hook.remove()
    return got


graph_runs = []


def eager_counting(gm, example_inputs):  # the "eager" backend (run the captured graph as is), counting its runs
    def compiled(*args):
        graph_runs.append(1)
        return gm(*args)

    return compiled


x64 = block_inputs(u_res, 64)
torch._dynamo.reset()
block = torch.compile(u_res.get_submodule(BLOCK), backend=eager_counting)  # a wrapper: u_res itself stays eager
rows = []
with logged(limit=330, loggers=("torch._dynamo",)):
    for i in [*range(N), 0, 9]:
        u_res.set_adapters(RESIDENT[i])
        graphs, runs = counters["stats"]["unique_graphs"], len(graph_runs)
        with torch.no_grad():
            block(*x64["a"], **x64["k"])
        rows.append(
            (
                f"set_adapters('{RESIDENT[i]}')" + (" again" if len(rows) >= N else ""),
                counters["stats"]["unique_graphs"] - graphs,
                "compiled" if len(graph_runs) > runs else "eager",
            )
        )
table(["active set", "new graphs", "this call ran"], rows)
limit = torch._dynamo.config.recompile_limit
compiled_sets = sum(r[1] for r in rows)
print(f"recompile_limit {limit}: {compiled_sets} of {N} active sets compiled; the others run eager on every call")
assert compiled_sets == limit and [r[2] for r in rows[limit:N]] == ["eager"] * (N - limit)
torch._dynamo.reset()
record(
    "recompile_limit_sets_compiled",
    f"set_adapters through {N} active sets, compiled: graphs (recompile_limit {limit}); the rest ran eager",
    compiled_sets,
)

# %% [markdown]
# ### Option 3: hotswap from CPU memory
#
# Plain diffusers' hotswap (from the file, and from a state dict cached with its config), then the manager's swap on
# the same template (every catalog LoRA's modules at rank 32). The floors are a bare `copy_` of the same bytes:

# %%
u_hot = fresh_unet()
S.prepare_hotswap(u_hot, SAME[0], LOADER, rank=32)
hot = S.measure_hotswap(u_hot, SAME, LOADER, repeats=6)

UNION = {
    module for comp, module in m.residency.slots[0].keys if comp == "unet"
}  # the manager's template modules in the UNet
u_eng = fresh_unet()
slot = S.prepare_engine(u_eng, UNION, rank=32)[0]
eng = S.measure_engine_swap(slot, [a.weights for a in SAME], repeats=12)
floor = S.measure_floors(slot, [a.weights for a in SAME], repeats=12)
VARIANTS.update({"diffusers hotswap": (u_hot, None), "LoraManager": (u_eng, None)})
print(f"diffusers hotswap from the file      : {best(hot.from_file):6.1f} ms")
print(f"diffusers hotswap from a cached dict : {best(hot.from_dict):6.1f} ms")
print(f"LoraManager swap (CPU tensors)       : {best(eng):6.2f} ms")
print(
    f"floor: copy_ tensor by tensor        : {best(floor.per_tensor):6.2f} ms | as one buffer {best(floor.flat):.2f} ms"
)
record("hotswap_file_ms", "diffusers hotswap from the file, ms", r2(best(hot.from_file)))
record("hotswap_dict_ms", "diffusers hotswap from a cached dict, ms", r2(best(hot.from_dict)))
record("swap_cycle_ranks", "ranks the swaps of options 1 and 3 cycle through", [a.rank for a in SAME])
record("engine_swap_ms", "LoraManager swap (CPU tensors), ms", r2(best(eng)))
record("floor_per_tensor_ms", "floor: copy_ tensor by tensor, ms", r2(best(floor.per_tensor)))
record("floor_flat_ms", "floor: one copy_ of the same bytes, ms", r2(best(floor.flat)))

# %% [markdown]
# ### Side by side
#
# Per request: one switch plus 10 UNet steps. All forwards are timed here, alternating, with the template at other
# target ranks (section 4):

# %%
RANKS = (8, 32, 128, 512)
for R in RANKS:  # the template at other target ranks, holding stripes (rank 5); 32 is u_eng
    if R != 32:
        u = fresh_unet()
        S.prepare_engine(u, UNION, rank=R)[0].load(SAME[0].weights, 1.0)
        VARIANTS[f"rank {R}"] = (u, None)


def forward_ms(variants, rounds=4):
    # Fastest UNet forward of each variant, timed in alternation so that other processes on this CPU hit all alike.
    samples = {k: [] for k in variants}
    for _ in range(rounds):
        for k, (unet, before) in variants.items():
            if before:
                before()  # set_adapters, not timed
            samples[k] += S.timed(lambda i, unet=unet: S.forward(unet, INPUTS), 1, CPU, warmup=0).samples_ms
    return {k: min(v) for k, v in samples.items()}


fwd = forward_ms(VARIANTS)
fwd_rank = {R: fwd["LoraManager" if R == 32 else f"rank {R}"] for R in RANKS}
fwd_active = [fwd[f"{n} active"] for n in COUNTS]
steps = GEN["num_inference_steps"]
rows = [
    ("reload per request", best(reload.delete_load), fwd["1 active"]),
    (f"{N} resident, all active (weights 1, 0, ...)", best(all_on), fwd[f"{N} active"]),
    (f"{N} resident, one active (set_adapters('x'))", best(one), fwd["one active"]),
    ("diffusers hotswap (file)", best(hot.from_file), fwd["diffusers hotswap"]),
    ("LoraManager (CPU cache)", best(eng), fwd["LoraManager"]),
]
table(
    ["option", "switch (ms)", "UNet forward (ms)", f"switch + {steps} steps (ms)"],
    [(n, f"{s:.1f}", f"{f:.1f}", f"{s + steps * f:.0f}") for n, s, f in rows],
)
print(f"UNet forward without LoRA: {fwd['no LoRA']:.1f} ms")

fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(COUNTS, fwd_active, "o-", label=f"plain diffusers, {N} resident: n active, unused at weight 0")
ax.axhline(fwd["one active"], color="tab:orange", ls="-.", label=f"plain diffusers, {N} resident: one active")
ax.axhline(fwd["LoraManager"], color="tab:green", ls="--", label="LoraManager: one template, any number cached")
ax.axhline(fwd["no LoRA"], color="gray", ls=":", label="base UNet, no LoRA")
ax.set(
    xlabel="LoRAs active (n)",
    ylabel="UNet forward (ms)",
    ylim=(0, None),
    xticks=COUNTS,
    title="Active LoRAs are computed, even at weight 0",
)
ax.legend(fontsize=8, loc="upper left")
fig.tight_layout()
plt.show()
record("fwd_base_ms", "UNet forward without LoRA, ms", r2(fwd["no LoRA"]))
record("resident_counts", f"LoRAs active (n, of {N} resident)", list(COUNTS))
record("resident_max", "LoRAs resident", N)
record("fwd_resident_ms", "UNet forward with n active (unused at weight 0), ms", [r2(x) for x in fwd_active])
record("fwd_resident_all_active_ms", f"UNet forward with {N} resident, all active, ms", r2(fwd[f"{N} active"]))
record("fwd_resident_one_active_ms", f"UNet forward with {N} resident, one active, ms", r2(fwd["one active"]))
record("template_rank", "the manager's target_rank here", 32)
record("fwd_template_ms", "UNet forward with the manager's template (rank 32), ms", r2(fwd["LoraManager"]))

# %% [markdown]
# Reloading pays for new LoRA modules on every request; all active pays for every resident LoRA in every step; one
# active holds all of them in memory and, compiled, meets the limit above. Plain hotswap resolves every key by name on
# each call; the manager pairs each cached LoRA with the template's tensors once, so its swap is near the floor. Its
# forward pays the template's LoRA branch at its rank whatever the template holds, even nothing; LoRAs waiting in the
# CPU cache cost nothing.
#
# ## 4. What `enable_lora_hotswap` prepares
#
# One layer after a normal load, after a hotswap without preparation, and with `enable_lora_hotswap(target_rank=32)`:

# %%
PROBE = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"


def describe(unet, label):
    layer = unet.get_submodule(PROBE)
    A, B, s = layer.lora_A[S.NAME].weight, layer.lora_B[S.NAME].weight, layer.scaling[S.NAME]
    print(
        f"{label:<34} lora_A {str(tuple(A.shape)):<9} lora_B {str(tuple(B.shape)):<9} scaling {s!r:<16} "
        f"A at {A.data_ptr():#x}"
    )


u = fresh_unet()
S.load_file(u, LOADER, Path(lora("stripes")), S.NAME)  # rank 5, alpha 5
describe(u, "stripes, normal load")
S.load_file(u, LOADER, Path(lora("dots")), S.NAME, hotswap=True)  # rank 12, alpha 16
describe(u, "dots hotswapped, NOT prepared")

u = fresh_unet()
u.enable_lora_hotswap(target_rank=32)
S.load_file(u, LOADER, Path(lora("stripes")), S.NAME)
describe(u, "stripes, prepared (target_rank=32)")
S.load_file(u, LOADER, Path(lora("dots")), S.NAME, hotswap=True)
describe(u, "dots hotswapped, prepared")

# %% [markdown]
# Unprepared, the swap *replaced* the tensors (new shape and storage) and the scaling is a Python float:
# `torch.compile` guards on both. Prepared, shape and storage stay, the extra rows are zeros, and the scaling is a
# 0-dim tensor changed in place. The cost of a larger `target_rank`: every step computes the padded rank. The same
# rank-5 LoRA in templates of four ranks:

# %%
print(f"no LoRA          : UNet forward {fwd['no LoRA']:6.1f} ms")
for R in RANKS:
    unet = u_eng if R == 32 else VARIANTS[f"rank {R}"][0]
    mib = sum(p.nbytes for n, p in unet.named_parameters() if "lora_" in n) / 2**20
    print(f"target_rank {R:4d}: UNet forward {fwd_rank[R]:6.1f} ms | LoRA tensors {mib:5.1f} MiB")
    if R != 32:
        record(f"fwd_rank{R}_ms", f"UNet forward with the template at target_rank {R}, ms", r2(fwd_rank[R]))
del VARIANTS, u_eng, u_hot, slot, u

# %% [markdown]
# On this tiny UNet (layers 32 to 128 wide) small ranks read alike; on a real model memory and FLOPs grow linearly with
# `R` (deep dive A). Pick the largest rank you serve (the manager's default); a LoRA above it needs a restart (8.3).
#
# ## 5. `torch.compile`: compile once, swap without recompiling
#
# `compile=True` runs the order: enable, template, `unet.compile()`, a warm-up generation. `slots=2` adds a second
# template, so one request can combine two LoRAs. We pass the eager backend (and no precompiled bundle): dynamo traces
# and guards as for inductor, so the graph counts are inductor's, at seconds per graph. `fuse=False` keeps the LoRA
# branch in every call, as diffusers runs it (by default a one-adapter call runs merged into the weights). Swapping
# through every LoRA:

# %%
mc = LoraManager.from_preset(
    "tiny", compile=True, slots=2, compile_kwargs={"backend": "eager"}, compile_bundle=False, fuse=False
)
print(f"warm-up (dynamo's trace, eager backend): {mc.compile_s:.1f} s | {mc.compile_source}")
rows = []
for a in ["stripes", "outline", "dots", "pixel", "checker", "frame"]:
    r = mc.generate(prompt_for(a), adapter=a, seed=0)
    info = mc.info(a)
    rows.append(
        (
            a,
            info.rank,
            f"{info.alpha:g}",
            f"{r.info['swap_ms']:.1f}",
            r.info["recompiles"],
            levels(r.image, grid[a].image),
        )
    )
table(["adapter", "rank", "alpha", "swap ms", "recompiles", "vs eager (levels)"], rows)
assert mc.stats()["recompiles"] == 0
print(f"recompiles after {mc.stats()['swaps']} swaps: {mc.stats()['recompiles']}")
swapped = [mc.info(a) for a, *_ in rows]
record("compiled_swaps", "swaps on the compiled engine (dynamo, eager backend)", mc.stats()["swaps"])
record(
    "compiled_swap_range",
    "ranks and alphas those swaps went through",
    f"ranks {min(i.rank for i in swapped)}–{max(i.rank for i in swapped)}, "
    f"alphas {min(i.alpha for i in swapped):g}–{max(i.alpha for i in swapped):g}",
)
record("recompiles_after_swaps", "recompiles after those swaps", mc.stats()["recompiles"])

# %% [markdown]
# **Two LoRAs, each at its own strength**: `adapter=[("stripes", 0.8), ("outline", 1.0)]` puts each in its own slot
# (`strength=` does the same for one). The reference is plain diffusers, both loaded and combined by `set_adapters`:

# %%
mix = [("stripes", 0.8), ("outline", 1.0)]
mix_prompt = prompt_for("stripes") + ", " + TRIGGER["outline"]
r = mc.generate(mix_prompt, adapter=mix, seed=0)
pipe.unload_lora_weights()
with logged():  # a second adapter name: PEFT warns, with every key it did not find
    pipe.load_lora_weights(lora("stripes"), adapter_name="a")
    pipe.load_lora_weights(lora("outline"), adapter_name="b")
pipe.set_adapters(["a", "b"], [0.8, 1.0])
reference = run(pipe, mix_prompt)
pipe.unload_lora_weights()
show([r.image, reference], ["LoraManager\nboth, 2 slots", "diffusers\nset_adapters"])
print(
    f"LoraManager vs diffusers set_adapters: {levels(r.image, reference)} levels | swap {r.info['swap_ms']:.1f} ms | "
    f"recompiles {mc.stats()['recompiles']}"
)
assert levels(r.image, reference) <= 1 and mc.stats()["recompiles"] == 0
record(
    "two_loras_levels", "two LoRAs in one request vs diffusers set_adapters, levels of 255", levels(r.image, reference)
)

# %% [markdown]
# **The counterfactual**: option 2 on the same compiled UNet, one more LoRA under a *new* adapter name, switched to
# with `set_adapters`:

# %%
graphs0 = counters["stats"]["unique_graphs"]
mc.pipe.load_lora_weights(lora("checker"), adapter_name="extra")  # a second adapter name
mc.pipe.set_adapters(["extra"])
t0 = time.perf_counter()
run(mc.pipe, prompt_for("checker"))
first = time.perf_counter() - t0
new_graphs = counters["stats"]["unique_graphs"] - graphs0
print(f"new graphs: {new_graphs} | first call {first:.1f} s (dynamo's trace; inductor would also compile kernels)")
assert new_graphs == 1
record("recompile_new_name_graphs", "new graphs after a new adapter name + set_adapters", new_graphs)
del mc  # its pipeline now holds two adapters: this engine is spoiled, never touch a manager's pipe like this

# %% [markdown]
# So the manager's UNet is never recompiled by a swap, while a new adapter name is a new graph; with inductor each new
# graph also compiles its kernels (section 2 shows what that costs). A new image size is a new graph too, compiled
# once (deep dive B): warm up the sizes you serve.
#
# ## 6. Concurrent requests, each with its own adapter
#
# A *global* switch (`set_adapters`, or a hotswap when a request arrives) changes the adapter under requests in
# flight. In `LoraManager` adapter and strength travel **with the request**: `generate` (or `submit`, which returns a
# `Future`) queues it, and one worker runs one generation at a time and swaps only between them, preferring requests
# for the live adapter. The grid's seven requests, shuffled, from 8 threads at once:

# %%
jobs = list(grid)
random.Random(0).shuffle(jobs)
changes0 = m.stats()["adapter_changes"]
t0 = time.perf_counter()
with ThreadPoolExecutor(max_workers=8) as pool:
    futures = [pool.submit(m.generate, prompt_for(a), adapter=a, seed=0) for a in jobs]
    results = [f.result() for f in futures]
wall = time.perf_counter() - t0
same = [np.array_equal(np.asarray(r.image), np.asarray(grid[a].image)) for a, r in zip(jobs, results, strict=True)]
print(
    "in submission order:",
    ", ".join(f"{a or 'no LoRA'} {'✓' if ok else '✗'}" for a, ok in zip(jobs, same, strict=True)),
)
assert all(same)
print(
    f"{len(jobs)} concurrent requests over {len(set(jobs))} adapters in {wall:.1f} s: all bit-identical to their "
    f"solo references; {m.stats()['adapter_changes'] - changes0} swaps"
)
record("concurrent_identical", "concurrent requests bit-identical to solo", f"{sum(same)}/{len(same)}")

# %% [markdown]
# `max_batch=4` runs up to 4 queued requests in one pipeline call, mixed adapters included, each row with its own
# LoRA and strength (`tests/test_mixed_batches.py`). `python -m lora_manager loadtest` measures throughput under
# concurrent load against plain diffusers; it takes minutes, so it is not run here.
#
# ## 7. Moving to a GPU Space
#
# The same code runs on a GPU; the preset is the switch: `python app.py --preset sdxl --compile` (or your own
# catalog `.json`). Not measured here:
#
# - **CPU cache to GPU**: on CUDA the cache sits in pinned host memory; a swap is one
#   `torch._foreach_copy_(..., non_blocking=True)`, then a synchronize.
# - **Compile** is on by default on CUDA, at start-up, so no request pays for it; `stats()["recompiles"]` should stay
#   0, and `torch._dynamo.config.patch(error_on_recompile=True)` makes a recompile fail a test.
# - **Sizes**: warm up each resolution you serve at start-up.
# - **ZeroGPU** has no `torch.compile`: the app runs eager there, or from an AOTInductor package
#   (`python -m lora_manager aot-package`, README).

# %% [markdown]
# ## 8. Pitfalls of plain hotswap, reproduced, then handled
#
# Each demo resets the plain pipeline and loads a first LoRA the documented way. Where diffusers logs something, the
# cell prints its log lines, shortened (a failed hotswap logs every key of the model). The "No LoRA keys associated
# to CLIPTextModel" line that diffusers logs for each UNet-only LoRA is harmless.


# %%
def probe():  # the section-4 layer in the plain pipeline, as it is now
    return pipe.unet.get_submodule(PROBE)


CONV_PROBE = "down_blocks.1.resnets.0.conv1"  # a conv layer every catalog LoRA targets (outline: only conv layers)


def fresh_hotswap(first):
    pipe.unload_lora_weights()
    pipe.enable_lora_hotswap(target_rank=32)
    pipe.load_lora_weights(lora(first), adapter_name="style")


factory_pipe = StableDiffusionPipeline.from_pretrained(PRESET / "model", dtype=torch.float32)
scratch = tempfile.TemporaryDirectory()  # LoRA files written for the demos; removed when the kernel exits
workdir = Path(scratch.name)
from lora_manager.testing import (
    same_slots,
    snapshot,
    write_adapter,
)  # LoRA files with chosen rank and targets; slot copies

# %% [markdown]
# ### 8.1 A failed hotswap deletes the live adapter
#
# `outline` targets the conv layers only; `stripes` also targets attention and feed-forward layers. Hotswapping
# `stripes` into `outline`'s slot fails; diffusers' error handler logs the error, *deletes* the live adapter and
# re-raises: the pipeline then serves the base model, and every later hotswap fails.

# %%
fresh_hotswap("outline")
before = run(pipe, prompt_for("outline"))
with logged():
    try:
        pipe.load_lora_weights(lora("stripes"), adapter_name="style", hotswap=True)
    except Exception as e:
        print("raised:", short(e)[:110], "...")
after = run(pipe, prompt_for("outline"))
print("adapters left:", pipe.get_list_adapters())
print(f"image after the failure vs the base model: {levels(after, m.generate(prompt_for('outline')).image)} levels")
with logged():
    try:
        pipe.load_lora_weights(lora("outline"), adapter_name="style", hotswap=True)
    except Exception as e:
        print("and the next hotswap raised:", short(e)[:110], "...")
show([before, after], ["outline, live", "after the failed\nhotswap: no LoRA"])

# %% [markdown]
# **The manager** checks every LoRA against the template when it is registered, before it could ever be swapped
# in. Here a LoRA on `time_emb_proj`, a layer no catalog LoRA targets:

# %%
odd = write_adapter(factory_pipe, workdir / "time_emb.safetensors", rank=8, alpha=8, suffixes=("time_emb_proj",))
live_before = m.generate(prompt_for("frame"), adapter="frame").image
before = snapshot(m.residency.slots)
try:
    m.register("time_emb", str(odd))
except LoraManagerError as e:
    print(short(e)[:240], "...")
same_tensors = same_slots(before, snapshot(m.residency.slots))
same_image = np.array_equal(np.asarray(live_before), np.asarray(m.generate(prompt_for("frame"), adapter="frame").image))
print(f"live tensors unchanged: {same_tensors} | live output bit-identical: {same_image}")
assert same_tensors and same_image

# %% [markdown]
# ### 8.2 LoRAs that target more layers: the template covers the union
#
# In plain diffusers the *first* LoRA fixes the target modules, which is why 8.1 failed. The manager's first load is
# the zero template over the union of all catalog LoRAs' modules, so a conv-only LoRA and an
# attention+feed-forward+conv LoRA follow each other in any order. Modules the new LoRA does not use are zeroed:

# %%
FF = ("unet", "down_blocks.1.attentions.0.transformer_blocks.0.ff.net.2")  # targeted by stripes, not by outline
for a in ["stripes", "outline", "stripes"]:
    r = m.generate(prompt_for(a), adapter=a, seed=0)
    print(
        f"{a:<8} swap {r.info['swap_ms']:4.1f} ms | vs its first image: {levels(r.image, grid[a].image)} levels | "
        f"feed-forward LoRA |B|max = {m.residency.slots[0].modules[FF].B.abs().max().item():.3f}"
    )

# %% [markdown]
# ### 8.3 A rank above `target_rank` raises nothing and can corrupt a CPU cache
#
# PEFT falls back to swapping whole tensors: the model gets new shapes (which a compiled model recompiles for, as for
# any new rank: deep dive B). PEFT first copies the new tensor to the device of the model's old one; when both are on
# the CPU, as here, the model's *old* tensors end up in the state dict you passed, which you may be keeping as your
# CPU cache. With the model on a GPU and the cache on the CPU, the cached tensors are left alone.

# %%
pipe.unload_lora_weights()
pipe.enable_lora_hotswap(target_rank=16)
pipe.load_lora_weights(lora("dots"), adapter_name="style")  # rank 12
cached_frame = StableDiffusionPipeline.lora_state_dict(lora("frame"))[0]  # rank 32, kept in CPU memory
key = f"unet.{PROBE}.lora_A.weight"
print("cached frame lora_A before:", tuple(cached_frame[key].shape))
with logged():
    pipe.load_lora_weights(cached_frame, adapter_name="style", hotswap=True)  # no error
print("cached frame lora_A after :", tuple(cached_frame[key].shape), "<- now holds dots' old tensor (model on the CPU)")
print("model lora_A              :", tuple(probe().lora_A["style"].weight.shape), "<- new shape")

# %% [markdown]
# The manager refuses it up front, with the numbers and the fix:

# %%
big = write_adapter(factory_pipe, workdir / "rank64.safetensors", rank=64, alpha=64)
try:
    m.register("rank64", str(big))
except LoraManagerError as e:
    print(short(e))

# %% [markdown]
# ### 8.4 Text-encoder LoRAs
#
# `pipe.enable_lora_hotswap` prepares only the UNet/transformer, and `load_lora_weights(..., hotswap=True)` refuses
# text-encoder weights, *after* it has swapped the UNet part: the pipeline is left half-swapped.

# %%
fresh_hotswap("stripes")  # scaling alpha/rank = 5/5 = 1
with logged():
    try:
        pipe.load_lora_weights(lora("pixel"), adapter_name="style", hotswap=True)
    except ValueError as e:
        print("raised:", short(e))
print(
    f"UNet scaling is now pixel's 16/8: {float(probe().scaling['style'])} | adapters: {pipe.get_list_adapters()} "
    "<- UNet swapped, text encoder not"
)

# %% [markdown]
# The manager's template spans the text encoder too (the `pixel` LoRA is in the union), so it swaps both. Its image
# equals a plain, non-hotswap load of `pixel`:

# %%
pipe.unload_lora_weights()
pipe.load_lora_weights(lora("pixel"), adapter_name="ref")  # normal load, UNet + text encoder
print(
    f"LoraManager 'pixel' vs a normal load of it: {levels(grid['pixel'].image, run(pipe, prompt_for('pixel')))} levels"
)

# %% [markdown]
# ### 8.5 `set_adapters` after a hotswap uses a stale alpha
#
# After a hotswap, PEFT's per-layer `r` and `lora_alpha` still hold the *first* LoRA's values. `set_adapters`
# recomputes the scaling from them, as a Python float again (under `torch.compile`, a recompile: deep dive B):

# %%
fresh_hotswap("stripes")  # rank 5, alpha 5
pipe.load_lora_weights(lora("dots"), adapter_name="style", hotswap=True)  # rank 12, alpha 16 -> 1.333
print(f"after the hotswap       : scaling {probe().scaling['style']!r}")
pipe.set_adapters(["style"], [1.0])  # "full strength"
print(f"after set_adapters(1.0) : scaling {probe().scaling['style']!r} <- stripes' 5/5, should be 16/12")

# %% [markdown]
# The manager takes the strength with the request and computes alpha / rank × strength from the LoRA it swapped in.
# Strength 0, 0.5 and 1 of `outline`; what is measured is the mean absolute pixel difference from the strength-0
# image (same prompt and seed), in levels of 255, and the scaling a conv layer it targets holds:

# %%
strengths = (0.0, 0.5, 1.0)
info = m.info("outline")
imgs, scalings = [], []
for s in strengths:
    imgs.append(m.generate(prompt_for("outline"), adapter="outline", strength=s).image)
    scalings.append(m.residency.slots[0].modules[("unet", CONV_PROBE)].scaling.item())
diffs = [mean_diff(img, imgs[0]) for img in imgs]
for s, sc, d in zip(strengths, scalings, diffs, strict=True):
    print(
        f"strength {s}: scaling {sc:.3f} ({info.alpha:g}/{info.rank} x {s}) | mean difference from strength 0: "
        f"{d:5.1f} levels"
    )
show(imgs, [f"outline, strength {s}\nvs strength 0: {d:.1f}" for s, d in zip(strengths, diffs, strict=True)])
assert np.allclose(scalings, [info.alpha / info.rank * s for s in strengths]) and diffs[2] > 0
record(
    "strength_diff",
    "outline at strength 0 / 0.5 / 1: mean pixel difference from strength 0, levels of 255",
    [round(d, 1) for d in diffs],
)

# %% [markdown]
# ### 8.6 A LoRA cached as a state dict loses its alpha
#
# The natural way to "keep LoRAs in CPU memory" is to keep their state dicts. But `load_lora_weights(dict)` reads no
# metadata, so on SD pipelines the LoRA's alpha is gone and its scaling falls back to 1.0 (the recipe in section 2
# reads each file with `load_lora_weights` and keeps the scaling folded into B):

# %%
pipe.unload_lora_weights()
cached_outline = StableDiffusionPipeline.lora_state_dict(lora("outline"))[0]  # rank 16, alpha 8 in the file
pipe.load_lora_weights(lora("outline"), adapter_name="from_file")
with logged():
    pipe.load_lora_weights(cached_outline, adapter_name="from_dict")
conv = pipe.unet.get_submodule(CONV_PROBE)
print(
    f"scaling from the file: {float(conv.scaling['from_file'])} | "
    f"from the cached dict: {float(conv.scaling['from_dict'])} <- alpha lost"
)

# %% [markdown]
# The manager reads each file once, metadata included, and keeps alpha with the tensors: its `outline` scaling in
# 8.5 was 8/16.
#
# ### 8.7 Strength with `cross_attention_kwargs={"scale": s}` after a hotswap
#
# The pipeline's own strength knob multiplies every active LoRA's scaling for one call and divides it back afterwards.
# After a hotswap, `scale=0` does not divide: it *resets* the scaling from PEFT's stored `lora_alpha / r`, the first
# LoRA's (as in 8.5), and as a Python float:

# %%
fresh_hotswap("stripes")  # rank 5, alpha 5: 1.0
pipe.load_lora_weights(lora("checker"), adapter_name="style", hotswap=True)  # rank 4, alpha 8: 2.0
print(f"after the hotswap         : scaling {probe().scaling['style']!r}")
for s in (0.5, 0.0):
    run(pipe, prompt_for("checker"), cross_attention_kwargs={"scale": s})
    print(f"after a call at scale {s}: scaling {probe().scaling['style']!r}")

# %% [markdown]
# So with plain diffusers, per-request strength after a hotswap is safe at non-zero scales only, and a strength of 0
# silently replaces the swapped LoRA's alpha with the first one's. The manager's `strength=` writes the scaling tensor
# in place (8.5).

# %% [markdown]
# ## Deep dive A: what padding to `target_rank` costs on real models
#
# Every hotswap slot holds `lora_A` (R × in) and `lora_B` (out × R) for every targeted layer, at rank R whatever the
# LoRA's own rank. We build SD 1.5's UNet, SDXL's UNet and Flux.1-dev's transformer on the `meta` device (shapes only,
# no memory, no download) from their published configs, written out below, and sum those bytes in bf16/fp16
# (2 bytes a value). Row "attention": `to_q`, `to_k`, `to_v`, `to_out.0`; row "+ ff / proj": also the
# feed-forward, `proj_in`/`proj_out`, and Flux's `add_*_proj`, `to_add_out`, `ff_context` and `proj_mlp`.

# %%
from diffusers import FluxTransformer2DModel

from lora_manager.bench.bench import SDXL_UNET  # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json

# runwayml/stable-diffusion-v1-5 unet/config.json: diffusers' UNet2DConditionModel defaults plus these two
SD15_UNET = {"sample_size": 64, "cross_attention_dim": 768}
# black-forest-labs/FLUX.1-dev transformer/config.json: FluxTransformer2DModel's defaults (19 double blocks,
# 38 single blocks, 24 heads x 128 = 3072 wide, joint_attention_dim 4096) plus guidance_embeds
FLUX_DEV = {"guidance_embeds": True}
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
WIDER = ATTENTION + (
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_in",
    "proj_out",
    "proj_mlp",
)


def targets(model, suffixes):  # (inputs, outputs) of each targeted Linear, or Conv2d (inputs x kernel)
    return [
        (layer.in_features, layer.out_features)
        if isinstance(layer, torch.nn.Linear)
        else (layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1], layer.out_channels)
        for n, layer in model.named_modules()
        if n.endswith(suffixes) and isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d))
    ]


with torch.device("meta"):
    MODELS = {
        "SD 1.5 UNet": UNet2DConditionModel(**SD15_UNET),
        "SDXL UNet": UNet2DConditionModel(**SDXL_UNET),
        "Flux.1-dev transformer": FluxTransformer2DModel(**FLUX_DEV),
    }
rows = []
for name, model in MODELS.items():
    params = sum(p.numel() for p in model.parameters()) / 1e9
    for label, suffixes in (("attention", ATTENTION), ("+ ff / proj", WIDER)):
        t = targets(model, suffixes)
        mib = [sum(R * (i + o) for i, o in t) * 2 / 2**20 for R in (16, 64, 128)]
        extra = 64 * sum(i + o for i, o in t) / sum(i * o for i, o in t)  # LoRA FLOPs / the layers' own, rank 64
        rows.append((f"{name} ({params:.2f} B)", label, len(t), *(f"{x:.0f}" for x in mib), f"{extra:.0%}"))
table(
    ["model (parameters)", "targets", "layers", "MiB/slot R=16", "R=64", "R=128", "extra FLOPs in those layers, R=64"],
    rows,
)
del MODELS

# %% [markdown]
# The parameter counts (0.86 B, 2.57 B, 11.9 B) are those of the published models, a check that the configs are
# right. The manager's CPU cache holds each LoRA at its own rank; the padding costs are per **slot** on the device
# (`slots=2` doubles them), and compute: every step multiplies the padded zeros too.
#
# **Rule of thumb for `target_rank`:** the largest rank among the LoRAs you will serve, not more: memory per slot and
# the LoRA's FLOPs grow linearly with it (table above). If one LoRA's rank is far above the rest, weigh serving it
# on its own engine against padding every request to its rank. A LoRA above `target_rank` is refused by the manager
# (8.3) and needs a restart with a larger one.
#
# ## Deep dive B: which changes recompile, counted
#
# Each row is a change made after a first compiled call, and the new graphs it caused (`torch._dynamo`'s
# `unique_graphs` counter). As in section 3, the compiled function is one block of the UNet (`down_blocks.1`: its
# resnets and cross-attention, where every LoRA here has layers), with the eager backend: dynamo's guards decide
# recompiles before any backend runs, so these are inductor's recompiles too, at a second per graph.


# %%
def graphs_after(unet, change, x=None):
    change()
    x = x or x64
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        compiled_block(*x["a"], **x["k"])
    return counters["stats"]["unique_graphs"] - before


def compile_block(unet):
    global compiled_block
    torch._dynamo.reset()
    compiled_block = torch.compile(unet.get_submodule(BLOCK), backend="eager")
    return graphs_after(unet, lambda: None)  # the first compiled call


counts = []
sd, _, meta = LOADER.lora_state_dict(lora("stripes"), return_lora_metadata=True)
u = fresh_unet()  # no enable_lora_hotswap
S.load_file(u, LOADER, Path(lora("stripes")), "style")  # rank 5, alpha 5
compile_block(u)
counts.append(
    (
        "no enable_lora_hotswap: hotswap the same LoRA with alpha 10 (rank 5)",
        graphs_after(
            u,
            lambda: u.load_lora_adapter(
                sd, prefix="unet", metadata={**meta, "unet.lora_alpha": 10}, adapter_name="style", hotswap=True
            ),
        ),
    )
)
counts.append(
    (
        "  ... then hotswap dots (rank 12, alpha 16)",
        graphs_after(u, lambda: S.load_file(u, LOADER, Path(lora("dots")), "style", hotswap=True)),
    )
)

u = fresh_unet()  # enable_lora_hotswap(target_rank=32)
u.enable_lora_hotswap(target_rank=32)
S.load_file(u, LOADER, Path(lora("stripes")), "style")
x48, x56 = block_inputs(u, 48), block_inputs(u, 56)  # captured before this block is compiled
compile_block(u)
counts.append(
    (
        "enable_lora_hotswap(32): hotswap dots (rank 12, alpha 16)",
        graphs_after(u, lambda: S.load_file(u, LOADER, Path(lora("dots")), "style", hotswap=True)),
    )
)
counts.append(
    (
        "  ... then hotswap frame (rank 32, alpha 32)",
        graphs_after(u, lambda: S.load_file(u, LOADER, Path(lora("frame")), "style", hotswap=True)),
    )
)
counts.append(
    ("  ... then set_adapters(['style'], [1.0]) (8.5)", graphs_after(u, lambda: u.set_adapters(["style"], [1.0])))
)
counts.append((f"image size {GEN['height']}x{GEN['width']} -> 48x48", graphs_after(u, lambda: None, x48)))
counts.append(("  ... 48x48 again", graphs_after(u, lambda: None, x48)))
counts.append(("  ... then 56x56", graphs_after(u, lambda: None, x56)))
torch._dynamo.reset()
table(["change after the first compiled call", "new graphs (recompiles)"], counts)
record("recompiles_alpha_unprepared", "no enable_lora_hotswap: recompiles on an alpha change", counts[0][1])
record("recompiles_rank_unprepared", "no enable_lora_hotswap: recompiles on a rank change", counts[1][1])
record(
    "recompiles_hotswap_prepared",
    "enable_lora_hotswap: recompiles over two hotswaps (new ranks and alphas)",
    counts[2][1] + counts[3][1],
)
record("recompiles_set_adapters_after_hotswap", "set_adapters after a hotswap: recompiles", counts[4][1])
record("recompiles_new_resolution", "recompiles at a new image size (64x64 -> 48x48)", counts[5][1])
assert [c for _, c in counts[:7]] == [1, 1, 0, 0, 1, 1, 0], counts  # what the text says

# %% [markdown]
# With `enable_lora_hotswap` the alpha is a tensor and the rank is padded, so hotswaps change values in place; without
# it, a new alpha (a Python float) or a new rank (new shapes) recompiles, and so does `set_adapters` after a hotswap,
# which turns the scaling back into a float. A new image size recompiles
# once; dynamo then treats the size as dynamic, and the last row shows whether another size needed a graph here. The
# whole UNet's forward also branches on whether the latent size divides by its upsampling factor, so a size on the
# other side of that check can need one more graph. Compile at start-up with a warm-up per size you serve.
#
# ## Recap
#
# The numbers this run measured (the README quotes them from `notebooks/figures/results.json`, which this cell writes;
# `python notebooks/fill_readme.py` refreshes the README after a new run):

# %%
import importlib.util

spec = importlib.util.spec_from_file_location("fill_readme", ROOT / "notebooks" / "fill_readme.py")
fill_readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fill_readme)
DATA = {
    "run": {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "peft": peft.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "inductor_cache": INDUCTOR_CACHE,
        "notebook_s": round(time.perf_counter() - T_START),
    },
    "results": RESULTS,
}
out = Path(os.environ.get("LORA_TUTORIAL_RESULTS", ROOT / "notebooks" / "figures" / "results.json"))
out.write_text(json.dumps(DATA, indent=1) + "\n")
display(Markdown(fill_readme.results_table(DATA)))
print(f"notebook ran in {DATA['run']['notebook_s']} s")

# %% [markdown]
# - **Which method?** `enable_lora_hotswap(target_rank=R)`, before the first load; then load → compile → hotswap
#   under the same adapter name. Section 2 runs the README's complete recipe: a CPU cache, a template over the union of
#   modules, one compile, no recompile over six LoRAs.
# - **Reload per request** pays for module creation every time; **all resident** holds every LoRA in device memory,
#   computes every *active* one each step, and under `torch.compile` compiles each new active set once, until
#   `recompile_limit` leaves new sets eager; **hotswap** keeps one LoRA's worth of compute and switches in place.
# - **For a server**, hold the LoRAs in CPU memory as tensors, prepare one template over the union of their targets
#   at the largest rank, check each LoRA before touching the model, and swap only between generations:
#   that is what `LoraManager` does.
