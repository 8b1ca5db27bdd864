"""``Task``: what a task owns, from a sample's label to the loss and the exact metrics of a phase.

The labels of a batch travel as a task encodes them (``sample_label``); a sample that could not be read
keeps its slot in the batch with the task's ``unreadable_label``, and every count leaves it out
(``readable``). Losses follow the engine's contract: per sample, 0 for an unreadable one.

A trained model's output means what its task says: the activation that turns logits into probabilities
(and back, for an exported file that ends in it), how test-time views are averaged, the decision a
probability row comes to (at per-class thresholds or not), and the answer predict, the API and serve give.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from visiontune.data.imageset import Cells, Labelled
from visiontune.tasks._torch import nn, torch

# The label of an unreadable image: F.cross_entropy's ignore_index, and left out of every count. A
# multi-label image's label is its multi-hot float row; an unreadable one's is a row of UNREADABLE.
UNREADABLE = -100

Loss = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]

# The metrics a task ranks a phase by beyond accuracy and loss (``ranking``), and which way is better: 1
# higher, -1 lower. ``--best-metric`` picks a run's best epoch by one of them.
RANKED = {"map": 1, "r2": 1, "mae": -1, "rmse": -1}


class Task:
    """One task: its subclasses override every method."""

    name: str  # its name in ``tasks.TASKS``, ``--task`` and the run's records
    title: str  # its data in words: "single-label"
    # Its evaluation (the eval.json writer and the run page's section) is found through its name in
    # ``reports.evaluations``.
    # Whether its loss takes --label-smoothing; a recipe's (``--recipe modern``) is dropped for a task without.
    supports_label_smoothing: bool = True
    min_classes: int = 2  # the classes (a regression: the targets) its model has at least
    classes_word: str = "classes"  # what its model's outputs are, in words
    # What the "accuracy" of its epochs (the mean of ``hits``) is: its key in the summary and metrics.csv,
    # its name on the epoch lines, and whether less is better (a regression's mean absolute error).
    score_key: str = "accuracy"
    score_name: str = "Acc"
    lower_is_better: bool = False
    ranks: bool  # evaluation gathers every output, for metrics that rank them (``ranking``)
    thresholded: bool  # its decisions are per class, at thresholds a run tunes (``thresholds``)
    accuracy_name: str  # what its accuracy is called where an exported file is scored
    best_metric: str  # what picks a run's best epoch under --best-metric auto
    metrics: tuple[str, ...]  # the --best-metric values it measures
    # -- what the records and the pages say of its runs and models --
    curves: tuple[tuple[str, str], ...]  # (key, name) of the metrics its val rows add to accuracy and loss
    accuracy_title: str  # the title of a run's accuracy curves
    labels_per_image: str  # its data in words: "one label" (per image)
    card_verb: str  # what its model does, as a model card says it: "<verb> N classes"
    activation_code: str  # its activation of a tensor ``logits`` in Python, for a loading snippet
    card_note: str  # a model card's line on how its model decides ("": nothing to add)

    def refusal(self, cfg) -> str | None:
        """Why this task cannot run with these settings (``TrainConfig``), in one line; None when it can."""
        if getattr(cfg, "loss", None) is not None:
            return (
                f"--loss {cfg.loss} is a regression loss (--task regress); {self.title} data has its own: drop --loss"
            )
        return None

    def configured(self, cfg) -> Task:
        """The task with what the run's settings choose of it (a regression's ``--loss``)."""
        return self

    def fitted(self, labels) -> Task:
        """The task as a run on these train-split ``labels`` (its ``label_array``) trains it: itself, or with
        what it learns of them (a regression's target scale)."""
        return self

    def state(self) -> dict:
        """What a fitted task adds to its run's model description (``restored`` reads it back)."""
        return {}

    def restored(self, state: dict, outputs: int) -> Task:
        """The task as a model description's ``state`` says it was fitted, for a model of ``outputs`` outputs
        (its classes); a ``ValueError`` saying what is wrong when the state is not one it wrote."""
        return self

    def best_figures(self, row: dict) -> dict:
        """What a summary adds of the best epoch's val ``row`` to its score and loss: ``best_val_<key>`` of each of
        its ``curves`` (what ``runs.runrecords:read_summary`` keeps of a task it does not know by name)."""
        return {f"best_val_{key}": row.get(key) for key, _ in self.curves}

    # -- its label cells, as the data sources list them (``data.imageset.LabelReader``) --

    def names_columns(self, row: list[str], where: str = "") -> bool:
        """Whether a manifest's first ``row`` (all its cells) names its columns; ``where``: that row, in words."""
        raise NotImplementedError

    def parse(self, cells: Cells) -> Labelled:
        """The images' label cells read, as its ``label_array`` keeps them; one line (``UserError``) naming the
        file and row of the first that is wrong."""
        raise NotImplementedError

    def read_as(self, name: str) -> Task:
        """Itself, for a listing file that names it (a listing is read back with the reader that wrote it)."""
        if name != self.name:
            raise ValueError(f"a listing read as {name!r} is not {self.name} data")
        return self

    def split(self, images, val_fraction: float, seed: int):
        """The seeded train/val ``data.split.Split`` of its ``images`` (an ``ImageSet``), stratified as its labels
        allow (by class, by label sets, by bins of a number), with ``make_split``'s sizes."""
        raise NotImplementedError

    def class_counts(self, images, idx) -> dict[str, int]:
        """Images of each class among ``images`` at ``idx`` (None: all); {} when its labels have no classes."""
        raise NotImplementedError

    def describe(self, images) -> str:
        """One line naming what its ``images`` hold (classes and their counts, a target's range)."""
        raise NotImplementedError

    def relabelled(self, images, cells: dict[int, str], where: str):
        """``images`` with image i given the label its cell ``cells[i]`` says (``--relabel``: audit's suggested
        labels, as predict writes them); one line naming ``where`` and the file of a cell it cannot read."""
        raise NotImplementedError

    def label_array(self, labels) -> np.ndarray:
        """The labels as a dataset keeps them."""
        raise NotImplementedError

    def sample_label(self, labels: np.ndarray, i: int):
        """Sample i's label as the loader collates it."""
        raise NotImplementedError

    def unreadable_label(self, labels: np.ndarray):
        """The label of a sample of ``labels`` that could not be read."""
        raise NotImplementedError

    def readable(self, labels: torch.Tensor) -> torch.Tensor:
        """bool [B]: which samples of a batch were read."""
        raise NotImplementedError

    def measure(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a training step adds to its epoch's meters: float64 (readable samples, their hits summed),
        device tensors (no sync)."""
        return self.readable(labels).sum().double(), self.hits(logits.detach(), labels).sum().double()

    def mean_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The plain training loss: the mean over the batch's readable samples."""
        raise NotImplementedError

    def eval_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-sample loss of an evaluation, in float32."""
        raise NotImplementedError

    def smoothed_loss(self, label_smoothing: float, class_weights: torch.Tensor | None) -> Loss:
        """The training loss with label smoothing, mixed targets or per-class weights: a mean as ``mean_loss``."""
        raise NotImplementedError

    def probabilities(self, out: torch.Tensor, given: bool = False) -> torch.Tensor:
        """[N, K] class probabilities of a model's output: its logits, or the probabilities themselves when
        ``given`` (an exported graph that ends in them), in the precision predict and serve compare them at."""
        raise NotImplementedError

    def hits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per sample, 1.0 when the prediction is right; 0 for an unreadable one."""
        raise NotImplementedError

    def mixed_classes(self, num_classes: int) -> int:
        """How many classes torchvision's MixUp/CutMix one-hot encode for this task."""
        raise NotImplementedError

    def mix_pair(self, mix: Callable, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A pair of samples (or a last one alone) mixed by ``mix`` (a MixUp or CutMix): images and targets."""
        raise NotImplementedError

    def mixed_targets(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A mixed batch's targets, an unreadable sample's made what the loss leaves out."""
        raise NotImplementedError

    def counted(self, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The labels a mixed batch (``targets``, MixUp/CutMix) is counted against."""
        raise NotImplementedError

    def ranking(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        """Metrics of a phase's gathered outputs beyond loss and accuracy (``PhaseResult`` fields)."""
        raise NotImplementedError

    def label_text(self, labels: torch.Tensor, classes: list[str]) -> list[str]:
        """Each sample's label in words, or why there is none."""
        raise NotImplementedError

    def balancing_weights(self, labels: np.ndarray, num_classes: int, beta: float | None) -> torch.Tensor:
        """float64 per-class weights of the loss that balance the train split's ``labels`` (its
        ``label_array``): ``beta`` None for ``--class-weights auto``, else ``effective:BETA``'s BETA."""
        raise NotImplementedError

    def weighting_text(self, how: str | None) -> str:
        """What the loss's class weights are, in words: ``how`` they were made (None: ``auto``)."""
        raise NotImplementedError

    def sampler_refusal(self, sampler: str) -> str | None:
        """Why ``--sampler sampler`` cannot draw this task's images (one line), or None."""
        raise NotImplementedError

    def loss_text(self, label_smoothing: float, class_weights: str) -> str:
        """The training loss in words, for the start-up block: ``class_weights`` as ``--class-weights``
        came to ("none", or how they were made and what they are)."""
        raise NotImplementedError

    # -- what a trained model's output means --

    def activation(self) -> nn.Module:
        """The module that turns the model's logits into its probabilities."""
        raise NotImplementedError

    def folded_into(self, head: nn.Module) -> Task | None:
        """Its output's map folded into the model's last layer ``head`` (changed in place), for a file whose
        model gives what the task answers with no code after it (the Hub folder): the task of the folded
        model, or None when the output is kept as it is (logits, whose activation a reader applies). A
        ``TypeError`` when ``head`` cannot hold the map."""
        return None

    def logits_of(self, probs: torch.Tensor) -> torch.Tensor:
        """Logits again from probabilities (the inverse of ``activation``): an exported file that ends in
        its activation then gives what the eager model gives."""
        raise NotImplementedError

    def exports_probabilities(self, asked: bool) -> bool:
        """Whether an exported graph ends in the activation, ``asked`` being ``--probabilities``."""
        raise NotImplementedError

    def output_name(self, probabilities: bool) -> str:
        """The name of an exported graph's output."""
        raise NotImplementedError

    def output_text(self, probabilities: bool) -> str:
        """The graph's output in words, for the line ``export`` ends with."""
        raise NotImplementedError

    def averaged(self, outputs: torch.Tensor) -> torch.Tensor:
        """Logits [N, K] of the views' outputs [V, N, K] averaged as probabilities (test-time augmentation)."""
        raise NotImplementedError

    def thresholds(self, recorded, num_classes: int) -> list[float] | None:
        """The per-class thresholds a model decides at: its ``recorded`` ones or the default; None when its
        decision is not thresholded."""
        raise NotImplementedError

    def right(self, out: np.ndarray, y: np.ndarray, thresholds) -> tuple[int, int]:
        """(right decisions, decisions) of a model's output rows ``out`` against labels ``y``, numpy."""
        raise NotImplementedError

    def answer(self, row: list[float] | None, classes, thresholds, top_k: int | None = None) -> dict:
        """One image's answer from its probability row (None: unreadable), as ``visiontune.load().predict``
        gives it, or with ``top_k`` as ``serve`` does."""
        raise NotImplementedError

    def csv_text(
        self, paths, classes, probs: torch.Tensor, readable: torch.Tensor, thresholds, clip: float, kaggle_ids=None
    ) -> str:
        """predict's CSV: a header, then a row for each path (empty fields for an unreadable one); the
        probabilities written are clipped to [clip, 1 - clip]. ``kaggle_ids``: the ids of a Kaggle test
        folder, for the submission form where a task has one."""
        raise NotImplementedError
