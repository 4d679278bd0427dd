"""The shipped tiny model really follows prompts and its adapters really differ.

Everything here goes through plain diffusers (`DiffusionPipeline.from_pretrained`,
`load_lora_weights`) so the preset is known to work for any consumer, and the
checks use the pixel metrics of `lora_manager.tiny_model.shapes`.

Each style adapter also has a detector below (pure numpy on 64x64 RGB uint8): it is
first checked on ground-truth renders (styled vs plain, from shapes.py) and on their
round trip through the preset's VAE, then used to check that the adapter draws its
style on held-out prompts, that the prompt is still followed, and that strength
0 / 0.5 / 1 order the style.

TINY_PRESET=/some/build pytest tests/test_tiny_model.py runs these checks against
another build folder (default: the shipped preset); STYLE_SEEDS=3 measures the
styles on three seeds per prompt instead of one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, StableDiffusionPipeline
from safetensors import safe_open
from safetensors.torch import load_file

from lora_manager.tiny_model import shapes
from lora_manager.tiny_model.build import to_tensor
from lora_manager.tiny_model.kohya import to_kohya

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(os.environ.get("TINY_PRESET") or ROOT / "lora_manager" / "presets" / "tiny")
CATALOG = json.loads((TINY / "catalog.json").read_text())
GEN = CATALOG["generation"]
HELD_OUT = shapes.split_captions()[1]
# Thresholds from the shipped build (held-out: background 95%, colour 95%, shape 95%),
# with margin; chance is 17% / 20% / 25%.
BG_MIN, COLOUR_MIN, SHAPE_MIN = 0.85, 0.85, 0.85
STYLE_MIN = 0.2  # smallest pairwise style distance, same prompts and seeds; shipped build: 0.24 (outline-dots)


def generate(pipe, prompt: str, seed: int) -> np.ndarray:
    out = pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **GEN)
    return out.images[0]


def to_uint8(img: np.ndarray) -> np.ndarray:
    return (img * 255).round().astype(np.uint8)


@functools.cache
def _pipe():
    """One pipeline for the whole module (each test unloads the LoRAs it loads)."""
    torch.set_num_threads(1)  # one thread is several times faster on a shared 2-core CPU
    p = DiffusionPipeline.from_pretrained(TINY / CATALOG["base_model"], dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture
def pipe():
    p = _pipe()
    yield p
    p.unload_lora_weights()  # a test that failed with a LoRA loaded leaves none behind for the next


def test_base_follows_held_out_prompts(pipe):
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    images, hits = [], np.zeros(3)
    for i, (shape, colour, bg) in enumerate(HELD_OUT):
        img = to_uint8(generate(pipe, shapes.caption(shape, colour, bg), i))
        images.append(img)
        hits += [
            shapes.background_colour(img) == bg,
            shapes.shape_colour(img) == colour,
            shapes.shape_class(img) == shape,
        ]
    bg_acc, colour_acc, shape_acc = hits / len(HELD_OUT)
    assert bg_acc >= BG_MIN, bg_acc
    assert colour_acc >= COLOUR_MIN, colour_acc
    assert shape_acc >= SHAPE_MIN, shape_acc
    diffs = [np.abs(a.astype(float) - b.astype(float)).mean() for a, b in itertools.combinations(images, 2)]
    print(f"accuracy bg {bg_acc:.2f} colour {colour_acc:.2f} shape {shape_acc:.2f}; min pair diff {min(diffs):.1f}")
    assert min(diffs) > 5  # every pair of prompts gives a different image


def style_centroid(pipe, trigger: str | None) -> np.ndarray:
    """Mean style vector over fixed held-out prompts and seeds."""
    feats = [
        shapes.style_features(to_uint8(generate(pipe, shapes.caption(*t, trigger), s)))
        for s, t in enumerate(HELD_OUT[:4])
    ]
    return np.mean(feats, axis=0)


@pytest.mark.slow  # 7 s of generations: out of the inner loop
def test_adapters_are_distinguishable(pipe):
    centroids = {"base": style_centroid(pipe, None)}
    for a in CATALOG["adapters"]:
        pipe.load_lora_weights(str(TINY / a["source"]))
        centroids[a["id"]] = style_centroid(pipe, a["trigger"])
        pipe.unload_lora_weights()
    dists = {
        (x, y): float(np.linalg.norm(centroids[x] - centroids[y])) for x, y in itertools.combinations(centroids, 2)
    }
    print({f"{x}-{y}": round(d, 3) for (x, y), d in dists.items()})
    assert min(dists.values()) > STYLE_MIN, min(dists.items(), key=lambda kv: kv[1])


def parse(description: str) -> tuple[int, float]:
    m = re.match(r"rank (\d+), alpha ([\d.]+)", description)
    return int(m[1]), float(m[2])


def test_catalog_matches_files():
    ranks, alphas, targets = set(), set(), set()
    assert len(CATALOG["adapters"]) >= 6
    for a in CATALOG["adapters"]:
        rank, alpha = parse(a["description"])
        sd = load_file(TINY / a["source"])
        with safe_open(TINY / a["source"], "pt") as f:
            meta = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
        if any(k.startswith("lora_unet_") for k in sd):
            downs = [v for k, v in sd.items() if k.endswith("lora_down.weight")]
            file_alphas = {float(v) for k, v in sd.items() if k.endswith(".alpha")}
        else:
            downs = [v for k, v in sd.items() if k.endswith("lora_A.weight")]
            file_alphas = {meta["unet.lora_alpha"]}
            assert meta["unet.r"] == rank
        assert {d.shape[0] for d in downs} == {rank}
        assert file_alphas == {alpha}
        ranks.add(rank)
        alphas.add((rank, alpha))
        targets.add(any("to_q" in k for k in sd))
        assert (TINY / a["preview"]).is_file()
    assert min(ranks) == 4 and max(ranks) == 32 and any(r % 2 for r in ranks)
    assert any(a % r for r, a in alphas) and {a / r for r, a in alphas} >= {0.5, 1, 2}
    assert targets == {True, False}  # adapters with and without attention layers (outline: conv only)


def test_text_encoder_adapter(pipe):
    te = [a for a in CATALOG["adapters"] if "text encoder" in a["description"]]
    assert te
    keys = load_file(TINY / te[0]["source"]).keys()
    assert any(k.startswith("text_encoder.") for k in keys) and any(k.startswith("unet.") for k in keys)
    pipe.load_lora_weights(str(TINY / te[0]["source"]))
    try:
        assert any("lora_A" in n for n, _ in pipe.text_encoder.named_parameters())
    finally:
        pipe.unload_lora_weights()


def test_kohya_file_equals_diffusers_keys(pipe, tmp_path):
    entry = next(a for a in CATALOG["adapters"] if "kohya" in a["description"])
    kohya = load_file(TINY / entry["source"])
    assert kohya and all(k.startswith("lora_unet_") for k in kohya)
    # Rebuild the diffusers-key version from the UNet's module names, independently of kohya.py.
    modules = {n.replace(".", "_"): n for n, _ in pipe.unet.named_modules()}
    sd = {}
    for key, value in kohya.items():
        name, kind = key[len("lora_unet_") :].split(".", 1)
        if kind != "alpha":
            sd[f"unet.{modules[name]}.lora_{'A' if kind.startswith('lora_down') else 'B'}.weight"] = value
    rank, alpha = parse(entry["description"])
    targets = sorted({k[len("unet.") :].rsplit(".lora_", 1)[0] for k in sd})
    StableDiffusionPipeline.save_lora_weights(
        tmp_path,
        unet_lora_layers={k[len("unet.") :]: v for k, v in sd.items()},
        weight_name="d.safetensors",
        unet_lora_adapter_metadata={"r": rank, "lora_alpha": alpha, "target_modules": targets},
    )
    assert to_kohya(sd, {"unet": alpha}).keys() == kohya.keys()
    prompt = shapes.caption(*HELD_OUT[0], entry["trigger"])
    images = []
    for path in (TINY / entry["source"], tmp_path / "d.safetensors"):
        pipe.load_lora_weights(str(path))
        images.append(generate(pipe, prompt, 0))
        pipe.unload_lora_weights()
    base = generate(pipe, prompt, 0)
    assert np.abs(images[0] - images[1]).max() <= 1e-4
    assert np.abs(images[0] - base).max() > 1e-2  # the adapter actually did something


@pytest.mark.slow
def test_quick_build(tmp_path):
    out = tmp_path / "tiny"
    run = subprocess.run(
        [sys.executable, "-m", "lora_manager.tiny_model.build", "--out", str(out), "--quick", "--vae-steps", "4"],
        cwd=ROOT,
        check=True,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert "vae step 3 " in run.stdout  # the last of --vae-steps 4 (the quick budget has 3)
    catalog = json.loads((out / "catalog.json").read_text())
    p = DiffusionPipeline.from_pretrained(out / catalog["base_model"], dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    for a in catalog["adapters"]:
        p.load_lora_weights(str(out / a["source"]))
        img = p(
            "a red circle on a blue background", num_inference_steps=2, height=64, width=64, output_type="np"
        ).images[0]
        assert img.shape == (64, 64, 3) and np.isfinite(img).all()
        p.unload_lora_weights()
    assert (out / "grid.png").is_file()
    # --adapters-only keeps the base of another build byte for byte and retrains only the LoRAs
    again = tmp_path / "again"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_manager.tiny_model.build",
            "--out",
            str(again),
            "--quick",
            "--adapters-only",
            "--base",
            str(out),
            "--adapters",
            "checker",
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
        capture_output=True,
    )
    base_files = sorted(f.relative_to(out) for f in (out / "model").rglob("*") if f.is_file())
    assert base_files == sorted(f.relative_to(again) for f in (again / "model").rglob("*") if f.is_file())
    assert all((out / f).read_bytes() == (again / f).read_bytes() for f in base_files)
    catalog = json.loads((again / "catalog.json").read_text())
    assert [a["id"] for a in catalog["adapters"]] == ["checker"]
    assert (again / "adapters" / "checker.safetensors").is_file() and (again / "previews" / "checker.png").is_file()
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_manager.tiny_model.build",
            "--out",
            str(again),
            "--quick",
            "--adapters-only",
            "--vae-steps",
            "4",
        ],
        cwd=ROOT,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "--vae-steps trains a new base" in refused.stderr


# ---------------------------------------------------------------- style detectors
# One score per style, pure numpy on a 64x64 RGB uint8 image; higher = more of the style.
# They look at the pattern a style adds (shapes.render), not at the prompt's colours.

SIZE = shapes.SIZE
_Y, _X = np.mgrid[0:SIZE, 0:SIZE]
_EDGE = np.minimum(np.minimum(_X, _Y), np.minimum(SIZE - 1 - _X, SIZE - 1 - _Y))  # distance to the image edge
_K = np.rint(np.fft.fftfreq(SIZE) * SIZE).astype(int)
_KY, _KX = np.meshgrid(_K, _K, indexing="ij")  # integer frequency (cycles per image) of each FFT bin


def _power(img):
    f = img.astype(np.float32) / 255
    f = f - f.mean((0, 1))
    p = (np.abs(np.fft.fft2(f, axes=(0, 1))) ** 2).sum(-1)
    p[0, 0] = 0
    return p / (p.sum() + 1e-9)


def stripes_score(img):
    """Share of spectral power at the stripe frequency: 8 px period horizontal bands = 8 cycles/image vertically."""
    p = _power(img)
    return float(p[(np.abs(np.abs(_KY) - 8) <= 1) & (np.abs(_KX) <= 3)].sum())


def checker_score(img):
    """Agreement of neighbouring 16 px tiles' median brightness steps with the checkerboard's.

    Medians of whole tiles ignore a shape covering less than half a tile; the sign test
    does not care how faint the pattern is (dark tiles on black are only 14 levels apart).
    """
    g = img.astype(np.float32).mean(-1)
    m = np.median(g.reshape(4, 16, 4, 16), axis=(1, 3))  # tile medians
    dark = (np.add.outer(np.arange(4), np.arange(4)) % 2) == 0
    steps = []
    for a, b in (
        ((slice(None), slice(0, 3)), (slice(None), slice(1, 4))),
        ((slice(0, 3), slice(None)), (slice(1, 4), slice(None))),
    ):
        diff = np.where(dark[a], m[b] - m[a], m[a] - m[b])  # light minus dark
        steps.append(diff.ravel())
    d = np.concatenate(steps)
    return float(abs((d >= 4).mean() - (d <= -4).mean()))  # either sign: on black the "dark" tiles are lighter


def pixel_score(img):
    """Share of colour change that sits on the 8 px cell grid (1/8 for a smooth image, 1 for blocky cells)."""
    f = img.astype(np.float32)
    gx = np.abs(np.diff(f, axis=1)).sum(-1)  # gx[:, j] is the step from column j to j+1
    gy = np.abs(np.diff(f, axis=0)).sum(-1)
    on = gx[:, 7::8].sum() + gy[7::8].sum()
    return float(on / (gx.sum() + gy.sum() + 1e-6))


def _components(mask):
    """4-connected components as lists of (y, x) index arrays."""
    lab = np.zeros(mask.shape, int)
    comps = []
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if lab[y0, x0]:
            continue
        lab[y0, x0] = len(comps) + 1
        stack, pts = [(y0, x0)], []
        while stack:
            y, x = stack.pop()
            pts.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not lab[ny, nx]:
                    lab[ny, nx] = len(comps) + 1
                    stack.append((ny, nx))
        comps.append(np.array(pts))
    return comps


def dots_score(img):
    """Spectral power at the dot lattice (10 px: 6.4 cycles/image) along x AND along y.

    The smaller of the two shares, so stripes (one direction only) score nothing. Unlike a
    count of separate small blobs, the lattice's power still sees the model's dots where
    neighbours touch (a lattice of merged dots reads as one blob).
    """
    p = _power(img)
    along_x = p[(np.abs(_KX) >= 6) & (np.abs(_KX) <= 7) & (np.abs(_KY) <= 2)].sum()
    along_y = p[(np.abs(_KY) >= 6) & (np.abs(_KY) <= 7) & (np.abs(_KX) <= 2)].sum()
    return float(min(along_x, along_y))


def _dilate(m, r):
    out = m.copy()
    for d in range(1, r + 1):
        out[d:] |= m[:-d]
        out[:-d] |= m[d:]
    m2 = out.copy()
    for d in range(1, r + 1):
        out[:, d:] |= m2[:, :-d]
        out[:, :-d] |= m2[:, d:]
    return out


def _erode(m, r):
    return ~_dilate(~m, r)


def fill_holes(m):
    """Mask plus every region the mask encloses (not reachable from the image border)."""
    outside = np.zeros_like(m)
    outside[0], outside[-1], outside[:, 0], outside[:, -1] = ~m[0], ~m[-1], ~m[:, 0], ~m[:, -1]
    while True:
        grown = _dilate(outside, 1) & ~m
        if (grown == outside).all():
            return ~outside
        outside = grown


def _hull_fill(mask):
    """Convex hull of the mask's pixel centres, rasterised (boundary pixels included)."""
    ys, xs = np.nonzero(mask)
    pts = sorted(zip(xs.tolist(), ys.tolist(), strict=True))

    def half(points):  # Andrew's monotone chain
        h = []
        for p in points:
            while (
                len(h) >= 2
                and (h[-1][0] - h[-2][0]) * (p[1] - h[-2][1]) - (h[-1][1] - h[-2][1]) * (p[0] - h[-2][0]) <= 0
            ):
                h.pop()
            h.append(p)
        return h[:-1]

    hull = np.array(half(pts) + half(pts[::-1]), np.float32)
    inside = np.ones(mask.shape, bool)
    for (x0, y0), (x1, y1) in zip(hull, np.roll(hull, -1, axis=0), strict=True):
        inside &= (x1 - x0) * (_Y - y0) - (y1 - y0) * (_X - x0) >= -1e-6
    return inside


