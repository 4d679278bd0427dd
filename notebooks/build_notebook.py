"""Write lora_hotswap_tutorial.ipynb from the cells below (outputs are added by executing it).

    python notebooks/build_notebook.py                       # cells only, no outputs
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) jupyter nbconvert --to notebook --execute --inplace \
        notebooks/lora_hotswap_tutorial.ipynb                 # run it (cold inductor cache, as a reader's first run)
    python notebooks/fill_readme.py                          # README's generated blocks from the run's results.json
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

OUT = Path(__file__).with_name("lora_hotswap_tutorial.ipynb")


def md(text: str):
    return new_markdown_cell(text.strip())


def code(text: str):
    return new_code_cell(text.strip())


CELLS = [
    # ---- 1. the answer --------------------------------------------------------------------------------------------
    md(r"""
# Many LoRAs, one per request: hotswap without reloading or recompiling

> *"I have ~10 LoRAs and pick one per request. The `hotswap` docs say that if the adapters have different ranks
> and/or alphas, I need to call an additional method before loading. Which method?"*

**The method is `enable_lora_hotswap(target_rank=R)`**, with `R` the highest rank of any LoRA you will ever load.
Call it *before the first* `load_lora_weights`, and keep this order:

```python
pipe.enable_lora_hotswap(target_rank=64)                   # 1. before any LoRA is loaded
pipe.load_lora_weights(first_lora, adapter_name="style")   # 2. first load: padded to rank 64
pipe.unet.compile()                                        # 3. compile once (optional)
pipe.load_lora_weights(next_lora, adapter_name="style",    # 4. every later LoRA: same name,
                       hotswap=True)                       #    weights copied in place
```

What it does: it pads every `lora_A`/`lora_B` to rank `R` and turns each `scaling` (alpha / rank) from a Python
float into a tensor. A LoRA of another rank or alpha then only changes *values*, never shapes or constants.

**When you need it**

| your setup | need `enable_lora_hotswap`? |
|---|---|
| `torch.compile` and LoRAs with different ranks or alphas | **yes**: without it, a new alpha recompiles (deep dive B) and a new rank replaces the tensors with new shapes (section 4) |
| `torch.compile`, all LoRAs the same rank and alpha | not strictly, but it costs nothing and keeps you safe |
| eager (no compile) | optional: hotswap works without it (tensors are replaced instead of overwritten) |

It only reaches the UNet/transformer: **text-encoder LoRAs cannot be hotswapped** by diffusers (section 6).

**The rest of the question, in short**

- *Keep LoRAs in CPU memory and move one to the GPU on demand?* Keep each LoRA's state dict **and its metadata**
  (the alpha) in a dict, and hotswap from it: section 2 has the recipe in plain diffusers, about 15 lines.
- *Reload per request, or all resident with `set_adapters`?* Reloading recreates the LoRA modules on every request.
  All resident costs device memory for every LoRA, and compute for every *active* one: with all active and the
  unused at weight 0 each step computes all of them; with only the requested one active (`set_adapters("x")`)
  it computes one. Under `torch.compile`, changing the active set recompiles (section 3, deep dive B).
- *Concurrent requests with different LoRAs?* Keep the adapter with the request, and swap only between
  generations, never under one in flight (section 7).

Every number below is measured by the run itself, on a tiny embedded model (CPU, offline, a few minutes). The
committed outputs come from a run with a cold inductor cache (`TORCHINDUCTOR_CACHE_DIR` pointed at an empty folder),
so their compile times are what a first run on a fresh machine pays:

- **2.** the plain-diffusers recipe, then what `LoraManager` (this repository) adds
- **3.** the three options, measured: reload per request, all resident + `set_adapters`, hotswap from CPU memory
- **4.** what `target_rank` prepares, and what it costs
- **5.** `torch.compile`: zero recompiles across swaps, and what one recompile costs
- **6.** pitfalls of plain hotswap, each reproduced (with diffusers' own log lines), then handled
- **7.** concurrent requests, each with its own adapter
- **8.** moving to a GPU Space

Deep dives after the main path: **A.** what padding to `target_rank` costs on SD 1.5, SDXL and Flux (computed from
their configs), **B.** which changes recompile, counted.
"""),
    md(r"""
## Setup

Everything runs offline: the base model and six style LoRAs ship with the repository in
`lora_manager/presets/tiny`. Run it from a checkout where the package is installed (`pip install -e .` in the
repository; the test command's `tests/requirements.txt` does it). It is a real Stable-Diffusion-architecture pipeline
(UNet, CLIP text encoder, VAE), small and trained on coloured shapes, so one 64×64 image takes well under a second on
a CPU. Python warnings and diffusers' log lines are left on (only transformers, which loads the text encoder, is
set to errors). Where a cell expects a long one, it collects it and prints it shortened.
"""),
    code(r"""
import contextlib, json, logging, os, random, sys, tempfile, time, warnings
T_START = time.perf_counter()
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "lora_manager").is_dir())  # the checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")         # everything below is local
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the text encoder's loader; diffusers' logs stay on

import numpy as np, torch, diffusers, peft
import matplotlib.pyplot as plt
from IPython.display import Markdown, display
from PIL import Image, ImageDraw
from diffusers import DiffusionPipeline, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.utils import logging as diffusers_logging
from torch._dynamo.utils import counters

from lora_manager import LoraManager, LoraManagerError
from lora_manager.testing import levels   # largest per-pixel difference of two images, in 8-bit levels
from transformers.utils import logging as transformers_logging

diffusers_logging.disable_progress_bar()
transformers_logging.disable_progress_bar()
# One intra-op thread: this model's ops are too small to gain from more, and on a shared CPU a second thread
# waiting for a busy core stalls every op.
torch.set_num_threads(1)
print(f"torch {torch.__version__} | diffusers {diffusers.__version__} | peft {peft.__version__} | "
      f"{torch.get_num_threads()} CPU thread | inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')}")
"""),
    code(r"""
PRESET = ROOT / "lora_manager" / "presets" / "tiny"
CATALOG = json.loads((PRESET / "catalog.json").read_text())
GEN = CATALOG["generation"]                     # 64x64, 10 steps, guidance 7.5
TRIGGER = {a["id"]: a["trigger"] for a in CATALOG["adapters"]}
PROMPT = "a white diamond on a green background"
RESULTS = []                                    # every number the recap shows and notebooks/figures/results.json holds

def record(key, label, value):
    RESULTS.append({"key": key, "label": label, "value": value})

def r2(x):                                      # ms and s as recorded: 2 decimals below 10, else 1
    return round(float(x), 2 if abs(x) < 10 else 1)

def prompt_for(adapter):                        # the adapter's trigger word brings its style out
    return PROMPT + (f", {TRIGGER[adapter]}" if adapter else "")

def lora(name):
    return str(PRESET / "adapters" / f"{name}.safetensors")

def ms_since(t0):
    return (time.perf_counter() - t0) * 1e3

def short(e):                                   # first line of an exception, trimmed
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"

def mean_diff(a, b):                            # mean absolute pixel difference, in levels of 255
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())

@contextlib.contextmanager
def logged(limit=240):
    # Collect diffusers' log records and Python warnings in the block, then print each one, shortened: a failed
    # hotswap logs every key of the model in one record. Outside these blocks both go to stderr as usual.
    logger, records, caught = logging.getLogger("diffusers"), [], []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    saved, logger.handlers = logger.handlers, [handler]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.handlers = saved
        lines = [(f"diffusers logged [{r.levelname} {r.name}]", r.getMessage()) for r in records]
        lines += [(f"warning [{w.category.__name__}]", str(w.message)) for w in caught]
        for source, message in lines:
            text = " ".join(message.split())
            more = f" … ({len(text)} characters)" if len(text) > limit else ""
            print(f"  {source}: {text[:limit]}{more}")

