"""Opening the pictures of a dataset: every one is checked before training, and fitted to the pixel budget.

A missing, unreadable, truncated or enormous image stops the run before its first step, naming the data file, the
row and the image (an error at step 4,000 of a night's run costs the night). "Enormous" is more pixels than
:data:`MAX_IMAGE_PIXELS` (a 100-megapixel scan, or a decompression bomb: a few kilobytes of PNG that unpack to
gigabytes), checked from the header before any pixel is decoded. An image over the run's pixel budget is scaled
down, keeping its aspect ratio, before the processor sees it; the processor then resizes it the way its model
expects (tiles, patches of 28 pixels...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import DataError

MAX_IMAGE_PIXELS = 64_000_000
"""Above this an image is refused, not resized: decoding it alone takes hundreds of megabytes (RGB, 3 bytes a pixel)."""


DAMAGED = "the file is damaged or cut short; export it again"


@dataclass(frozen=True)
class ImageRef:
    """An image a row names: the file, and where it was named (for errors)."""

    path: Path
    data_file: str
    row: int
    named: str
    """The image as the row wrote it (a path relative to the data file, usually)."""

    def problem(self, message: str, hint: str | None = None) -> DataError:
        return DataError(f"image {self.named!r} ({self.path}): {message}", path=self.data_file, row=self.row, hint=hint)


def check_image(ref: ImageRef) -> tuple[int, int]:
    """The image's (width, height) once it opens and decodes whole; a :class:`DataError` naming it otherwise."""
    image = _open(ref)
    try:
        image.load()
    except OSError as err:  # Pillow: "image file is truncated", broken data streams
        raise ref.problem(
            f"cannot be decoded ({err})", hint="the file is damaged or cut short; export it again"
        ) from err
    finally:
        image.close()
    width, height = image.size
    return int(width), int(height)


def load_image(ref: ImageRef, max_pixels: int) -> Any:
    """The image in RGB, scaled down to at most ``max_pixels`` pixels (aspect ratio kept)."""
    image = _open(ref)
    try:
        _decode_smaller(image, max_pixels)
        rgb = image.convert("RGB")
    except OSError as err:
        raise ref.problem(
            f"cannot be decoded ({err})", hint="the file is damaged or cut short; export it again"
        ) from err
    finally:
        image.close()
    return fit_to_budget(rgb, max_pixels)


def _decode_smaller(image: Any, max_pixels: int) -> None:
    """Let a JPEG decode at 1/2, 1/4 or 1/8 scale where that still covers the budget (its DCT scaling: a 12-megapixel
    photo for a 0.8-megapixel budget decodes at a quarter of the size, several times faster); the Lanczos resize
    of :func:`fit_to_budget` then makes the exact size. Other formats decode whole."""
    width, height = image.size
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        image.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))


def fit_to_budget(image: Any, max_pixels: int) -> Any:
    """``image`` scaled down (Lanczos) so that width x height <= ``max_pixels``; unchanged when it already fits."""
    from PIL import Image

    width, height = image.size
    if width * height <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (width * height))
    size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
    return image.resize(size, Image.Resampling.LANCZOS)


def _open(ref: ImageRef) -> Any:
    from PIL import Image, UnidentifiedImageError

    if not ref.path.is_file():
        raise ref.problem("no such file", hint="image paths are relative to the data file's folder")
    try:
        image = Image.open(ref.path)
    except UnidentifiedImageError:
        raise ref.problem("is not an image Pillow can read", hint="use PNG, JPEG, WebP, GIF, BMP or TIFF") from None
    except Image.DecompressionBombError as err:
        raise ref.problem(f"is enormous ({err})", hint="scale it down before training") from None
    except OSError as err:
        raise ref.problem(f"cannot be read ({err.strerror or err})") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        image.close()
        raise ref.problem(
            f"is enormous: {width}x{height} pixels, over the limit of {MAX_IMAGE_PIXELS // 1_000_000} megapixels",
            hint="scale it down before training",
        )
    return image


class ImageCache:
    """Pictures already fitted to the budget, kept in memory up to ``max_bytes`` (RGB, 3 bytes a pixel) so that later
    epochs skip the decoding and resizing: a 12-megapixel JPEG takes 0.1-1 s of CPU time to fit, every step it is in.
    Once full it keeps what it holds and loads the rest each time."""

    def __init__(self, max_pixels: int, max_bytes: int = 1 << 30) -> None:
        self.max_pixels = max_pixels
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._images: dict[Path, Any] = {}

    def load(self, ref: ImageRef) -> Any:
        image = self._images.get(ref.path)
        if image is not None:
            return image
        image = load_image(ref, self.max_pixels)
        size = image.size[0] * image.size[1] * 3
        if self.held_bytes + size <= self.max_bytes:
            self._images[ref.path] = image
            self.held_bytes += size
        return image
