"""Procedural captioned dataset (shapes x colours x backgrounds) and the metrics.

The data is procedural so the model can be retrained offline from a seed, and
so every image the model makes can be scored against its prompt by pixels:
background colour from the border, shape colour by nearest palette entry,
shape class by IoU against ideal outlines, and a style feature vector.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np

SIZE = 64  # image side in pixels: small enough to train on a 2-core CPU
SHAPES = ("circle", "square", "triangle", "diamond")
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
HOLDOUT = 20  # captions never seen in training, used to test generalisation
HOLDOUT_SEED = 0  # fixed apart from the build seed so tests know the split
STYLE_WORDS = ("striped", "outline", "dotted", "pixel", "checker", "framed")
FRAME_RGB = (230, 40, 230)  # magenta: not in the palette, so the frame is unmistakable


@dataclass(frozen=True)
class Scene:
    """One drawable caption: what to draw, where, and in which style."""

    shape: str
    colour: str
    background: str
    cx: float
    cy: float
    r: float
    style: str | None = None

    @property
    def caption(self) -> str:
        base = f"a {self.colour} {self.shape} on a {self.background} background"
        return f"{base}, {self.style}" if self.style else base


def all_captions() -> list[tuple[str, str, str]]:
    """All (shape, colour, background) triples with colour != background (120)."""
    return [(s, c, b) for s, c, b in itertools.product(SHAPES, PALETTE, PALETTE) if c != b]


def split_captions() -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(train, held-out) triples; fixed split so tests can probe unseen prompts."""
    triples = all_captions()
    held = set(random.Random(HOLDOUT_SEED).sample(range(len(triples)), HOLDOUT))
    train = [t for i, t in enumerate(triples) if i not in held]
    return train, [triples[i] for i in sorted(held)]


def caption(shape: str, colour: str, background: str, style: str | None = None) -> str:
    """Prompt text for a triple, with the style trigger appended when given."""
    return Scene(shape, colour, background, 0, 0, 0, style).caption


def shape_mask(shape: str, cx: float, cy: float, r: float, size: int = SIZE) -> np.ndarray:
    """Boolean mask of an ideal shape; every shape spans the same 2r x 2r box."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = x - cx, y - cy
    if shape == "circle":
        return dx**2 + dy**2 <= r**2
    if shape == "square":
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= r
    if shape == "triangle":  # apex up, base at the bottom of the box
        return (np.abs(dy) <= r) & (np.abs(dx) <= (dy + r) / 2)
    raise ValueError(shape)


def random_scene(rng: random.Random, triple: tuple[str, str, str], style: str | None = None) -> Scene:
    """Random size and position, always fully inside the frame margin."""
    r = rng.uniform(11, 22)  # radius range keeps shapes readable at 16x16 latents
    lo, hi = r + 9, SIZE - r - 9  # 9 px margin leaves room for the frame style
    return Scene(*triple, rng.uniform(lo, hi), rng.uniform(lo, hi), r, style)


def render(scene: Scene) -> np.ndarray:
    """HxWx3 uint8 image of the scene in its style."""
    fg, bg = np.array(PALETTE[scene.colour]), np.array(PALETTE[scene.background])
    mask = shape_mask(scene.shape, scene.cx, scene.cy, scene.r)
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    img = np.empty((SIZE, SIZE, 3), np.float32)
    img[:] = bg
    paint = mask
    if scene.style == "striped":  # horizontal bands, 4 px on / 4 px off
        paint = mask & ((y // 4) % 2 == 0)
    elif scene.style == "outline":  # 4 px ring, hollow inside
        inner = shape_mask(scene.shape, scene.cx, scene.cy, max(scene.r - 5, 1))
        paint = mask & ~inner
    elif scene.style == "dotted":  # round dots on a 10 px lattice
        paint = mask & (((x % 10) - 4.5) ** 2 + ((y % 10) - 4.5) ** 2 <= 9)
    elif scene.style == "checker":  # 16 px dark/light checkerboard background
        dark = ((x // 16) + (y // 16)) % 2 == 0
        img[dark] = bg * 0.45 + 255 * 0.1
    img[paint] = fg
    if scene.style == "pixel":  # 8 px blocks, each the colour at its centre
        img = img[4::8, 4::8].repeat(8, 0).repeat(8, 1)
    elif scene.style == "framed":  # 6 px magenta frame
        border = (x < 6) | (x >= SIZE - 6) | (y < 6) | (y >= SIZE - 6)
        img[border] = FRAME_RGB
    return img.round().clip(0, 255).astype(np.uint8)


# ---------------------------------------------------------------- metrics


def _nearest(rgb: np.ndarray, exclude: str | None = None) -> str:
    names = [n for n in PALETTE if n != exclude]
    d = [np.linalg.norm(rgb - np.array(PALETTE[n])) for n in names]
    return names[int(np.argmin(d))]


def background_colour(img: np.ndarray) -> str:
    """Palette name of the median colour of the 3 px border."""
    f = img.astype(np.float32)
    border = np.concatenate(
        [f[:3].reshape(-1, 3), f[-3:].reshape(-1, 3), f[:, :3].reshape(-1, 3), f[:, -3:].reshape(-1, 3)]
    )
    return _nearest(np.median(border, axis=0))


def far_from(img: np.ndarray, rgb: np.ndarray) -> np.ndarray:
    """Mask of pixels far (> 100 in RGB distance) from the colour `rgb`."""
    return np.linalg.norm(img.astype(np.float32) - rgb, axis=-1) > 100


def foreground(img: np.ndarray, bg: str | None = None) -> np.ndarray:
    """Mask of pixels far from the background's palette colour."""
    return far_from(img, np.array(PALETTE[bg or background_colour(img)]))