def show(images, titles, scale=3):
    # One row of images, upscaled with NEAREST so the 64x64 pixels stay crisp, captions underneath.
    w, h = images[0].width * scale, images[0].height * scale
    row = Image.new("RGB", (w * len(images), h + 34), "white")
    draw = ImageDraw.Draw(row)
    for i, (img, title) in enumerate(zip(images, titles)):
        row.paste(img.resize((w, h), Image.NEAREST), (i * w, 0))
        for j, line in enumerate(str(title).split("\n")[:2]):
            draw.text((i * w + 4, h + 3 + 15 * j), line, fill="black")
    display(row)

def table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    display(Markdown("\n".join(lines)))
"""),
    # ---- 2. the recipe, then the manager ---------------------------------------------------------------------------
    md(r"""
## 2. The plain-diffusers recipe, then what `LoraManager` adds

Load the pipeline and make a reference image without any LoRA:
"""),
    code(r"""
pipe = DiffusionPipeline.from_pretrained(PRESET / "model", dtype=torch.float32)
pipe.set_progress_bar_config(disable=True)

def run(pipe, prompt, seed=0, **kwargs):
    return pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), **{**GEN, **kwargs}).images[0]

base = run(pipe, PROMPT)
print(f"{type(pipe).__name__}: UNet {sum(p.numel() for p in pipe.unet.parameters()) / 1e6:.1f} M parameters")
"""),
    md(r"""
### The recipe: a CPU cache that keeps alpha, then hotswap from it

Copy this into your own code; it needs only diffusers. `lora_state_dict(..., return_lora_metadata=True)` (on the
pipeline class) returns the tensors and, for diffusers/PEFT files, the metadata that holds alpha; kohya files return
their alphas as `network_alphas` instead. Keep all three per LoRA, and pass them to the denoiser's
`load_lora_adapter`. Our LoRAs have ranks 4 to 32, so `target_rank=32`:
"""),
    code(r"""
TARGET_RANK = 32
CACHE = {}                                                   # LoRA name -> (state dict, network_alphas, metadata)
for name in ["stripes", "outline", "dots", "checker"]:
    sd, alphas, metadata = StableDiffusionPipeline.lora_state_dict(lora(name), return_lora_metadata=True)
    rank = max(v.shape[0] for k, v in sd.items() if k.endswith(("lora_A.weight", "lora.down.weight")))
    assert rank <= TARGET_RANK, f"{name}: rank {rank} > {TARGET_RANK}"  # a larger one would corrupt this cache (6.3)
    CACHE[name] = (sd, alphas, metadata)

def use(pipe, name, hotswap=True):                          # UNet only: text-encoder LoRAs cannot be hotswapped
    sd, alphas, metadata = CACHE[name]
    pipe.unet.load_lora_adapter(sd, prefix="unet", network_alphas=alphas, metadata=metadata,
                                adapter_name="style", hotswap=hotswap)

pipe.enable_lora_hotswap(target_rank=TARGET_RANK)           # 1. before the first load
use(pipe, "stripes", hotswap=False)                          # 2. first load, padded to rank 32
# pipe.unet.compile()                                        # 3. compile here, once (section 5)
recipe = {"stripes": run(pipe, prompt_for("stripes"))}
for name in ["outline", "dots", "checker"]:                  # 4. every later LoRA: copied into the same tensors
    t0 = time.perf_counter(); use(pipe, name); swap = ms_since(t0)
    recipe[name] = run(pipe, prompt_for(name))
    print(f"hotswap to {name:<8} from the CPU cache: {swap:5.1f} ms")
show([base, *recipe.values()], ["no LoRA", *recipe])
"""),
    md(r"""
That covers one LoRA at a time on the UNet. A server with ten LoRAs still has to handle, on its own:

- **different target modules**: hotswapping a LoRA that targets a layer the live one doesn't *fails and deletes
  the live adapter* (section 6.1);
- **text-encoder LoRAs**: refused by hotswap, after the UNet was already swapped (6.4); the recipe above simply
  ignores a LoRA's text-encoder part;
- **ranks above `target_rank`** (6.3), **strength per request** (6.5, 6.7), **concurrent requests** (7), and knowing
  what happened (swap time, recompiles).

`lora_manager.LoraManager` is a small engine that encodes the order once and handles those. It reads every
catalog LoRA once into CPU memory (tensors converted to the PEFT layout), builds a zero *template* adapter over the
**union** of all their target modules (UNet and text encoder) at the largest rank, loads it as the first adapter,
optionally compiles, and from then on a swap is a few `torch._foreach_copy_` calls into the template's own
tensors: no file read, no key conversion, no new modules. Every check (shapes, targets, rank, NaNs) runs
*before* the first weight is written, so a refused LoRA changes nothing.
"""),
    code(r"""
