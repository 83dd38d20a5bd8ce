"""Images through a vision-language base model: its processor, its placeholder, its positions.

A base model folder with a ``preprocessor_config.json`` and a ``vision_config`` in its
``config.json`` (Qwen2.5-VL) is a vision model (``has_vision``); every other model renders an
image part as ``[image]`` (``chat.text_only_image``). For a vision model an image part renders as
``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>`` (``image_text``), N =
grid_t * grid_h * grid_w // merge_size**2 from the processor's grid for that image. The same
rendering (``chat.segments`` with an ``image`` hook) serves curation's counts
(``Vision.num_tokens``: the grid from the image's size alone, no pixels), the trainer's encode
and label mask (``encode``: the pixels too) and the inference server (``expand_pads`` over the
Jinja twin's one pad per image). tests/factory/test_vision.py holds the three equal.

Images come from the factory's blob store by sha256 (``blob_path``: ``<root>/<aa>/<sha256>``,
the layout of ``factory.blobs.BlobStore``, which the trainer may not import; the test holds the
two equal). An image whose bytes are not there (a missing blob, or a remote URL ingest did not
fetch) raises ``MissingImage``: the trainer and curation drop the sample with that reason
(``missing_image``), the server answers 400.

The processor is loaded in its PIL backend: torchvision does not import beside the CPU torch
here, and the PIL backend needs nothing else.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .chat import IGNORE_INDEX, VISION_PLACEHOLDER
from .chat import encode as encode_text

if TYPE_CHECKING:
    import torch

IMAGE_START = "<|vision_start|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_END = "<|vision_end|>"
assert VISION_PLACEHOLDER == IMAGE_START + IMAGE_PAD + IMAGE_END

ImageReader = Callable[[str], bytes]
"""The bytes of the image with this sha256, or ``MissingImage``."""


class MissingImage(ValueError):
    """An image part whose bytes cannot be had: not in the blob store, or a remote URL."""


def has_vision(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a vision-language model: an image processor's
    ``preprocessor_config.json`` beside a ``config.json`` with a ``vision_config``."""
    folder = Path(model_dir)
    config = folder / "config.json"
    if not (folder / "preprocessor_config.json").is_file() or not config.is_file():
        return False
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return False


def blob_path(root: str | Path, sha256: str) -> Path:
    """Where the blob store under ``root`` keeps the bytes whose sha256 is ``sha256``."""
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise MissingImage(f"image: not a sha256 hex digest: {sha256!r}")
    return Path(root) / sha256[:2] / sha256


def blob_reader(root: str | Path | None) -> ImageReader:
    """An ``ImageReader`` over the blob store folder ``root`` (None: every image is missing)."""

    def read(sha256: str) -> bytes:
        if root is None:
            raise MissingImage(f"image {sha256}: no blob store given (the job's blob_dir)")
        try:
            return blob_path(root, sha256).read_bytes()
        except FileNotFoundError:
            raise MissingImage(f"image {sha256}: not in the blob store {root}") from None

    return read


def image_text(num_tokens: int) -> str:
    """An image of ``num_tokens`` tokens as the model reads it."""
    return IMAGE_START + IMAGE_PAD * num_tokens + IMAGE_END


@dataclass(frozen=True, kw_only=True)
class ImageInput:
    """One image as the processor gives it to the model."""

    pixel_values: torch.Tensor
    """[patches, channels x temporal_patch x patch x patch] flattened patches."""
    grid_thw: torch.Tensor
    """[1, 3] the patch grid: temporal, height, width."""
    num_tokens: int
    """``<|image_pad|>`` tokens it takes: the grid's size over ``merge_size**2``."""


class Vision:
    """A vision model's image processor (PIL backend) with a reader of image bytes."""

    def __init__(self, model_dir: str | Path, read: ImageReader) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
        self.merge = int(self.processor.merge_size)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.image_token_id = int(config["image_token_id"])
        self.read = read

    def image_bytes(self, part: dict[str, Any]) -> bytes:
        sha256 = part.get("sha256")
        if isinstance(sha256, str):
            return self.read(sha256)
        url = part.get("url")
        if url is None and isinstance(part.get("image_url"), dict):
            url = part["image_url"].get("url")
        if url:
            raise MissingImage(f"image {str(url)[:80]}: a remote image is not fetched (only "
                               f"images stored in the blob store are read)")
        raise MissingImage("image: the part has no sha256")

    @staticmethod
    def _open(data: bytes) -> Any:
        # Pillow: read only for a vision model's images
        from PIL import Image, UnidentifiedImageError

        try:
            return Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"image: not a readable image ({e})") from None

    def num_tokens(self, part: dict[str, Any]) -> int:
        """Tokens of the image of ``part``, from its size alone (the processor's resize rule)."""
        width, height = self._open(self.image_bytes(part)).size
        return int(self.processor.get_number_of_image_patches(height, width, {})) \
            // self.merge ** 2

    def image(self, part: dict[str, Any]) -> ImageInput:
        """The processor's input for the image of ``part``."""
        return self.process(self.image_bytes(part))

    def process(self, data: bytes) -> ImageInput:
        """The processor's input for the image file ``data``."""
        img = self._open(data).convert("RGB")
        out = self.processor(images=[img], return_tensors="pt")
        grid = out["image_grid_thw"]
        return ImageInput(pixel_values=out["pixel_values"], grid_thw=grid,
                          num_tokens=int(grid.prod()) // self.merge ** 2)


def load_vision(base_model: str, blob_dir: str | Path | None) -> Vision | None:
    """The ``Vision`` of ``base_model`` reading images from ``blob_dir``; None for a model
    without a vision tower (its images stay ``[image]``)."""
    if not has_vision(base_model):
        return None
    return Vision(base_model, blob_reader(blob_dir))


def encode(messages: Any, tools: Any, tokenizer: Any, vision: Vision
           ) -> tuple[list[int], list[int], list[ImageInput]]:
    """``chat.encode`` with each image rendered by ``vision``: ids, labels (never an image
    token) and the images in the order their tokens appear."""
    images: list[ImageInput] = []

    def render(part: dict[str, Any]) -> str:
        x = vision.image(part)
        images.append(x)
        return image_text(x.num_tokens)

    ids, labels = encode_text(messages, tools, tokenizer, image=render)
    labels = [IGNORE_INDEX if t == vision.image_token_id else lab
              for t, lab in zip(ids, labels, strict=True)]
    return ids, labels, images


def expand_pads(text: str, images: Sequence[ImageInput]) -> str:
    """The Jinja twin's rendering (one ``VISION_PLACEHOLDER`` per image) with each image's
    pads expanded to its tokens: ``chat.render`` with the images' ``image_text``."""
    pieces = text.split(VISION_PLACEHOLDER)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"messages: the chat template wrote {len(pieces) - 1} image "
                         f"placeholders for {len(images)} images")
    out = [pieces[0]]
    for img, rest in zip(images, pieces[1:], strict=True):
        out += [image_text(img.num_tokens), rest]
    return "".join(out)


def stack(images: Sequence[ImageInput]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``pixel_values`` and ``image_grid_thw`` of ``images`` in order (None, None: none)."""
    import torch

    if not images:
        return None, None
    return (torch.cat([x.pixel_values for x in images]),
            torch.cat([x.grid_thw for x in images]))
