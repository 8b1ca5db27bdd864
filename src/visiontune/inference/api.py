"""The Python API over a trained model: ``visiontune.load(path)`` returns a ``Predictor``.

``Predictor.predict`` takes paths, encoded bytes, PIL images or uint8 [3, H, W] tensors and runs
them through the code ``visiontune predict`` runs (``loaded.forward``: the run's resize, its
normalisation on the device, the same forward pass), so a path gives the probabilities the CLI
writes for it. ``Predictor.evaluate`` is ``visiontune evaluate`` on a labelled folder, returning
the report it writes. The model is loaded once.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from visiontune.cluster.launch import threads_choice
from visiontune.errors import UserError
from visiontune.inference import loaded as inference
from visiontune.inference import tta
from visiontune.inference.evaluate import evaluate, run_data
from visiontune.inference.loaded import InferenceConfig, LoadedModel, load_model
from visiontune.tasks import UNREADABLE

Image = str | os.PathLike | bytes | torch.Tensor  # or a PIL image, converted to a tensor here


def _check_tensor(image: torch.Tensor) -> torch.Tensor:
    """A tensor image as ``predict`` reads it, or ValueError saying what it must be (a wrong argument, as
    torchvision and PIL treat one: it is not a bad file to skip)."""
    dtype, shape = image.dtype, list(image.shape)
    if dtype == torch.uint8 and len(shape) == 3 and shape[0] == 3 and shape[1] > 0 and shape[2] > 0:
        return image
    hint = ""
    if len(shape) == 3 and shape[-1] == 3 and shape[0] != 3:
        hint = "; an [H, W, 3] image: image.permute(2, 0, 1)"
    elif dtype.is_floating_point:
        hint = "; a float image in [0, 1]: (image * 255).round().to(torch.uint8)"
    raise ValueError(f"a tensor image must be uint8 [3, H, W] with H, W > 0 (RGB, 0-255), got {dtype} {shape}{hint}")


def _as_source(image) -> str | bytes | torch.Tensor:
    """What the loader reads: a path or bytes as they are, a PIL image as its RGB uint8 tensor."""
    if isinstance(image, torch.Tensor):
        return _check_tensor(image)
    if isinstance(image, (str, os.PathLike, bytes, bytearray)):
        return os.fspath(image) if isinstance(image, os.PathLike) else image
    if hasattr(image, "convert") and hasattr(image, "mode"):  # a PIL image, without importing PIL here
        from torchvision.transforms.v2.functional import pil_to_tensor

        return pil_to_tensor(image.convert("RGB"))
    raise UserError(f"cannot predict on a {type(image).__name__}: give paths, bytes, PIL images or uint8 tensors")


@dataclass
class Predictor:
    """A trained model and how to feed it; ``classes``, ``image_size`` and ``info`` describe it."""

    loaded: LoadedModel
    run_dir: str | None = None  # set when loaded from a run folder: its own data and split are known
    # The model's threads, chosen once when it is loaded (cores and load: ``launch.threads_choice``) rather than
    # at each call, where looking at the machine's load would cost a one-image call a fifth of its time.
    threads: int = field(default_factory=lambda: threads_choice()[0])

    @classmethod
    def load(cls, path: str | os.PathLike) -> Predictor:
        """A run folder (its best model) or a self-describing model file (``best.safetensors``); the
        forward pass runs where ``visiontune predict`` would (a GPU when there is one)."""
        path = os.fspath(path)
        if Path(path).is_dir():
            return cls(load_model(run=path), path)
        return cls(load_model(weights=path))

    @property
    def classes(self) -> list[str]:
        return self.loaded.classes

    @property
    def info(self):
        return self.loaded.info

    def _config(self, batch_size: int | None) -> InferenceConfig:
        return InferenceConfig(
            batch_size or self.loaded.batch_size, progress=False, num_workers=0, threads=self.threads
        )

    def predict(self, images: Image | Sequence[Image], *, tta_mode: str = "none", batch_size: int | None = None):
        """One dict per image -- ``label`` (None when unreadable), ``score`` and ``probabilities`` per class --
        or a single dict for a single image."""
        single = not isinstance(images, (list, tuple))
        sources = [_as_source(im) for im in ([images] if single else images)]
        if not sources:
            return []
        icfg = self._config(batch_size)
        accelerator = inference.start(icfg)
        model = tta.wrap_loaded(self.loaded, tta_mode)
        logits, labels = inference.forward(accelerator, model, icfg, sources, [0] * len(sources), "predict")
        task, thresholds = self.info.task, self.info.decision_thresholds
        readable = (labels != UNREADABLE).tolist()  # predict's labels: 0, or UNREADABLE, whatever the task
        rows = [
            task.answer(row if ok else None, self.classes, thresholds)
            for row, ok in zip(task.probabilities(logits).tolist(), readable)
        ]
        return rows[0] if single else rows

    def evaluate(
        self,
        data: str | os.PathLike | None = None,
        *,
        split: str | None = None,
        out: str | os.PathLike | None = None,
        tta_mode: str = "none",
    ) -> dict:
        """``visiontune evaluate``: metrics on a labelled folder, returned as the report it writes.

        As on the command line, a run's own data is scored on its val split (``split`` chooses) and
        ``data`` defaults to it; the report goes to ``out`` (default ``RUN/eval.json``, or a temporary
        folder for a model file), figures beside it.
        """
        data = os.fspath(data) if data is not None else run_data(self.run_dir)
        if data is None:
            raise UserError("evaluate needs the data folder: this model file does not name its data")
        icfg = self._config(None)
        if out is None and self.run_dir is None:
            with tempfile.TemporaryDirectory(prefix="visiontune-eval-") as tmp:
                return evaluate(self.loaded, icfg, data, f"{tmp}/eval.json", split=split, tta_mode=tta_mode)
        out = os.fspath(out) if out is not None else f"{self.run_dir}/eval.json"
        return evaluate(self.loaded, icfg, data, out, run_dir=self.run_dir, split=split, tta_mode=tta_mode)