m = LoraManager.from_preset("tiny", compile=False)   # eager here; section 5 compiles
table(["id", "rank", "alpha", "modules", "text encoder", "format", "KiB in CPU memory"],
      [(a.id, a.rank, f"{a.alpha:g}", a.num_modules, a.has_text_encoder, a.format, a.bytes // 1024)
       for a in m.adapters()])
s = m.stats()
print(f"template: {s['template_modules']} modules (union of all targets) at target_rank {s['target_rank']}; "
      f"{s['cache_entries']} LoRAs in the CPU cache, {s['cache_bytes'] / 2**20:.1f} MiB")
"""),
    md(r"""
One request, one adapter. `generate` returns the image and an `info` dict with what it cost. Each image of the
recipe above must equal the manager's image for the same adapter (within 1 level of 255, float rounding):
"""),
    code(r"""
grid = {None: m.generate(PROMPT, seed=0)}
for a in m.adapters():
    grid[a.id] = m.generate(prompt_for(a.id), adapter=a.id, seed=0)
show([r.image for r in grid.values()],
     [f"{k or 'no LoRA'}\nswap {r.info['swap_ms']:.1f} ms" for k, r in grid.items()])
recipe_levels = {name: levels(grid[name].image, img) for name, img in recipe.items()}
print("recipe vs LoraManager, largest pixel difference in levels of 255:", recipe_levels)
assert max(recipe_levels.values()) <= 1
record("recipe_vs_manager_levels", "plain-diffusers recipe vs LoraManager, largest difference (levels of 255)",
       max(recipe_levels.values()))
"""),
    md(r"""
The text-encoder LoRA (`pixel`) and the kohya-format one (`checker`) swap like the others.

## 3. The three options, measured

The question lists three ways to serve one LoRA per request. We measure each on the denoiser alone (the part
that changes), each on a fresh UNet, with the same LoRAs (`stripes`, `dots`, `frame`: ranks 5, 12, 32; 106
modules each; the resident option cycles through five files to reach 10). The measuring functions live in
`lora_manager/bench/strategies.py` and call exactly what `pipe.load_lora_weights` calls for the UNet. One denoising
step is one UNet call on a batch of 2 (classifier-free guidance); a request here is 10 steps.

On a shared CPU, timings are noisy; we report the **fastest of several runs** (the least disturbed one), and every
forward below is timed in one go, alternating between the models, so that load from other processes hits all alike.
"""),
    code(r"""
from lora_manager.bench import strategies as S
from lora_manager.adapters.reader import read_adapter

LOADER = StableDiffusionPipeline          # its lora_state_dict / load_lora_into_unet = load_lora_weights for the UNet
CPU = torch.device("cpu")

def fresh_unet():
    return UNet2DConditionModel.from_pretrained(PRESET / "model" / "unet", dtype=torch.float32).eval()

def bench_adapter(name, unet):
    path = Path(lora(name))
    return S.BenchAdapter(name, path, read_adapter(path, name, LOADER, {"unet": unet}, torch.float32))

def best(timing):                         # fastest sample of a strategies.Timing, in ms
    return min(timing.samples_ms)

base_unet = fresh_unet()
SAME = [bench_adapter(n, base_unet) for n in ["stripes", "dots", "frame"]]
ALL = SAME + [bench_adapter(n, base_unet) for n in ["checker", "outline"]]
g = torch.Generator().manual_seed(0)
latent = GEN["height"] // pipe.vae_scale_factor
INPUTS = dict(sample=torch.randn(2, 4, latent, latent, generator=g), timestep=torch.tensor(500),
              encoder_hidden_states=torch.randn(2, pipe.tokenizer.model_max_length,
                                                base_unet.config.cross_attention_dim, generator=g))
UNETS = {"no LoRA": base_unet}            # every variant below; their forwards are timed together in "Side by side"
"""),
    md(r"""
### Option 1: `load_lora_weights` per request

Drop the previous LoRA and load the next one from disk. Most of the time is not the disk read: it is creating
the LoRA modules and converting keys.
"""),
    code(r"""
reload = S.measure_reload(fresh_unet(), SAME, LOADER, repeats=5)
print(f"delete_adapters + load_lora_weights : {best(reload.delete_load):6.1f} ms per switch")
print(f"unload_lora_weights + load          : {best(reload.unload_load):6.1f} ms per switch")
print(f"  of which reading the file          : {best(reload.read_file):6.1f} ms")
record("reload_ms", "reload per request (delete_adapters + load_lora_weights), ms", r2(best(reload.delete_load)))
record("reload_unload_ms", "reload per request (unload_lora_weights + load), ms", r2(best(reload.unload_load)))
"""),
    md(r"""
### Option 2: all LoRAs resident, switched with `set_adapters`

Every resident LoRA stays in device memory. What each step computes depends on how you switch, because PEFT
computes only the **active** adapters:

- **all active, unused at weight 0** (`set_adapters(names, [1, 0, 0, ...])`): each step computes every LoRA;
- **only the requested one active** (`set_adapters("x")`): each step computes one.

We load up to 10 LoRAs, time `set_adapters`, and keep UNets for the forward timings, both ways:
"""),
    code(r"""
COUNTS = (1, 2, 5, 10)
resident = S.measure_resident(fresh_unet(), ALL, LOADER, COUNTS, repeats=5)
print("set_adapters, all active:", " | ".join(f"{n} resident {best(t):.1f} ms" for n, t in zip(COUNTS, resident.set_adapters)))

def with_resident(n):                     # n LoRAs loaded
    unet = fresh_unet()
    for i in range(n):
        S.load_file(unet, LOADER, ALL[i % len(ALL)].path, f"resident{i}")
    return unet

for n in COUNTS:                          # all active, all but the first at weight 0
    UNETS[n] = with_resident(n)
    UNETS[n].set_adapters([f"resident{i}" for i in range(n)], [1.0] + [0.0] * (n - 1))
UNETS["one active"] = with_resident(COUNTS[-1])
one = S.timed(lambda i: UNETS["one active"].set_adapters(f"resident{i % COUNTS[-1]}"), 5, CPU)
UNETS["one active"].set_adapters("resident0")
print(f"set_adapters('x'), only one active, {COUNTS[-1]} resident: {best(one):.1f} ms")
lora_mib = sum(p.nbytes for n, p in UNETS[COUNTS[-1]].named_parameters() if "lora_" in n) / 2**20
print(f"LoRA tensors held with {COUNTS[-1]} resident: {lora_mib:.1f} MiB (on a GPU: device memory)")
record("set_adapters_max_ms", f"set_adapters with {COUNTS[-1]} resident, all active, ms",
       r2(best(resident.set_adapters[-1])))
record("set_adapters_one_ms", f"set_adapters('x') with {COUNTS[-1]} resident, one active, ms", r2(best(one)))
"""),
    md(r"""
Under `torch.compile` the two ways differ again: the active set and a weight of exactly 0 are part of the compiled
graph, so switching the active adapter, or moving the 0 from one adapter to another, recompiles (counted in deep
dive B). The forward costs are in "Side by side" below.

### Option 3: hotswap from CPU memory

First plain diffusers' hotswap (from the file, and from a state dict cached in memory with its config, as in the
recipe), then the manager's swap on the same UNet layout: the template over the union of every catalog LoRA's
modules at rank 32, the LoRAs held as CPU tensors. The floors are a bare `copy_` of the same bytes: as one buffer,
and tensor by tensor into the model.
"""),
    code(r"""
u_hot = fresh_unet()
S.prepare_hotswap(u_hot, SAME[0], LOADER, rank=32)
hot = S.measure_hotswap(u_hot, SAME, LOADER, repeats=6)

UNION = {module for comp, module in m.slots[0].keys if comp == "unet"}   # the manager's template modules in the UNet
u_eng = fresh_unet()
slot = S.prepare_engine(u_eng, UNION, rank=32)[0]
eng = S.measure_engine_swap(slot, [a.weights for a in SAME], repeats=12)
floor = S.measure_floors(slot, [a.weights for a in SAME], repeats=12)
UNETS.update({"diffusers hotswap": u_hot, "LoraManager": u_eng})
print(f"diffusers hotswap from the file      : {best(hot.from_file):6.1f} ms")
print(f"diffusers hotswap from a cached dict : {best(hot.from_dict):6.1f} ms")
print(f"LoraManager swap (CPU tensors)       : {best(eng):6.2f} ms")
print(f"floor: copy_ tensor by tensor        : {best(floor.per_tensor):6.2f} ms | as one buffer {best(floor.flat):.2f} ms")
record("hotswap_file_ms", "diffusers hotswap from the file, ms", r2(best(hot.from_file)))
record("hotswap_dict_ms", "diffusers hotswap from a cached dict, ms", r2(best(hot.from_dict)))
record("swap_cycle_ranks", "ranks the swaps of options 1 and 3 cycle through", [a.rank for a in SAME])
record("engine_swap_ms", "LoraManager swap (CPU tensors), ms", r2(best(eng)))
record("floor_per_tensor_ms", "floor: copy_ tensor by tensor, ms", r2(best(floor.per_tensor)))
record("floor_flat_ms", "floor: one copy_ of the same bytes, ms", r2(best(floor.flat)))
"""),
    md(r"""
### Side by side

Per request = one switch + 10 UNet steps. All forwards are timed here, once, together with the manager's template at
other target ranks (for section 4). The manager's forward carries its template (all catalog targets at rank 32) and
computes one LoRA's worth of work however many LoRAs sit in its CPU cache.
"""),
    code(r"""
RANKS = (8, 32, 128, 512)
for R in RANKS:                           # the template at other target ranks, holding stripes (rank 5); 32 is u_eng
    if R != 32:
        UNETS[f"rank {R}"] = fresh_unet()
        S.prepare_engine(UNETS[f"rank {R}"], UNION, rank=R)[0].load(SAME[0].weights, 1.0)

def forward_ms(unets, rounds=10):
    # Fastest UNet forward of each model, timed in alternation so that other processes on this CPU hit all alike.
    samples = {k: [] for k in unets}
    for _ in range(rounds):
        for k, unet in unets.items():
            samples[k] += S.timed(lambda i: S.forward(unet, INPUTS), 1, CPU, warmup=0).samples_ms
    return {k: min(v) for k, v in samples.items()}

fwd = forward_ms(UNETS)
fwd_rank = {R: fwd["LoraManager" if R == 32 else f"rank {R}"] for R in RANKS}
fwd_resident = [fwd[n] for n in COUNTS]
N, steps = COUNTS[-1], GEN["num_inference_steps"]
rows = [("reload per request", best(reload.delete_load), fwd[1]),
        (f"{N} resident, all active (weights 1, 0, ...)", best(resident.set_adapters[-1]), fwd[N]),
        (f"{N} resident, one active (set_adapters('x'))", best(one), fwd["one active"]),
        ("diffusers hotswap (file)", best(hot.from_file), fwd["diffusers hotswap"]),
        ("LoraManager (CPU cache)", best(eng), fwd["LoraManager"])]
