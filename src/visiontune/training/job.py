"""How a training job starts: the one entry that the ``visiontune train`` command and ``visiontune.train()``
both call, so a run started from Python gets what the command line gets.

``run`` checks what can be checked before any process starts (the data's listing, the strategy, the
model's name: one error line, not one per worker), then either trains in this process or, for a strategy
of several processes, starts the workers under the elastic agent (``cluster.launch.relaunch``) while this
process holds the run folder's lock and hands the workers its listing. The command line's workers get its
own arguments; a job started from Python gives its workers the settings as a JSON file (``train --config``
reads it) with the data on their command line, so that a ``pipe:`` command this process was allowed to run
is allowed there too and no other.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig


@dataclass(frozen=True)
class Ended:
    """How a job ended: its exit code (0, a worker's, or 128 + a signal's) and its summary when it has one
    (``summary.json``'s contents; none for a job that failed, or on a machine that is not the first)."""

    code: int
    summary: dict | None


def run(cfg: TrainConfig, argv: list[str] | None = None, on_epoch=None) -> Ended:
    """Train ``cfg`` (validated). ``argv``: the command line's ``train`` arguments, for its workers (None: started from
    Python). ``on_epoch``: ``trainer.train``'s hook, for a run in this process (a worker computes its own)."""
    from visiontune.cluster import checks, host, jobplan, launch
    from visiontune.data.sources import discover
    from visiontune.models.names import check_model
    from visiontune.runs import runlock
    from visiontune.tasks import best_metric, reader, task_of

    # Up to the trainer, everything refuses what it can before torch and the models load (seconds, tens of
    # seconds on a busy machine): the flags, the data's listing, what the flags ask of the task, the model's
    # name (a cached list, not torchvision's import). Only a refusal that is the machine's answer (fp16 with
    # no GPU) waits for torch.
    launch.join_cluster(cfg)  # Slurm started every process: take the rank it gave this one
    checks.check(cfg)
    # The listing is the job's only one: the run in this process or the workers take it over (a worker
    # lists nothing here). The task reads the label cells (the tasks import torch on first use only).
    columns = (cfg.image_column, cfg.label_column)
    images = None if launch.is_worker() else discover(cfg.data, *columns, task=reader(cfg.task))
    if images is not None and (cfg.exclude or cfg.relabel):  # naming a file not in the data: one line now
        from visiontune.data import filelist  # its split code imports torch: only when asked for

        filelist.edit(images, cfg.exclude, cfg.relabel)
    if images is not None:
        best_metric(cfg, task_of(cfg, images))  # --cutmix with --task regress, say
    check_model(cfg.model, cfg.weights, host.user_cache_dir())
    if not launch.needs_launcher(cfg):
        from visiontune.training.trainer import train

        return Ended(0, train(cfg, images, on_epoch=on_epoch))
    from visiontune.data.listing import shared_listing

    given_folder = cfg.output_dir is not None
    if not given_folder:  # fixed here, so that every worker writes the same folder
        cfg = cfg.replace(output_dir=launch.run_folder(cfg))
    # One machine: this process outlives any worker restart, so it holds the run folder's lock.
    one_machine = jobplan.node_range(launch.plan(cfg).nnodes) == (1, 1)
    if launch.can_fork_workers():
        # The workers will be forks of this process: importing the trainer once here, after the checks above,
        # spares each worker (and each restarted one) its own seconds of imports, torch._dynamo's among them.
        from visiontune.training import optim, trainer  # noqa: F401

        optim.warm_up()
    with (
        _workers_argv(cfg, argv, given_folder) as workers,
        runlock.hold_for_workers(cfg.output_dir if one_machine else None),
        shared_listing(images, cfg.data),
    ):
        code = launch.relaunch(cfg, workers)
    # The workers wrote it: read back as any run folder's record, bounded and checked (one line when damaged).
    from visiontune.runs import runrecords  # (its imports reach torch: not before the refusals above)

    return Ended(code, runrecords.read_summary(cfg.output_dir) if code == 0 else None)


def summary_of(ended: Ended) -> dict:
    """The summary of a job started from Python; a job that failed raises, as a run in this process would."""
    if ended.code != 0:
        how = f"was stopped by signal {ended.code - 128}" if ended.code > 128 else f"ended with exit code {ended.code}"
        raise UserError(f"the training job {how} (its workers' output is above)")
    if ended.summary is None:
        raise UserError("the training job ended without a summary.json here (it is written on the first machine)")
    return ended.summary


@contextlib.contextmanager
def _workers_argv(cfg: TrainConfig, argv: list[str] | None, given_folder: bool) -> Iterator[list[str]]:
    """The workers' ``train`` arguments: the command line's (with the folder fixed here), or a settings file
    made for them, there while the job runs (a restarted worker reads it again)."""
    if argv is not None:
        yield argv if given_folder else [*argv, "--output-dir", cfg.output_dir]
        return
    from visiontune.data import remote

    settings = {k: v for k, v in cfg.to_dict().items() if v is not None and k not in ("data", "output_dir")}
    with tempfile.TemporaryDirectory(prefix="visiontune-job-") as folder:
        path = os.path.join(folder, "settings.json")
        Path(path).write_text(json.dumps(settings))
        workers = ["--config", path, "--data", cfg.data, "--output-dir", cfg.output_dir]
        yield [*workers, "--allow-pipe"] if remote.command_allowed(cfg.data) else workers
