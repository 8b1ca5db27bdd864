"""visiontune: fine-tune torchvision and timm image classifiers on a folder of images, on one CPU or
many GPUs, with the same command.

Python API::

    summary = visiontune.train(visiontune.TrainConfig(data="data", model="resnet18"))
    run = visiontune.load("runs/x")            # a trained run (or a best.safetensors file)
    run.predict(["a.jpg", pil_image, tensor])  # one row per image: label and probabilities
    run.evaluate("data/val")                   # metrics on a labelled folder

The wings (``cli``, ``inference``, ``training``, ``runs``, ``reports``, ``data``, ``cluster``,
``settings``, ``models``) are described in ``docs/architecture.md``.
"""

from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.version import __version__

__all__ = ["TrainConfig", "UserError", "load", "train", "__version__"]


def train(config: TrainConfig) -> dict:
    """Run one training job as ``visiontune train`` runs it (in this process, or under its own launcher for
    ``strategy="ddp"``/``"fsdp"`` with several processes) and return its summary (``summary.json``'s
    contents); a job that fails raises ``UserError``."""
    from visiontune.settings.validation import validate
    from visiontune.training import job

    return job.summary_of(job.run(validate(config)))


def load(path: str):
    """A trained run folder or model file, loaded once: ``.predict(images)`` and ``.evaluate(folder)``."""
    from visiontune.inference.api import Predictor

    return Predictor.load(path)