def shape_colour(img: np.ndarray) -> str:
    """Majority nearest palette entry (not the background) over foreground pixels."""
    bg = background_colour(img)
    fg = foreground(img, bg)
    if fg.sum() < 10:
        return "none"
    return majority_colour(img, fg, bg)


def majority_colour(img: np.ndarray, fg: np.ndarray, bg: str) -> str:
    """Majority nearest palette entry (not `bg`) over the pixels of mask `fg`."""
    pix = img[fg].astype(np.float32)
    names = [n for n in PALETTE if n != bg]
    d = np.stack([np.linalg.norm(pix - np.array(PALETTE[n]), axis=-1) for n in names])
    return names[int(np.bincount(d.argmin(0), minlength=len(names)).argmax())]


def shape_class(img: np.ndarray) -> str:
    """Shape whose ideal mask, fitted to the foreground's box, has the best IoU."""
    fg = foreground(img)
    if fg.sum() < 10:
        return "none"
    return fit_shape(fg)


def fit_shape(mask: np.ndarray) -> str:
    """Shape whose ideal mask, fitted to `mask`'s box, has the best IoU with it."""
    ys, xs = np.nonzero(mask)
    x0, x1 = np.percentile(xs, [1, 99])  # trimmed box ignores stray pixels
    y0, y1 = np.percentile(ys, [1, 99])
    cx, cy, r = (x0 + x1 + 1) / 2, (y0 + y1 + 1) / 2, max(x1 - x0 + 1, y1 - y0 + 1) / 2
    iou = {}
    for s in SHAPES:
        m = shape_mask(s, cx, cy, r)
        iou[s] = (m & mask).sum() / max((m | mask).sum(), 1)
    return max(iou, key=iou.get)


def style_features(img: np.ndarray) -> np.ndarray:
    """Pattern descriptor: spectrum bands, edge density, frame colour, contrast.

    Styles differ in texture (stripes/dots/checker/pixel), in where colour
    sits (outline, frame) rather than in what is drawn, so the vector looks at
    frequencies and layout and not at the caption's colours.
    """
    f = img.astype(np.float32) / 255
    g = f.mean(-1)
    spec = np.abs(np.fft.fft2(g - g.mean()))
    spec /= spec.sum() + 1e-6
    k = np.abs(np.fft.fftfreq(SIZE) * SIZE)
    kx, ky = np.meshgrid(k, k)
    bands = [(1, 3), (3, 5), (5, 7), (7, 9), (9, 33)]  # cycles per image
    fy = [spec[(ky >= a) & (ky < b) & (kx < 2)].sum() for a, b in bands]  # horizontal bands
    fx = [spec[(kx >= a) & (kx < b) & (ky < 2)].sum() for a, b in bands]  # vertical bands
    fd = [spec[(kx >= a) & (kx < b) & (ky >= a) & (ky < b)].sum() for a, b in bands]  # diagonal
    gx, gy = np.abs(np.diff(g, axis=1)), np.abs(np.diff(g, axis=0))
    edges = [gx.mean(), gy.mean(), (gx > 0.15).mean(), (gy > 0.15).mean()]
    block = [gx[:, 7::8].mean() / (gx.mean() + 1e-6) / 8]  # edges sitting on the 8 px grid
    magenta = np.linalg.norm(f - np.array(FRAME_RGB) / 255, axis=-1) < 0.25
    ring = np.zeros_like(magenta)
    ring[:6], ring[-6:], ring[:, :6], ring[:, -6:] = True, True, True, True
    fgm = foreground(img)
    fill = [fgm.mean(), magenta[ring].mean(), g.std()]
    return np.array(fy + fx + fd + edges + block + fill, np.float32) * 4