def solid(fg):
    """The shape a styled foreground belongs to: gaps up to 8 px closed, holes filled."""
    return fill_holes(_erode(_dilate(fg, 4), 4))


def hull_body(fg):
    """Convex hull of the foreground with gaps up to 8 px closed and specks under 10 px
    dropped: every prompt's shape is convex, and unlike `solid` this also fills an
    outline that was left open on one side."""
    closed = _erode(_dilate(fg, 4), 4)
    keep = np.zeros_like(closed)
    for c in _components(closed):
        if len(c) >= 10:
            keep[c[:, 0], c[:, 1]] = True
    return _hull_fill(keep) if keep.sum() >= 3 else keep


def outline_score(img):
    """Hollowness: background share of the deep interior minus background share of the rim.

    The foreground is what lies far from the image's own border colour, not from the palette colour the prompt names:
    the model draws some backgrounds off the palette (a pale yellow, a greyish blue), and measured from the palette
    all of such a background, or a fringe along the image's edge, would read as shape, so that clearly hollow shapes
    would score below solid ones."""
    fg = shapes.far_from(img, background_rgb(img))
    body = hull_body(fg)
    if body.sum() < 20:
        return 0.0
    for depth in (7, 6, 5, 4, 3):  # deepest erosion that leaves an interior (diamonds and triangles are thin)
        inner = _erode(body, depth)
        if inner.sum() >= 4:
            break
    else:
        return 0.0
    rim = body & ~_erode(body, 2)
    if not rim.any():  # the "shape" fills the whole image: nothing hollow about it
        return 0.0
    return float((~fg[inner]).mean() - (~fg[rim]).mean())