table(["option", "switch (ms)", "UNet forward (ms)", f"switch + {steps} steps (ms)"],
      [(n, f"{s:.1f}", f"{f:.1f}", f"{s + steps * f:.0f}") for n, s, f in rows])
print(f"UNet forward without LoRA: {fwd['no LoRA']:.1f} ms")

fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(COUNTS, fwd_resident, "o-", label="plain diffusers: N resident, all active, unused at weight 0")
ax.axhline(fwd["one active"], color="tab:orange", ls="-.", label=f"plain diffusers: {N} resident, one active")
ax.axhline(fwd["LoraManager"], color="tab:green", ls="--", label="LoraManager: any N in CPU memory, one template")
ax.axhline(fwd["no LoRA"], color="gray", ls=":", label="base UNet, no LoRA")
ax.set(xlabel="LoRAs loaded (N)", ylabel="UNet forward (ms)", ylim=(0, None), xticks=COUNTS,
       title="Active LoRAs are computed, even at weight 0")
ax.legend(fontsize=8, loc="upper left"); fig.tight_layout(); plt.show()
record("fwd_base_ms", "UNet forward without LoRA, ms", r2(fwd["no LoRA"]))
record("resident_counts", "LoRAs resident (N)", list(COUNTS))
record("resident_max", "LoRAs resident, largest N", N)
record("fwd_resident_ms", f"UNet forward with N resident, all active, ms", [r2(x) for x in fwd_resident])
record("fwd_resident_all_active_ms", f"UNet forward with {N} resident, all active, ms", r2(fwd[N]))
record("fwd_resident_one_active_ms", f"UNet forward with {N} resident, one active, ms", r2(fwd["one active"]))
record("template_rank", "the manager's target_rank here", 32)
record("fwd_template_ms", "UNet forward with the manager's template (rank 32), ms", r2(fwd["LoraManager"]))
del resident, u_hot, slot
"""),
    md(r"""
Reading the table: reloading pays for creating the LoRA modules on every request; all active pays in every step for
every resident LoRA; one active computes one LoRA but still holds all of them in memory, and recompiles under
`torch.compile` when the active one changes; the two hotswaps pay none of these. The switch is a small part of a
request on this tiny model; it grows with the size of the LoRA.

Where plain hotswap spends its time: it builds the model's `state_dict()`, resolves every key to a module by
name and checks configs on every call. The manager pairs each cached LoRA with the template's tensors once
(`SwapPlan`), so a swap is only the copies, close to the tensor-by-tensor floor.

## 4. Rank and alpha: what `enable_lora_hotswap` prepares

Look at one layer (`attn1.to_q` in the first cross-attention block) after a normal load, after a hotswap without
preparation, and with `enable_lora_hotswap(target_rank=32)`:
"""),
    code(r"""
PROBE = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"

def describe(unet, label):
    layer = unet.get_submodule(PROBE)
    A, B, s = layer.lora_A[S.NAME].weight, layer.lora_B[S.NAME].weight, layer.scaling[S.NAME]
    print(f"{label:<34} lora_A {str(tuple(A.shape)):<9} lora_B {str(tuple(B.shape)):<9} scaling {s!r:<16} "
          f"A at {A.data_ptr():#x}")

u = fresh_unet()
S.load_file(u, LOADER, Path(lora("stripes")), S.NAME)                  # rank 5, alpha 5
describe(u, "stripes, normal load")
S.load_file(u, LOADER, Path(lora("dots")), S.NAME, hotswap=True)       # rank 12, alpha 16
describe(u, "dots hotswapped, NOT prepared")

u = fresh_unet()
u.enable_lora_hotswap(target_rank=32)
S.load_file(u, LOADER, Path(lora("stripes")), S.NAME)
describe(u, "stripes, prepared (target_rank=32)")
S.load_file(u, LOADER, Path(lora("dots")), S.NAME, hotswap=True)
describe(u, "dots hotswapped, prepared")
"""),
    md(r"""
Unprepared, the swap *replaced* the tensors (new shape, new storage) and the scaling is a plain Python float:
`torch.compile` guards on both, so a new rank or alpha recompiles (deep dive B counts the alpha case).
Prepared, the tensors keep their shape and storage, the extra rows are zeros (they add nothing to `B @ A`), and the
scaling is a 0-dim tensor whose value changes in place.

**What a larger `target_rank` costs.** Every step computes the LoRA at the padded rank (the zero rows are still
multiplied), so don't pick "1024 just in case". The manager's template holding the same rank-5 LoRA at four target
ranks, from the forward timings above (rank 32 is the "LoraManager" row there, the same number):
"""),
    code(r"""
print(f"no LoRA          : UNet forward {fwd['no LoRA']:6.1f} ms")
for R in RANKS:
    unet = UNETS["LoraManager" if R == 32 else f"rank {R}"]
    mib = sum(p.nbytes for n, p in unet.named_parameters() if "lora_" in n) / 2**20
    print(f"target_rank {R:4d}: UNet forward {fwd_rank[R]:6.1f} ms | LoRA tensors {mib:5.1f} MiB")
    if R != 32:
        record(f"fwd_rank{R}_ms", f"UNet forward with the template at target_rank {R}, ms", r2(fwd_rank[R]))
del UNETS, u_eng
"""),
    md(r"""
On this tiny UNet (layers 32 to 128 wide) the LoRA matmuls are small next to the per-operation overhead, so ranks 8
and 32 read alike (their difference is within the run-to-run noise of this shared CPU); the rank shows once it is far
above the layer width. On a real model the LoRA's memory and FLOPs grow linearly with `R` in every targeted layer:
deep dive A gives the memory per slot for SD 1.5, SDXL and Flux.

So pick `R` = the largest rank in your catalog (the manager does that by default; `target_rank=` or
`--target-rank` overrides it). A LoRA above `R` needs a restart with a larger `R` (section 6.3).

## 5. `torch.compile`: compile once, swap forever

`from_preset(..., compile=True)` runs the whole order: enable → template load → `unet.compile()` → one warm-up
generation (the compile). `slots=2` prepares two templates (two hotswap slots), so that one request can also
combine two LoRAs; a request with one LoRA leaves the other slot at zero. Inductor caches compiled kernels on disk;
the committed run started with an empty cache, so its time below is a first compile on a fresh machine (the counter
says how many compiled graphs came from the cache in your run):
"""),
    code(r"""
hits0, misses0 = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
mc = LoraManager.from_preset("tiny", compile=True, slots=2)
hits, misses = counters["inductor"]["fxgraph_cache_hit"] - hits0, counters["inductor"]["fxgraph_cache_miss"] - misses0
print(f"compile (warm-up generation): {mc.compile_s:.1f} s | inductor FX-graph cache: {hits} hits, {misses} misses")
INDUCTOR_CACHE = "cold (empty)" if hits == 0 else f"warm ({hits} of {hits + misses} graphs from the cache)"
record("compile_s", "compile, two slots (first generation), s", r2(mc.compile_s))
"""),
    md(r"""
Now swap through every LoRA (ranks 4 to 32, alphas 5 to 32, UNet-only and text-encoder, conv-only and
attention+ff+conv) and watch `torch._dynamo`'s graph counter, which `stats()["recompiles"]` reports:
"""),
    code(r"""
