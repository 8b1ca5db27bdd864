"""End-of-epoch writes on the training path: the seconds ``EpochOutputs.record`` holds the loop, with the
files (best model, history, metrics.csv, curves) written in the background against written in place.

Each repeat records one more epoch of a 10-epoch history whose newest epoch is the best, so the best model is
saved every time (the costliest case); the background writer is waited for before the next repeat, so both
variants write the same bytes. The figure is the median seconds the caller waits, per model.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
import torchvision
from accelerate import Accelerator

from common import REPEATS, write_result
from visiontune.runs import records
from visiontune.training.hooks import EpochOutputs
from visiontune.training.meter import PhaseResult


class InPlace(records.BackgroundWrites):
    """The writes as they were: done before ``record`` returns."""

    def submit(self, job) -> None:
        job()


def _phase(epoch: int) -> PhaseResult:
    return PhaseResult(loss=1.0 / (epoch + 1), accuracy=0.5 + epoch / 40, images=1000, seconds=10.0)


def held(model: torch.nn.Module, writes: records.BackgroundWrites) -> list[float]:
    accelerator = Accelerator(cpu=True)
    waits = []
    with tempfile.TemporaryDirectory() as run_dir:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        outputs = EpochOutputs(accelerator, run_dir, model, optimizer, [], writes=writes)
        for epoch in range(REPEATS + 1):
            start = time.perf_counter()
            outputs.record(epoch, _phase(epoch), _phase(epoch))
            waits.append(time.perf_counter() - start)
            writes.wait()
        writes.close()
    return waits[1:]  # the first carries matplotlib's import and font cache


def main() -> None:
    rows = {}
    for name in ("resnet50", "vgg16"):
        model = torchvision.models.get_model(name)
        inplace, background = held(model, InPlace()), held(model, records.BackgroundWrites())
        rows[name] = {
            "in_place_s": statistics.median(inplace),
            "background_s": statistics.median(background),
            "samples": {"in_place": inplace, "background": background},
        }
        row = rows[name]
        print(f"epoch end, {name}: in place {row['in_place_s']:.2f} s, background {row['background_s']:.2f} s")
    write_result("epoch_end", {"what": "seconds EpochOutputs.record holds the training loop (median)", "models": rows})


if __name__ == "__main__":
    sys.exit(main())
