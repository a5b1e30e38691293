"""Camera-like JPEG photos made from fixed seeds: no download, the same bytes on every run.

    python -m examples.image_classifier.photos OUT_DIR [--count 16] [--width 640] [--height 480] [--quality 85]

A photo is what a self-checkout camera sends: 640 x 480, baseline JPEG, about 45 KB. Plain noise
compresses badly (a few hundred KB) and plain gradients too well (a few KB); what is drawn here
sits between, as a photo does: a smooth background (a few random colour fields, upsampled), a few
dozen soft-edged shapes (the "objects"), and a little fine grain (sensor noise). `GRAIN` and the
quality set the size; `make` checks each photo is 35-55 KB and says which size it got.

The bytes depend on the seed, numpy's generator (PCG64, stable across numpy versions) and the
JPEG encoder libjpeg-turbo bundled with Pillow: another Pillow may give slightly different bytes,
never a different kind of photo. The benchmark writes the sizes it used into its results page.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

GRAIN = 4.7  # standard deviation of the fine grain, in 0-255 units
SHAPES = 40
MIN_BYTES, MAX_BYTES = 35_000, 55_000


def photo(seed: int, *, width: int = 640, height: int = 480, quality: int = 85, grain: float = GRAIN) -> bytes:
    """One photo's JPEG bytes, from `seed` alone."""
    rng = np.random.default_rng(seed)
    # Background: a 6 x 8 field of colours, smoothly upsampled (light and walls, out of focus).
    field = rng.integers(40, 220, size=(6, 8, 3), dtype=np.uint8)
    image = Image.fromarray(field, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    # Objects: soft-edged ellipses and boxes of random colours (the things on the belt).
    draw = ImageDraw.Draw(image)
    for _ in range(SHAPES):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        w, h = int(rng.integers(20, width // 3)), int(rng.integers(20, height // 3))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        box = (x0, y0, min(width - 1, x0 + w), min(height - 1, y0 + h))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(1.5))
    # Sensor grain: fine noise, what makes a photo cost tens of KB rather than a few.
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0.0, grain, size=(height, width, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality, optimize=False, progressive=False)
    return out.getvalue()


def make(folder: Path, count: int, **options: int) -> list[int]:
    """`count` photos as folder/photo-NN.jpg; their sizes. Refuses sizes outside MIN_BYTES..MAX_BYTES."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes = []
    for seed in range(count):
        data = photo(seed, **options)
        if not MIN_BYTES <= len(data) <= MAX_BYTES:
            raise SystemExit(f"photo {seed}: {len(data)} bytes, outside {MIN_BYTES}-{MAX_BYTES}: change GRAIN")
        (folder / f"photo-{seed:02d}.jpg").write_bytes(data)
        sizes.append(len(data))
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--quality", type=int, default=85)
    args = parser.parse_args()
    sizes = make(args.out, args.count, width=args.width, height=args.height, quality=args.quality)
    print(f"{len(sizes)} photos in {args.out}: {min(sizes)}-{max(sizes)} bytes, mean {sum(sizes) / len(sizes):.0f}")


if __name__ == "__main__":
    main()