rows = []
for a in [None, "stripes", "outline", "dots", "pixel", "checker", "frame", "stripes"]:
    r = mc.generate(prompt_for(a), adapter=a, seed=0)
    info = mc.info(a) if a else None
    rows.append((a or "no LoRA", info.rank if info else "-", f"{info.alpha:g}" if info else "-",
                 f"{r.info['swap_ms']:.1f}", f"{r.info['generate_ms']:.0f}", r.info["recompiles"],
                 levels(r.image, grid[a].image)))
table(["adapter", "rank", "alpha", "swap ms", "generate ms", "recompiles", "vs eager (levels)"], rows)
assert mc.stats()["recompiles"] == 0
print(f"recompiles after {mc.stats()['swaps']} swaps: {mc.stats()['recompiles']}")
swapped = [mc.info(a) for a, *_ in rows if a != "no LoRA"]
record("compiled_swaps", "swaps on the compiled engine", mc.stats()["swaps"])
record("compiled_swap_range", "ranks and alphas those swaps went through",
       f"ranks {min(i.rank for i in swapped)}–{max(i.rank for i in swapped)}, "
       f"alphas {min(i.alpha for i in swapped):g}–{max(i.alpha for i in swapped):g}")
record("recompiles_after_swaps", "recompiles after those swaps", mc.stats()["recompiles"])
"""),
    md(r"""
**Two LoRAs at once.** Plain diffusers combines LoRAs with `set_adapters([a, b], [wa, wb])`; on a compiled model
that recompiles (new adapter names change the graph) and after a hotswap its scalings are wrong (section 6.5).
Here each request names its adapters with a strength each, `adapter=[("stripes", 0.8), ("outline", 1.0)]`; each
goes into its own slot, one already live stays where it is. The reference is plain diffusers with both loaded
normally and combined by `set_adapters`:
"""),
    code(r"""
mix = [("stripes", 0.8), ("outline", 1.0)]
mix_prompt = prompt_for("stripes") + ", " + TRIGGER["outline"]
r = mc.generate(mix_prompt, adapter=mix, seed=0)
pipe.unload_lora_weights()
with logged():                            # a second adapter name: PEFT warns, with every key it did not find
    pipe.load_lora_weights(lora("stripes"), adapter_name="a")
    pipe.load_lora_weights(lora("outline"), adapter_name="b")
pipe.set_adapters(["a", "b"], [0.8, 1.0])
reference = run(pipe, mix_prompt)
pipe.unload_lora_weights()
parts = [mc.generate(mix_prompt, adapter=a, strength=s, seed=0).image for a, s in mix]
show([*parts, r.image, reference], ["stripes 0.8", "outline 1.0", "LoraManager\nboth, 2 slots",
                                     "diffusers\nset_adapters"])
print(f"LoraManager vs diffusers set_adapters: {levels(r.image, reference)} levels | swap {r.info['swap_ms']:.1f} ms | "
      f"recompiles {mc.stats()['recompiles']}")
assert levels(r.image, reference) <= 1 and mc.stats()["recompiles"] == 0
record("two_loras_levels", "two LoRAs in one request vs diffusers set_adapters, levels of 255",
       levels(r.image, reference))
"""),
    md(r"""
**The counterfactual.** Option 2 of the question on the same compiled UNet: load one more LoRA under a *new*
adapter name and switch to it with `set_adapters`. New LoRA modules change the graph, so the next call recompiles:
"""),
    code(r"""
graphs0 = counters["stats"]["unique_graphs"]
mc.pipe.load_lora_weights(lora("checker"), adapter_name="extra")   # a second adapter name
mc.pipe.set_adapters(["extra"])
t0 = time.perf_counter(); run(mc.pipe, prompt_for("checker")); first = time.perf_counter() - t0
t0 = time.perf_counter(); run(mc.pipe, prompt_for("checker")); again = time.perf_counter() - t0
print(f"new graphs: {counters['stats']['unique_graphs'] - graphs0} | first call {first:.1f} s (recompile) | "
      f"next call {again:.2f} s")
print(f"this recompile took {first / mc.compile_s:.0%} of the first compile ({mc.compile_s:.1f} s), "
      f"{first / again:.0f}x a compiled generation")
record("recompile_new_name_graphs", "new graphs after a new adapter name + set_adapters",
       counters["stats"]["unique_graphs"] - graphs0)
record("recompile_new_name_s", "recompile via a new adapter name + set_adapters (first call), s", r2(first))
RECOMPILE_S = first
del mc   # its pipeline now holds two adapters: this engine is spoiled, never touch a manager's pipe like this
"""),
    md(r"""
A recompile is a compile of the whole new graph: the cell prints its cost next to the first compile's (in the
committed run, both started from an empty inductor cache). Inductor reuses from its cache every kernel whose code is unchanged, so
what a recompile costs depends on how many new kernels its graph needs; it is never free, and it comes back with
every new adapter name, active set, rank or alpha (deep dive B).

## 6. Pitfalls, reproduced with plain diffusers, then handled

Each demo resets the plain pipeline from section 2 and loads a first LoRA the documented way. Where diffusers logs
something, the cell prints diffusers' own log lines (shortened: a failed hotswap logs every key of the model). The
"No LoRA keys associated to CLIPTextModel" line that diffusers logs for each UNet-only LoRA is harmless.
"""),
    code(r"""
def probe():                      # the section-4 layer in the plain pipeline, as it is now
    return pipe.unet.get_submodule(PROBE)

CONV_PROBE = "down_blocks.1.resnets.0.conv1"    # a conv layer every catalog LoRA targets (outline: only conv layers)

def fresh_hotswap(first):
    pipe.unload_lora_weights()
    pipe.enable_lora_hotswap(target_rank=32)
    pipe.load_lora_weights(lora(first), adapter_name="style")

factory_pipe = StableDiffusionPipeline.from_pretrained(PRESET / "model", dtype=torch.float32)
scratch = tempfile.TemporaryDirectory()    # LoRA files written for the demos; removed when the kernel exits
workdir = Path(scratch.name)
from lora_manager.testing import same_slots, snapshot, write_adapter  # LoRA files with chosen rank and targets; slot copies
"""),
    md(r"""
### 6.1 A failed hotswap deletes the live adapter

`outline` targets the conv layers only; `stripes` also targets attention and feed-forward layers. Hotswapping `stripes`
into `outline`'s slot fails; diffusers' error handler logs the error, *deletes* the live adapter and re-raises: the
pipeline then serves the base model, and every later hotswap fails.
"""),
    code(r"""
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
"""),
    md(r"""
**The manager** checks every LoRA against the template when it is registered, before it could ever be swapped
in. Here a LoRA on `time_emb_proj`, a layer no catalog LoRA targets:
"""),
    code(r"""
odd = write_adapter(factory_pipe, workdir / "time_emb.safetensors", rank=8, alpha=8, suffixes=("time_emb_proj",))
live_before = m.generate(prompt_for("frame"), adapter="frame").image
before = snapshot(m.slots)
try:
    m.register("time_emb", str(odd))
except LoraManagerError as e:
    print(short(e)[:240], "...")
same_tensors = same_slots(before, snapshot(m.slots))
same_image = np.array_equal(np.asarray(live_before), np.asarray(m.generate(prompt_for("frame"), adapter="frame").image))
print(f"live tensors unchanged: {same_tensors} | live output bit-identical: {same_image}")
assert same_tensors and same_image
"""),
    md(r"""
### 6.2 LoRAs that target more layers: the template covers the union

In plain diffusers the *first* LoRA fixes the target modules, which is why 6.1 failed. The manager's first load is
the zero template over the union of all catalog LoRAs' modules, so a conv-only LoRA and an
attention+feed-forward+conv LoRA follow each other in any order. Modules the new LoRA does not use are zeroed:
"""),
    code(r"""