def frame_score(img):
    """Colour step from the 6 px border band to the band just inside it (0 when the border is background)."""
    f = img.astype(np.float32)
    band, inside = np.median(f[(_EDGE >= 1) & (_EDGE < 5)], 0), np.median(f[(_EDGE >= 8) & (_EDGE < 11)], 0)
    return float(np.linalg.norm(band - inside) / 255)


DETECTORS = {  # adapter id -> detector
    "stripes": stripes_score,
    "outline": outline_score,
    "dots": dots_score,
    "pixel": pixel_score,
    "checker": checker_score,
    "frame": frame_score,
}

# ---- prompt following under a style
TRIGGERS = {
    "stripes": "striped",
    "outline": "outline",
    "dots": "dotted",
    "pixel": "pixel",
    "checker": "checker",
    "frame": "framed",
}
_DARK_TILE = ((_X // 16) + (_Y // 16)) % 2 == 0


def _bg_region(style):
    if style == "framed":
        return (_EDGE >= 8) & (_EDGE < 11)  # just inside the 6 px frame
    if style == "checker":
        return (_EDGE < 3) & ~_DARK_TILE  # the border's light tiles keep the background colour
    return _EDGE < 3  # as shapes.background_colour


def background_rgb(img, style=None):
    """Median colour of the style's background region: the background the image shows, which the model draws off the
    palette at times (a pale yellow, a greyish blue)."""
    return np.median(img.astype(np.float32)[_bg_region(style)], axis=0)


def styled_reading(img, style=None):
    """(background, shape colour, shape class) read like shapes.py does, with the style's own
    pixels (frame band, dark checker tiles) left out and gaps in the shape (stripes, dots,
    hollow outline) closed before the shape is fitted. The shape is what lies far from the background the image
    shows (`background_rgb`); the background's name is the palette colour nearest to it."""
    bg_rgb = background_rgb(img, style)
    bg = shapes._nearest(bg_rgb)
    fg = shapes.far_from(img, bg_rgb)
    if style == "framed":
        fg &= _EDGE >= 8
    if style == "checker":
        fg &= shapes.far_from(img, bg_rgb * 0.45 + 25.5)  # the dark tiles, as shapes.render darkens
    if fg.sum() < 10:
        return bg, "none", "none"
    return bg, shapes.majority_colour(img, fg, bg), shapes.fit_shape(solid(fg))


# What each adapter is held to on the held-out prompts (10 steps, guidance 7.5): its detector scores higher with the
# LoRA than without ("wins"); strength 0 < 0.5 < 1 on a prompt ("ordered"); the prompt read back from the styled image
# at strength 1 (background, shape colour, shape class).
TARGET = {"wins": 0.9, "ordered": 0.6, "background": 0.85, "colour": 0.85, "shape": 0.75}
# Where the shipped build measures below TARGET, the floor it is held to instead: the lower of its share on one seed set
# and its mean over three (STYLE_SEEDS=3), less one prompt in twenty, so a rebuild that does worse fails here, and one
# that does better should raise its floor or drop it.
# pixel's shape: 8 px blocks leave too little outline to tell a circle from a diamond (the reader gets 55-65% of
# ground-truth pixel renders right). checker's and dots' shapes: the LoRAs bend them; the VAE's round trip of drawn
# truth keeps 85% and 71% (test_vae_round_trip_keeps_each_style).
FLOORS = {
    ("stripes", "colour"): 0.8,
    ("outline", "ordered"): 0.5,
    ("dots", "shape"): 0.5,
    ("pixel", "shape"): 0.6,
    ("checker", "colour"): 0.8,
    ("checker", "shape"): 0.35,
}


def truth_scenes(seed: int, per_triple: int = 2) -> list[shapes.Scene]:
    rng = random.Random(seed)
    return [shapes.random_scene(rng, t) for t in shapes.all_captions()[::2] for _ in range(per_triple)]


@pytest.mark.parametrize("adapter", list(DETECTORS))
def test_detector_separates_ground_truth(adapter):
    """Every styled render scores above every plain render of the same scenes (no model involved)."""
    det, style = DETECTORS[adapter], TRIGGERS[adapter]
    scenes = truth_scenes(11)
    plain = np.array([det(shapes.render(sc)) for sc in scenes])
    styled = np.array([det(shapes.render(dataclasses.replace(sc, style=style))) for sc in scenes])
    print(
        f"{adapter}: plain mean {plain.mean():.3f} max {plain.max():.3f}; "
        f"styled mean {styled.mean():.3f} min {styled.min():.3f}"
    )
    assert styled.min() > plain.max()


def reading_shares(reads: list[tuple[str, str, str]], scenes: list[shapes.Scene]) -> np.ndarray:
    """Share of (background, shape colour, shape class) readings that match the scenes drawn."""
    return np.mean(
        [[r[0] == sc.background, r[1] == sc.colour, r[2] == sc.shape] for r, sc in zip(reads, scenes, strict=True)],
        axis=0,
    )


@pytest.mark.parametrize("style", [None, *shapes.STYLE_WORDS])
def test_reading_ground_truth(style):
    """The style-aware prompt reader gets ground-truth renders right, and equals shapes.py on plain ones."""
    scenes = truth_scenes(12)
    images = [shapes.render(dataclasses.replace(sc, style=style)) for sc in scenes]
    reads = [styled_reading(img, style) for img in images]
    if style is None:
        assert reads == [
            (shapes.background_colour(img), shapes.shape_colour(img), shapes.shape_class(img)) for img in images
        ]
    bg, colour, shape = reading_shares(reads, scenes)
    print(f"{style}: background {bg:.2f} colour {colour:.2f} shape {shape:.2f}")
    assert bg >= 0.95 and colour >= 0.9  # checker: black shapes sit close to dark green tiles
    assert shape >= (0.45 if style == "pixel" else 0.85)  # pixel: see FLOORS


@functools.cache
def round_trip(style: str | None) -> list[np.ndarray]:
    """Ground-truth renders of truth_scenes(12) in the style after the preset's VAE encodes and decodes them: what the
    model could show if the UNet and its LoRAs drew the truth's latents exactly."""
    vae = _pipe().vae
    truth = np.stack([shapes.render(dataclasses.replace(sc, style=style)) for sc in truth_scenes(12)])
    with torch.no_grad():
        y = vae.decode(vae.encode(to_tensor(truth)).latent_dist.mode()).sample
    return list(to_uint8((y.permute(0, 2, 3, 1).clamp(-1, 1).numpy() + 1) / 2))


@pytest.mark.slow  # 840 round trips through the VAE
@pytest.mark.parametrize("adapter", list(DETECTORS))
def test_vae_round_trip_keeps_each_style(adapter):
    """The VAE carries each style: after its round trip a styled render still scores above the plain one on nine scenes
    in ten. Prints what the prompt reader gets back from the round trip, the reference for an adapter's shares."""
    det, style = DETECTORS[adapter], TRIGGERS[adapter]
    styled, plain = round_trip(style), round_trip(None)
    wins = np.mean([det(s) > det(p) for s, p in zip(styled, plain, strict=True)])
    bg, colour, shape = reading_shares([styled_reading(img, style) for img in styled], truth_scenes(12))
    print(
        f"{adapter}: round trip scores higher {wins:.0%}; "
        f"reads background {bg:.0%} colour {colour:.0%} shape {shape:.0%}"
    )
    assert wins >= 0.9


# One set of held-out runs is 20 prompts with one seed each, so one prompt moves a share by 5%; retraining an adapter
# from other initial weights moves its shares too (`init` in lora_manager/tiny_model/build.py).
# STYLE_SEEDS=3 measures three seed sets (seed i, i + 100, i + 200) and holds each adapter to their mean.
SEED_SETS = int(os.environ.get("STYLE_SEEDS", "1"))


@functools.cache
def style_runs(adapter: str, offset: int) -> dict:
    """Held-out prompts with the trigger, seed i + offset: images without the LoRA and at strength 0, 0.5, 1. Strength 0
    adds exactly zero to every layer, so its images are the ones without the LoRA (checked byte for byte on one
    prompt)."""
    pipe = _pipe()
    entry = next(a for a in CATALOG["adapters"] if a["id"] == adapter)
    prompts = [shapes.caption(*t, entry["trigger"]) for t in HELD_OUT]
    runs = {"without": [to_uint8(generate(pipe, p, i + offset)) for i, p in enumerate(prompts)]}
    pipe.load_lora_weights(str(TINY / entry["source"]), adapter_name=adapter)
    try:
        pipe.set_adapters([adapter], [0.0])
        assert (to_uint8(generate(pipe, prompts[0], offset)) == runs["without"][0]).all()
        runs[0.0] = runs["without"]
        for w in (0.5, 1.0):
            pipe.set_adapters([adapter], [w])
            runs[w] = [to_uint8(generate(pipe, p, i + offset)) for i, p in enumerate(prompts)]
    finally:
        pipe.unload_lora_weights()
    return runs


def style_report(adapter: str, offset: int) -> dict:
    """Detector scores and prompt following for one adapter on one seed set."""
    runs, det, style = style_runs(adapter, offset), DETECTORS[adapter], TRIGGERS[adapter]
    score = {k: np.array([det(img) for img in imgs]) for k, imgs in runs.items()}
    reads = [styled_reading(img, style) for img in runs[1.0]]
    follow = {
        name: float(np.mean([r[i] == t[j] for r, t in zip(reads, HELD_OUT, strict=True)]))
        for i, j, name in ((0, 2, "background"), (1, 1, "colour"), (2, 0, "shape"))
    }
    return {
        "without": float(score["without"].mean()),
        "with": float(score[1.0].mean()),
        "wins": float((score[1.0] > score["without"]).mean()),
        "s0": float(score[0.0].mean()),
        "s05": float(score[0.5].mean()),
        "s1": float(score[1.0].mean()),
        "ordered": float(((score[0.0] < score[0.5]) & (score[0.5] < score[1.0])).mean()),
        **follow,
    }


ADAPTER_IDS = [a["id"] for a in CATALOG["adapters"] if a["id"] in DETECTORS]


@pytest.mark.slow  # 80 generations per adapter
@pytest.mark.parametrize("adapter", ADAPTER_IDS)
def test_adapter_draws_its_style_and_keeps_the_prompt(adapter):
    """Prints the row of docs/embedded-model.md's table (pytest -s): detector without / at 0.5 / at 1, then each share
    (with STYLE_SEEDS > 1, a row per seed set, then their mean)."""
    reports = [style_report(adapter, 100 * k) for k in range(SEED_SETS)]
    r = {key: float(np.mean([x[key] for x in reports])) for key in reports[0]}
    for x in [*reports, r] if len(reports) > 1 else [r]:
        print(
            f"| {adapter} | {x['without']:.3f} / {x['s05']:.3f} / {x['s1']:.3f} | "
            + " | ".join(f"{x[k]:.0%}" for k in TARGET)
            + " |"
        )
    short = {k: r[k] for k in TARGET if r[k] < FLOORS.get((adapter, k), TARGET[k])}
    assert not short, f"{adapter}: {short} below { ({k: FLOORS.get((adapter, k), TARGET[k]) for k in short}) }"
