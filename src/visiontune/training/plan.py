"""A run's plan: what was asked, and every value the run resolves from it, in one place.

``asked`` is the validated ``TrainConfig`` as the command line, a config file or ``visiontune.train()``
gave it; it never changes (the start-up block says which resize choices came from it). ``cfg`` holds
the same settings with what this process resolved put in, and is what every step of the run reads and
``config.json`` records. Each value is resolved once, as soon as what it depends on is known:

1. the process (``for_process``, before the Accelerator): the model's input view -- size,
   interpolation, crop --, the process's threads, loader workers and decoding threads (``threads``), and
   the accumulation that keeps an elastic job's global batch in this world;
2. the world (``for_world``, once the Accelerator has joined the processes): ``setup``, the per-process
   and global batch, the world size, the devices and the lr it scales to;
3. the data (``for_data``, once listed): the task (``task``), its best metric, and the split method of
   the run this one resumes; then what ``--cache`` came to on this machine (``cached``) and what the task
   learns of the train split (``fitted``: a regression's target scale);
4. the model (``laid_out``, once built): ``--channels-last``'s default;
5. the measured (``measured``, when the loaders exist): ``--normalize data``'s statistics of the train
   split, and ``--lr auto``'s lr, chosen by a sweep over the model and the loaders (``chose_lr``).

``lr-find`` and ``show`` resolve the input view and threads here as ``train`` does, so the three see the
same images.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from visiontune.cluster.strategy import ProcessSettings, Setup, Threads, describe, resolve_threads
from visiontune.data.imageset import ImageSet
from visiontune.loading.cache import CacheChoice
from visiontune.models.build import depthwise_with_batchnorm, get_spec, input_view
from visiontune.runs import runrecords
from visiontune.settings.config import TrainConfig, choices
from visiontune.settings.validation import recorded_split_method
from visiontune.tasks import Task, best_metric, task_of
from visiontune.training import elastic


@dataclass(frozen=True)
class Plan:
    asked: TrainConfig  # as validated, never changed
    cfg: TrainConfig  # the settings as resolved so far: what the steps read and config.json records
    threads: Threads  # this process's cores: the model's threads, the loader's workers, decoding threads
    setup: Setup | None = None  # this world's batch, lr and devices, known once the processes have joined
    task: Task | None = None  # what the run learns, known once the data is listed
    cache: CacheChoice | None = None  # what --cache came to on this machine, and why (recorded)

    def process(self) -> ProcessSettings:
        """What the Accelerator and the thread count read: the threads as resolved here, observed once."""
        return replace(ProcessSettings.of(self.cfg), threads=self.threads.intra_op)

    def _with(self, **resolved) -> Plan:
        return replace(self, cfg=self.cfg.replace(**resolved)) if resolved else self


def view(asked: TrainConfig) -> Plan:
    """The model's input view resolved: ``--image-size`` or the model's size, ``--interpolation`` and
    ``--crop-pct`` or its pretrained config's (``models.build.input_view``); and the process's threads."""
    interpolation, crop_pct = input_view(asked.model, asked.interpolation, asked.crop_pct)
    size = asked.image_size or get_spec(asked.model).preprocess.size
    cores = resolve_threads(asked, asked.num_workers)
    return Plan(asked, asked, cores)._with(image_size=size, interpolation=interpolation, crop_pct=crop_pct)


def for_process(asked: TrainConfig) -> Plan:
    """What this process resolves before its Accelerator: the input view, and the accumulation that gives
    this world the job's global batch (an elastic job back with another number of processes)."""
    plan = view(asked)
    accum = elastic.global_batch_accumulation(plan.cfg)
    return plan._with(grad_accum=accum) if accum != plan.cfg.grad_accum else plan


def for_world(plan: Plan, accelerator) -> Plan:
    """What the joined processes resolve: this world's batch, lr and devices (``strategy.describe``)."""
    return replace(plan, setup=describe(plan.cfg, accelerator, plan.threads))


def for_data(plan: Plan, images: ImageSet, resumed_from: str | None, say: Callable[[str], None]) -> Plan:
    """What the listed data resolves: its task, the best metric (``auto``: the task's own), and a resumed
    run's split method (its checkpoint was trained on that split, whatever the default is now)."""
    cfg, task = plan.cfg, task_of(plan.cfg, images)
    resolved = {"best_metric": best_metric(cfg, task)}
    recorded = _recorded_split_method(resumed_from, cfg.split_method)
    if recorded != cfg.split_method:
        say(f"visiontune: {resumed_from} was split with --split-method {recorded}; the resumed run keeps it")
        resolved["split_method"] = recorded
    return replace(plan, task=task)._with(**{k: v for k, v in resolved.items() if getattr(cfg, k) != v})


def _recorded_split_method(source: str | None, current: str) -> str:
    record = runrecords.read_config(source) if source else None
    # No record to go by: the checkpoint's split hash still refuses another split.
    recorded = recorded_split_method(record) if record is not None else current
    return recorded if recorded in choices()["split_method"] else current


def fitted(plan: Plan, train_labels) -> Plan:
    """The task as the train split fits it (``Task.fitted``: a regression's target scale), once it is split."""
    return replace(plan, task=plan.task.fitted(train_labels))


def cached(plan: Plan, choice: CacheChoice) -> Plan:
    """What ``--cache`` came to on this machine, once the data was screened (``jobdata.prepare``)."""
    return replace(plan, cache=choice)


def measured(plan: Plan, stats: tuple | None) -> Plan:
    """``--normalize data``'s mean and std, measured on the train split by the loaders (None: not asked)."""
    return plan if stats is None else plan._with(mean=stats[0], std=stats[1])


def laid_out(plan: Plan, model, device) -> Plan:
    """``--channels-last``'s default (None), once the model is built: on for a model with depthwise
    convolutions and BatchNorm on a CPU, where it measured faster (``models.build.depthwise_with_batchnorm``),
    off otherwise (on a GPU it was not measured here). ``config.json`` records what it came to."""
    if plan.cfg.channels_last is not None:
        return plan
    return plan._with(channels_last=device.type == "cpu" and depthwise_with_batchnorm(model))


def chose_lr(plan: Plan, lr: float) -> Plan:
    """``--lr auto``'s lr, as its sweep chose it (or the resumed run's choice): what the optimizer starts at.
    ``config.json`` keeps ``auto``, what was asked; its setup records the number."""
    return replace(plan, setup=replace(plan.setup, lr=lr))