FF = ("unet", "down_blocks.1.attentions.0.transformer_blocks.0.ff.net.2")   # targeted by stripes, not by outline
for a in ["stripes", "outline", "stripes", "outline"]:
    r = m.generate(prompt_for(a), adapter=a, seed=0)
    print(f"{a:<8} swap {r.info['swap_ms']:4.1f} ms | vs its first image: {levels(r.image, grid[a].image)} levels | "
          f"feed-forward LoRA |B|max = {m.slots[0].modules[FF].B.abs().max().item():.3f}")
"""),
    md(r"""
### 6.3 A rank above `target_rank` raises nothing and corrupts your cache

PEFT falls back to swapping whole tensors: the model gets new shapes (a recompile under `torch.compile`), and the
model's *old* tensors are swapped into the state dict you passed, which you may be keeping as your CPU cache:
"""),
    code(r"""
pipe.unload_lora_weights()
pipe.enable_lora_hotswap(target_rank=16)
pipe.load_lora_weights(lora("dots"), adapter_name="style")                     # rank 12
cached_frame = StableDiffusionPipeline.lora_state_dict(lora("frame"))[0]      # rank 32, kept in CPU memory
key = f"unet.{PROBE}.lora_A.weight"
print("cached frame lora_A before:", tuple(cached_frame[key].shape))
with logged():
    pipe.load_lora_weights(cached_frame, adapter_name="style", hotswap=True)   # no error
print("cached frame lora_A after :", tuple(cached_frame[key].shape), "<- now holds dots' old tensor")
print("model lora_A              :", tuple(probe().lora_A["style"].weight.shape), "<- new shape: a recompile if compiled")
"""),
    md(r"""
The manager refuses it up front, with the numbers and the fix:
"""),
    code(r"""
big = write_adapter(factory_pipe, workdir / "rank64.safetensors", rank=64, alpha=64)
try:
    m.register("rank64", str(big))
except LoraManagerError as e:
    print(short(e))
"""),
    md(r"""
### 6.4 Text-encoder LoRAs

`pipe.enable_lora_hotswap` prepares only the UNet/transformer, and `load_lora_weights(..., hotswap=True)` refuses
text-encoder weights, *after* it has swapped the UNet part: the pipeline is left half-swapped.
"""),
    code(r"""
fresh_hotswap("stripes")                                            # scaling alpha/rank = 5/5 = 1
with logged():
    try:
        pipe.load_lora_weights(lora("pixel"), adapter_name="style", hotswap=True)
    except ValueError as e:
        print("raised:", short(e))
print(f"UNet scaling is now pixel's 16/8: {float(probe().scaling['style'])} | adapters: {pipe.get_list_adapters()} "
      "<- UNet swapped, text encoder not")
"""),
    md(r"""
The manager's template spans the text encoder too (the `pixel` LoRA is in the union), so it swaps both. Its image
equals a plain, non-hotswap load of `pixel`:
"""),
    code(r"""
pipe.unload_lora_weights()
pipe.load_lora_weights(lora("pixel"), adapter_name="ref")          # normal load, UNet + text encoder
print(f"LoraManager 'pixel' vs a normal load of it: {levels(grid['pixel'].image, run(pipe, prompt_for('pixel')))} levels")
"""),
    md(r"""
### 6.5 `set_adapters` after a hotswap uses a stale alpha

After a hotswap, PEFT's per-layer `r` and `lora_alpha` still hold the *first* LoRA's values. `set_adapters`
recomputes the scaling from them, as a Python float again (whose changes recompile under `torch.compile`, deep
dive B):
"""),
    code(r"""
fresh_hotswap("stripes")                                                        # rank 5, alpha 5
pipe.load_lora_weights(lora("dots"), adapter_name="style", hotswap=True)        # rank 12, alpha 16 -> 1.333
print(f"after the hotswap       : scaling {probe().scaling['style']!r}")
pipe.set_adapters(["style"], [1.0])                                            # "full strength"
print(f"after set_adapters(1.0) : scaling {probe().scaling['style']!r} <- stripes' 5/5, should be 16/12")
"""),
    md(r"""
The manager takes the strength with the request and computes alpha / rank × strength from the LoRA it swapped in.
Strength 0, 0.5 and 1 of `outline`; what is measured is the mean absolute pixel difference from the strength-0
image (same prompt and seed), in levels of 255, and the scaling a conv layer it targets holds:
"""),
    code(r"""
strengths = (0.0, 0.5, 1.0)
info = m.info("outline")
imgs, scalings = [], []
for s in strengths:
    imgs.append(m.generate(prompt_for("outline"), adapter="outline", strength=s).image)
    scalings.append(m.slots[0].modules[("unet", CONV_PROBE)].scaling.item())
diffs = [mean_diff(img, imgs[0]) for img in imgs]
for s, sc, d in zip(strengths, scalings, diffs):
    print(f"strength {s}: scaling {sc:.3f} ({info.alpha:g}/{info.rank} x {s}) | mean difference from strength 0: "
          f"{d:5.1f} levels")
show(imgs, [f"outline, strength {s}\nvs strength 0: {d:.1f}" for s, d in zip(strengths, diffs)])
assert np.allclose(scalings, [info.alpha / info.rank * s for s in strengths]) and diffs[2] > 0
record("strength_diff", "outline at strength 0 / 0.5 / 1: mean pixel difference from strength 0, levels of 255",
       [round(d, 1) for d in diffs])
"""),
    md(r"""
### 6.6 A LoRA cached as a state dict loses its alpha

The natural way to "keep LoRAs in CPU memory" is to keep their state dicts. But `load_lora_weights(dict)` reads no
metadata, so on SD pipelines the LoRA's alpha is gone and its scaling falls back to 1.0 (the recipe in section 2
keeps the metadata and passes it back):
"""),
    code(r"""
pipe.unload_lora_weights()
cached_outline = StableDiffusionPipeline.lora_state_dict(lora("outline"))[0]    # rank 16, alpha 8 in the file
pipe.load_lora_weights(lora("outline"), adapter_name="from_file")
with logged():
    pipe.load_lora_weights(cached_outline, adapter_name="from_dict")
conv = pipe.unet.get_submodule(CONV_PROBE)
print(f"scaling from the file: {float(conv.scaling['from_file'])} | "
      f"from the cached dict: {float(conv.scaling['from_dict'])} <- alpha lost")
"""),
    md(r"""
The manager reads each file once, metadata included, and keeps alpha with the tensors: its `outline` scaling in
6.5 was 8/16.

### 6.7 Strength with `cross_attention_kwargs={"scale": s}` after a hotswap

The pipeline's own strength knob multiplies every active LoRA's scaling for one call and divides it back afterwards.
After a hotswap, `scale=0` does not divide: it *resets* the scaling from PEFT's stored `lora_alpha / r`, the first
LoRA's (as in 6.5), and as a Python float:
"""),
    code(r"""
fresh_hotswap("stripes")                                                        # rank 5, alpha 5: 1.0
pipe.load_lora_weights(lora("checker"), adapter_name="style", hotswap=True)     # rank 4, alpha 8: 2.0
print(f"after the hotswap         : scaling {probe().scaling['style']!r}")
for s in (0.5, 0.0):
    run(pipe, prompt_for("checker"), cross_attention_kwargs={"scale": s})
    print(f"after a call at scale {s}: scaling {probe().scaling['style']!r}")
"""),
    md(r"""
So with plain diffusers, per-request strength after a hotswap is safe at non-zero scales only, and a strength of 0
silently replaces the swapped LoRA's alpha with the first one's. The manager's `strength=` writes the scaling tensor
in place (6.5). What these scale round trips do under `torch.compile` was not measured here.
"""),
    # ---- 7. concurrency ----------------------------------------------------------------------------------------------
    md(r"""
## 7. Concurrent requests, each with its own adapter

