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


def train(config: TrainConfig, on_epoch=None) -> dict:
    """Run one training job as ``visiontune train`` runs it (in this process, or under its own launcher for
    ``strategy="ddp"``/``"fsdp"`` with several processes) and return its summary (``summary.json``'s
    contents); a job that fails raises ``UserError``.

    ``on_epoch(epoch, row)``, called after each epoch's files and checkpoint are written: ``epoch`` counted
    from 1 as the console prints it ("Epoch 1/3"), ``row`` that epoch's figures as ``history.json`` holds them
    (``row["val"]["accuracy"]``, ``row["val"]["loss"]``, ``row["train"]``, ``row["lr"]``). A string it returns
    ends the run after that epoch, that string its reason (``summary["stopped"]``); None goes on. It runs in
    this process, so a job of several processes cannot take it."""
    from visiontune import tasks
    from visiontune.settings.validation import validate
    from visiontune.training import job

    config = validate(config, tasks.get)
    if on_epoch is None:
        return job.summary_of(job.run(config))
    from visiontune.cluster import launch

    if launch.needs_launcher(config):
        raise UserError(
            f"on_epoch runs in this process, and strategy={config.strategy!r} starts worker processes; "
            "train with nproc=1, or read each epoch from the run folder's history.json"
        )
    import copy

    def counted_from_1(epoch: int, row: dict):
        # The trainer counts epochs from 0 inside; the caller sees them as the console and the files count them,
        # in a copy of the row, which the run keeps recording.
        return on_epoch(epoch + 1, {**copy.deepcopy(row), "epoch": epoch + 1})

    return job.summary_of(job.run(config, on_epoch=counted_from_1))


def load(path: str):
    """A trained run folder or model file, loaded once: ``.predict(images)`` and ``.evaluate(folder)``."""
    from visiontune.inference.api import Predictor

    return Predictor.load(path)
