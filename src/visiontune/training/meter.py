"""Metering of the loops: an epoch's running sums (``Totals``), its host clocks (``StepClock``),
a phase's result (``PhaseResult``) and the progress display (a tqdm bar on a terminal, plain
timed lines in logs). Sums stay device tensors until a phase ends or a redraw reads them, so
the hot loop never waits on the GPU for a number.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from visiontune.cluster.host import progress_seconds

# A terminal's bar redraws every REDRAW_SECONDS; without a terminal a line is printed every
# LOG_EVERY_SECONDS ($VISIONTUNE_PROGRESS_SECONDS). The running loss/accuracy is read from the
# device just before each redraw (one sync), so what is shown is never older than the redraw.
REDRAW_SECONDS = 0.5
LOG_EVERY_SECONDS = 30.0


class Totals:
    """An epoch's running training sums on this process, as one float64 tensor (one all-reduce).

    The checkpoint stores them as the list ``[loss_sum, correct, images, skipped, steady_images]``.
    """

    NAMES = ("loss_sum", "correct", "images", "skipped", "steady_images")

    def __init__(self, values: torch.Tensor | None = None, device: torch.device | str = "cpu"):
        self.values = (
            torch.zeros(len(self.NAMES), dtype=torch.float64) if values is None else values.detach().clone().double()
        ).to(device)

    @classmethod
    def from_checkpoint(cls, saved: list[float] | None, is_main_process: bool) -> Totals:
        """A resumed epoch's sums. The saved ones are already summed over every process, and
        ``reduce`` sums the processes' totals again at the epoch end, so only the main process
        starts from them; the others start from zero."""
        if saved is None or not is_main_process:
            return cls()
        return cls(torch.tensor(saved, dtype=torch.float64))

    def __getattr__(self, name: str) -> float:
        if name in Totals.NAMES:
            return self.values[Totals.NAMES.index(name)].item()
        raise AttributeError(name)

    def add(self, loss_mean: torch.Tensor, correct: torch.Tensor, images: torch.Tensor, steady: bool) -> None:
        # No .item(): the sums stay on the device and the step does not wait for it.
        self.values[:3] += torch.stack([loss_mean * images, correct, images])
        if steady:
            self.values[4] += images

    def count_skipped(self, n: float) -> None:
        self.values[3] += n

    def reduced(self, accelerator: Accelerator) -> Totals:
        """Summed over every process (waits for the device's queued work)."""
        return Totals(accelerator.reduce(self.values.clone(), reduction="sum"), self.values.device)

    def to_list(self) -> list[float]:
        return self.values.tolist()


class StepClock:
    """Host clocks of one epoch: all of it, the steps after the first ``warmup``, and, of those,
    the time spent waiting for the loader. No clock reads the device, so nothing syncs per step."""

    def __init__(self, warmup: int, clock: Callable[[], float] = time.perf_counter):
        self.warmup, self.clock, self.steps = warmup, clock, 0
        self.start = self.last = clock()
        self.steady_start: float | None = None
        self.wait = 0.0

    def batch_ready(self) -> bool:
        """Call when a batch arrives; returns whether this step counts as steady."""
        steady = self.steps >= self.warmup
        if steady:
            if self.steady_start is None:
                self.steady_start = self.last
            self.wait += self.clock() - self.last
        self.steps += 1
        return steady

    def step_done(self) -> None:
        self.last = self.clock()

    def split(self) -> dict[str, float]:
        end = self.clock()
        return {
            "seconds": end - self.start,
            "steady_seconds": 0.0 if self.steady_start is None else end - self.steady_start,
            "data_wait_seconds": self.wait,
        }


@dataclass
class PhaseResult:
    loss: float
    accuracy: float
    images: int
    seconds: float
    skipped: int = 0  # optimizer steps not taken: non-finite gradients (--on-nan skip), fp16 overflow
    # Train only: the steps after the first ``timing_warmup`` ones.
    steady_images: int = 0
    steady_seconds: float = 0.0
    data_wait_seconds: float = 0.0  # of the steady seconds, spent waiting for the loader
    # Validation only: what the task ranks from every gathered output (``Task.ranking``: multi-label's mAP and
    # F1-tuned thresholds, a regression's MAE, RMSE and R²), recorded beside the rest; nothing for other tasks.
    ranked: dict = field(default_factory=dict)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        out = {**asdict(self), "images_per_s": self.images_per_s}
        ranked = out.pop("ranked")  # its figures sit beside the others in history.json, not nested
        return {**out, **ranked}


class _LogLines(tqdm):
    """tqdm's status as a plain line every ``mininterval`` seconds, for logs (Slurm, CI) where
    carriage-return redraws pile up; nothing at the start and nothing left at the end."""

    def display(self, msg=None, pos=None):
        if msg is not None or not self.n:  # msg="" is tqdm clearing the bar on close: nothing to clear
            return False
        self.fp.write(self.__str__() + "\n")
        self.fp.flush()
        return True


def progress_bar(accelerator: Accelerator, loader: Iterable, desc: str, progress: bool):
    disable = not (progress and accelerator.is_main_process)
    if getattr(sys.stderr, "isatty", lambda: False)():
        return tqdm(loader, desc=desc, leave=False, dynamic_ncols=True, mininterval=REDRAW_SECONDS, disable=disable)
    every = progress_seconds(LOG_EVERY_SECONDS)  # checked at start-up (host.check_environment)
    return _LogLines(
        loader,
        desc=desc,
        leave=False,
        mininterval=every,
        miniters=1,
        disable=disable,
        bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
    )


def run_progress(accelerator: Accelerator, total: int, done: int, progress: bool):
    """The whole run's view beside each phase's bar: training steps done of all the run's, and the run's ETA.

    Its rate is the average over the run so far (``smoothing=0``), validation included, so the ETA counts
    the validation still to come too. On a terminal it is a bar; in a log, a line every
    ``LOG_EVERY_SECONDS``, like the phase bars."""
    disable = not (progress and accelerator.is_main_process)
    common = dict(total=total, initial=done, desc="run", leave=False, disable=disable, smoothing=0, unit="step")
    if getattr(sys.stderr, "isatty", lambda: False)():
        return tqdm(**common, dynamic_ncols=True, mininterval=REDRAW_SECONDS)
    every = progress_seconds(LOG_EVERY_SECONDS)  # checked at start-up (host.check_environment)
    return _LogLines(
        **common, mininterval=every, miniters=1, bar_format="{desc} step {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"
    )
