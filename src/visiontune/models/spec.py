"""What every model source describes the same way: a ``ModelSpec`` (how to build it, its head, the
preprocessing its weights expect) and the weight-file suffixes. The torchvision builders
(``build``) and the timm/Hub ones (``timm_models``) both import these, so neither imports the other's
types; and the one message for a name no source knows, which ``build`` and ``names`` both give.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

IMAGENET_CLASSES = 1000

UNKNOWN = "unknown model {!r}; see `visiontune models` (timm models: timm/NAME, Hub models: hf-hub:ORG/NAME)"


SOURCES = ("torchvision", "timm", "hf-hub")
# The modes visiontune's resize offers for uint8 tensors (PIL-only ones, lanczos/box/hamming, are not among them).
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "nearest-exact")
# The largest image side a model is fed: the bound a model file's description and a Hub config are held to.
MAX_IMAGE_SIZE = 4096


WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt")


@dataclass(frozen=True)
class Preprocess:
    """What the model's pretrained weights were trained with."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str  # torchvision InterpolationMode value: bilinear, bicubic, ...
    crop_pct: float
    # The model is built for one input size (ViT, Swin: position embeddings over a fixed patch grid;
    # timm's ``fixed_input_size``): another --image-size builds it for that size.
    fixed_size: bool = False


@dataclass(frozen=True)
class ModelSpec:
    name: str  # as given to --model
    source: str  # torchvision | timm | hf-hub
    arch: str  # the source's own name
    preprocess: Preprocess

    def resized_from(self, image_size: int | None) -> int | None:
        """The pretrained input size this model is rebuilt from for ``image_size`` (its position embeddings
        resized), or None: a model that takes any size, or one asked at its own."""
        if not self.preprocess.fixed_size or image_size in (None, self.preprocess.size):
            return None
        return self.preprocess.size


def is_weights_file(weights: str) -> bool:
    return Path(weights).suffix in WEIGHT_SUFFIXES