A server gets requests concurrently, each wants its own LoRA, and a *global* switch (`set_adapters` or a hotswap
when a request arrives) changes the adapter under requests already in flight.

In `LoraManager` the adapter and strength travel **with the request**. `generate` (and `submit`, which returns a
`Future`) puts it in a queue; one worker thread runs one generation at a time and swaps only *between*
generations, preferring queued requests for the live adapter (fewer swaps) within fairness bounds. Let's fire
the grid's requests twice, shuffled, from 8 threads, and compare each image with its solo reference from
section 2:
"""),
    code(r"""
jobs = [a for a in grid] * 2
random.Random(0).shuffle(jobs)
changes0 = m.stats()["adapter_changes"]
t0 = time.perf_counter()
with ThreadPoolExecutor(max_workers=8) as pool:
    futures = [pool.submit(m.generate, prompt_for(a), adapter=a, seed=0) for a in jobs]
    results = [f.result() for f in futures]
wall = time.perf_counter() - t0
same = [np.array_equal(np.asarray(r.image), np.asarray(grid[a].image)) for a, r in zip(jobs, results)]
print("in submission order:", ", ".join(f"{a or 'no LoRA'} {'✓' if ok else '✗'}" for a, ok in zip(jobs, same)))
assert all(same)
print(f"{len(jobs)} concurrent requests over {len(set(jobs))} adapters in {wall:.1f} s: all bit-identical to their "
      f"solo references; {m.stats()['adapter_changes'] - changes0} swaps")
record("concurrent_identical", "concurrent requests bit-identical to solo", f"{sum(same)}/{len(same)}")
"""),
    md(r"""
For throughput, `LoraManager(..., max_batch=4)` runs up to 4 queued requests as one pipeline call, **mixed
adapters included**: each row of the batch runs its own LoRA (and strength) from its own device slot, and each image
equals its solo image within 1 level of 255 (`tests/test_mixed_batches.py`). `python -m lora_manager loadtest`
compares this engine with plain diffusers and a naive "switch on arrival" server under concurrent load. It takes
minutes, so this notebook does not run it: the table below reads the file that
`OMP_NUM_THREADS=1 python -m lora_manager loadtest --clients 16 --requests 2 --json
notebooks/figures/loadtest_mixed_batches_tiny_cpu.json` wrote on this CPU (`max_batch=8`).
"""),
    code(r"""
load = json.loads((ROOT / "notebooks" / "figures" / "loadtest_mixed_batches_tiny_cpu.json").read_text())
table(["server", "images/s", "images off their solo reference", "pipeline calls"],
      [[r["name"], f"{r['images_per_s']:.2f}", f"{r['mismatches']} of {r['requests']}", r["batches"] or "—"]
       for r in load["runs"]])
print(f"mixed adapters / one adapter: {load['mixed_over_single_throughput']:.2f}x; "
      f"mixed adapters / plain diffusers batches of one LoRA: {load['mixed_over_plain_batches_throughput']:.2f}x")
"""),
    md(r"""
## 8. Moving to a GPU Space

Everything above runs the same way on a GPU; the preset is the switch:

```bash
python app.py --preset sdxl --compile          # or --preset path/to/your_catalog.json, --target-rank 64
```

A preset is a `catalog.json`: base model, dtype, generation defaults, and the LoRAs (Hub repo + `weight_name`,
or a local file). The manager reads them all at start-up and sizes the template from them. None of the GPU points
below was measured by this notebook (it runs on a CPU):

- **`target_rank`**: the largest rank in the catalog; deep dive A gives what each slot then holds on SD 1.5, SDXL
  and Flux, and the rule of thumb.
- **CPU cache to GPU.** On CUDA the manager keeps the CPU cache in pinned (page-locked) host memory and copies the
  LoRA's tensors into the template's with one `torch._foreach_copy_(..., non_blocking=True)`, then synchronizes:
  one host-to-device copy per tensor, no disk read. (Not measured by this notebook: it runs on a CPU.)
- **Compile is on by default** on CUDA. Pass `compile_kwargs` to `LoraManager` (e.g. `{"fullgraph": True}` to catch
  graph breaks); the swap writes into the same tensors either way. In CI, `torch._dynamo.config.error_on_recompile =
  True` turns an accidental recompile into a test failure. The app compiles at start-up (warm-up generation), so no
  user request pays for it, and `stats()["recompiles"]` should stay 0.
- **A new resolution recompiles** unless shapes are dynamic: deep dive B measures 64×64 then 48×48 (one
  recompile, after which dynamo traces the sizes as dynamic), then 32, 40 and 56 (these recompile only where the
  UNet takes another branch). Warm up the sizes you serve at start-up, or offer a fixed set.
- **Strength**: `strength=` per request in the manager; in plain diffusers `cross_attention_kwargs={"scale": s}`,
  with the `scale=0` trap of 6.7.
- **ZeroGPU** runs GPU work in a separate process per call and does not support `torch.compile`; the app runs eager
  there (swaps still come from the CPU cache). Ahead-of-time compilation is the compiled option: `python -m
  lora_manager aot-package --preset tiny --out unet.pt2` builds an AOTInductor package whose LoRA tensors stay
  constants bound to the pipeline's own tensors, and `LoraManager(..., aot_package="unet.pt2")` serves from it with
  the usual swaps (README, "AOTInductor"; UNet pipelines, `max_batch=1`). ZeroGPU's own
  `spaces.aoti_compile`/`aoti_apply` replace the module's LoRA tensors with export-time copies, so swaps need our
  loader (`lora_manager/hotswap/aot.py`). Not tried on a ZeroGPU Space.
- **Concurrent requests**: one worker swaps only between generations (section 7); with `max_batch>1` a batch can
  mix adapters, one LoRA per row.
"""),
    # ---- deep dives -------------------------------------------------------------------------------------------------
    md(r"""
## Deep dive A: what padding to `target_rank` costs on real models

Every hotswap slot holds `lora_A` (R × in) and `lora_B` (out × R) for every targeted layer, at rank R whatever the
LoRA's own rank. We build SD 1.5's UNet, SDXL's UNet and Flux.1-dev's transformer on the `meta` device (shapes only,
no memory, no download) from their published configs, written out below, and sum those bytes in bf16/fp16
(2 bytes a value). Row "attention": `to_q`, `to_k`, `to_v`, `to_out.0`; row "+ ff / proj": also the
feed-forward, `proj_in`/`proj_out`, and Flux's `add_*_proj`, `to_add_out`, `ff_context` and `proj_mlp`.
"""),
    code(r"""
from diffusers import FluxTransformer2DModel
from lora_manager.bench.swaps import SDXL_UNET   # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json

# runwayml/stable-diffusion-v1-5 unet/config.json: diffusers' UNet2DConditionModel defaults plus these two
SD15_UNET = {"sample_size": 64, "cross_attention_dim": 768}
# black-forest-labs/FLUX.1-dev transformer/config.json: FluxTransformer2DModel's defaults (19 double blocks,
# 38 single blocks, 24 heads x 128 = 3072 wide, joint_attention_dim 4096) plus guidance_embeds
FLUX_DEV = {"guidance_embeds": True}
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
WIDER = ATTENTION + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2",
                     "ff_context.net.0.proj", "ff_context.net.2", "proj_in", "proj_out", "proj_mlp")

def targets(model, suffixes):     # (inputs, outputs) of each targeted Linear, or Conv2d (inputs x kernel)
    return [(l.in_features, l.out_features) if isinstance(l, torch.nn.Linear)
            else (l.in_channels * l.kernel_size[0] * l.kernel_size[1], l.out_channels)
            for n, l in model.named_modules()
            if n.endswith(suffixes) and isinstance(l, (torch.nn.Linear, torch.nn.Conv2d))]

with torch.device("meta"):
    MODELS = {"SD 1.5 UNet": UNet2DConditionModel(**SD15_UNET), "SDXL UNet": UNet2DConditionModel(**SDXL_UNET),
              "Flux.1-dev transformer": FluxTransformer2DModel(**FLUX_DEV)}
rows = []
for name, model in MODELS.items():
    params = sum(p.numel() for p in model.parameters()) / 1e9
    for label, suffixes in (("attention", ATTENTION), ("+ ff / proj", WIDER)):
        t = targets(model, suffixes)
        mib = [sum(R * (i + o) for i, o in t) * 2 / 2**20 for R in (16, 64, 128)]
        extra = 64 * sum(i + o for i, o in t) / sum(i * o for i, o in t)   # LoRA FLOPs / the layers' own, rank 64
        rows.append((f"{name} ({params:.2f} B)", label, len(t), *(f"{x:.0f}" for x in mib), f"{extra:.0%}"))
table(["model (parameters)", "targets", "layers", "MiB/slot R=16", "R=64", "R=128", "extra FLOPs in those layers, R=64"],
      rows)
del MODELS
"""),
    md(r"""
The parameter counts (0.86 B, 2.57 B, 11.9 B) are those of the published models, a check that the configs are
right. The manager's CPU cache holds each LoRA at its own rank; the padding costs are per **slot** on the device
(`slots=2` doubles them), and compute: every step multiplies the padded zeros too.

**Rule of thumb for `target_rank`:** the largest rank among the LoRAs you will serve, not more: memory per slot and
the LoRA's FLOPs grow linearly with it (table above). If one LoRA's rank is far above the rest, weigh serving it
on its own engine against padding every request to its rank. A LoRA above `target_rank` is refused by the manager
(6.3) and needs a restart with a larger one.

## Deep dive B: which changes recompile, counted

Recompiles are decided by dynamo's guards before any compiler backend runs, so we count them with
`compile(backend="eager")`: the same guards as inductor, seconds per graph instead of the inductor compile of
section 5 (its counterfactual recompile is the inductor cost of one). Each row is a change made after a first compiled call, and the new graphs it caused
(`torch._dynamo`'s `unique_graphs` counter), on a bare UNet with a batch of 2 as in section 3:
"""),
    code(r"""
def graphs_after(unet, change, inputs=INPUTS):
    change()
    before = counters["stats"]["unique_graphs"]
    S.forward(unet, inputs)
    return counters["stats"]["unique_graphs"] - before

def latents(size):                # UNet inputs for a size x size image
    x = dict(INPUTS)
    x["sample"] = torch.randn(2, 4, size // pipe.vae_scale_factor, size // pipe.vae_scale_factor, generator=g)
    return x

counts = []
torch._dynamo.reset()
u = with_resident(2)              # option 2: stripes and dots resident
u.compile(backend="eager")
graphs_after(u, lambda: u.set_adapters("resident0"))
counts.append(("option 2, one active: set_adapters('resident0') -> ('resident1')",
               graphs_after(u, lambda: u.set_adapters("resident1"))))
counts.append(("  ... and back to 'resident0' (a graph already compiled)", graphs_after(u, lambda: u.set_adapters("resident0"))))
graphs_after(u, lambda: u.set_adapters(["resident0", "resident1"], [1.0, 0.0]))
counts.append(("option 2, all active: weights [1, 0] -> [0, 1]",
               graphs_after(u, lambda: u.set_adapters(["resident0", "resident1"], [0.0, 1.0]))))
counts.append(("  ... weights [0, 1] -> [0, 0.5] (no weight moves to or from 0)",
               graphs_after(u, lambda: u.set_adapters(["resident0", "resident1"], [0.0, 0.5]))))
torch._dynamo.reset()

sd, _, meta = CACHE["stripes"]    # no enable_lora_hotswap: the same LoRA again, alpha 5 -> 10 (rank 5 both)
u = fresh_unet()
u.load_lora_adapter(sd, prefix="unet", metadata=meta, adapter_name="style")
u.compile(backend="eager")
graphs_after(u, lambda: None)
counts.append(("hotswap without enable_lora_hotswap: alpha 5 -> 10, same rank",
               graphs_after(u, lambda: u.load_lora_adapter(sd, prefix="unet", metadata={**meta, "unet.lora_alpha": 10},
                                                           adapter_name="style", hotswap=True))))
counts.append((f"image size {GEN['height']}x{GEN['width']} -> 48x48", graphs_after(u, lambda: None, latents(48))))
for size in (32, 40, 56):
    counts.append((f"  ... then {size}x{size}", graphs_after(u, lambda: None, latents(size))))
torch._dynamo.reset()
del u
table(["change after the first compiled call", "new graphs (recompiles)"], counts)
record("recompiles_one_active_switch", "option 2, one active: recompiles when the active adapter changes", counts[0][1])
record("recompiles_all_active_switch", "option 2, all active: recompiles when the weight-0 adapter changes", counts[2][1])
record("recompiles_alpha_unprepared", "no enable_lora_hotswap: recompiles on an alpha change", counts[4][1])
record("recompiles_new_resolution", "recompiles at a new image size (64x64 -> 48x48)", counts[5][1])
assert [c for _, c in counts[:6]] == [1, 0, 1, 0, 1, 1], counts   # what the text says
"""),
    md(r"""
With `enable_lora_hotswap` the alpha is a tensor and the same change is a value in place: section 5's compiled
engine swapped alphas 5 to 32 with 0 recompiles. The active set is part of the graph, and so is a weight of exactly
0, so moving the 0 between adapters recompiles while a change between non-zero weights does not.

Image size: the first new size recompiles, and dynamo traces the sizes as dynamic from then on; a later size still
recompiles when it takes a branch the dynamic graph fixed the other way (the UNet's forward checks, for one, whether
the latent side is divisible by 4: `dim % default_overall_up_factor`); the rows above show which sizes did here.
Compile at start-up with a warm-up per size you serve, or serve a fixed set of sizes.

## Recap

The numbers this run measured (the README quotes them from `notebooks/figures/results.json`, which this cell writes;
`python notebooks/fill_readme.py` refreshes the README after a new run):
"""),
    code(r"""
import importlib.util
spec = importlib.util.spec_from_file_location("fill_readme", ROOT / "notebooks" / "fill_readme.py")
fill_readme = importlib.util.module_from_spec(spec); spec.loader.exec_module(fill_readme)
DATA = {"run": {"torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
                "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                "inductor_cache": INDUCTOR_CACHE, "notebook_s": round(time.perf_counter() - T_START)},
        "results": RESULTS}
out = Path(os.environ.get("LORA_TUTORIAL_RESULTS", ROOT / "notebooks" / "figures" / "results.json"))
out.write_text(json.dumps(DATA, indent=1) + "\n")
display(Markdown(fill_readme.results_table(DATA)))
print(f"notebook ran in {DATA['run']['notebook_s']} s")
"""),
    md(r"""
- **Which method?** `enable_lora_hotswap(target_rank=R)`, before the first load; then load → compile → hotswap
  under the same adapter name, from a CPU cache that keeps each LoRA's metadata (section 2's recipe).
- **Reload per request** pays for module creation every time; **all resident** holds every LoRA in device memory,
  computes every *active* one each step, and recompiles under `torch.compile` when the active set changes;
  **hotswap** keeps one LoRA's worth of compute and switches in place.
- **For a server**, hold the LoRAs in CPU memory as tensors, prepare one template over the union of their targets
  at the largest rank, check each LoRA before touching the model, and swap only between generations:
  that is what `LoraManager` does.
"""),
]


def main() -> None:
    nb = new_notebook(cells=CELLS)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, OUT)
    print(f"wrote {OUT} ({len(CELLS)} cells)")


if __name__ == "__main__":
    main()
