"""``train(config) -> summary``: one run, from data folder to run folder.

This is the Python API (``visiontune.train``) and what ``visiontune train``
runs in every process. It wires the pieces in order -- Accelerator, data and
split, model, loaders, ``engine.fit``, outputs -- and keeps every collective
outside rank checks: all processes call ``wait_for_everyone`` before the main
process writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object, set_seed

from visiontune import files, tasks
from visiontune.cluster import launch, signals
from visiontune.cluster.strategy import Setup, ThreadWatch, effective, make_accelerator, prepare
from visiontune.data import filelist
from visiontune.data.groups import split_for
from visiontune.data.imageset import ImageSet
from visiontune.data.listing import listed
from visiontune.errors import UserError
from visiontune.loading.augment import BatchMix
from visiontune.loading.jobdata import fetch_per_machine, limit
from visiontune.loading.jobdata import prepare as prepare_data
from visiontune.loading.loaders import loaders
from visiontune.loading.pipeline import DeviceNormalize
from visiontune.models import checkpointing, lora
from visiontune.models.build import build_model, check_input, get_spec, head_names
from visiontune.reports import figures, report
from visiontune.runs import adapters, records, resume, runinfo, runlock
from visiontune.runs.checkpoint import Checkpoint
from visiontune.settings import presets
from visiontune.settings.config import SEEDS, TrainConfig
from visiontune.training import elastic, engine, imbalance, lrfind, meter, optim, overview, plan
from visiontune.training.hooks import (
    Checkpointer,
    CheckpointPolicy,
    EarlyStop,
    EpochOutputs,
    OnEpoch,
    RunHooks,
    StopAfterEpoch,
)
from visiontune.training.plan import Plan
from visiontune.training.schedule import Stepper
from visiontune.training.steplog import StepLog


def _run_dir(accelerator, cfg: TrainConfig) -> str:
    # The main process picks the folder (a timestamp) and every process uses it.
    # ``--resume RUN_DIR`` goes on writing into RUN_DIR unless --output-dir says otherwise.
    choice = [launch.run_folder(cfg)]
    broadcast_object_list(choice) if accelerator.num_processes > 1 else None
    return choice[0]


def _same_split_everywhere(accelerator, record: dict) -> None:
    # Each process splits its own machine's copy of the data; copies that differ would train the
    # processes on different splits without a word, so compare the split's hash across processes.
    digests = gather_object([record["sha256"]]) if accelerator.num_processes > 1 else [record["sha256"]]
    if len(set(digests)) > 1:
        raise UserError(
            "the processes see different data (split.json hashes differ between ranks: "
            f"{', '.join(d[:8] for d in digests)}); give every machine the same files under --data"
        )


@dataclass(frozen=True)
class _Job:
    """What every step of a run reads: its plan (the settings as resolved), its processes and its folder."""

    plan: Plan
    accelerator: Accelerator
    run_dir: str

    @property
    def cfg(self) -> TrainConfig:
        return self.plan.cfg

    @property
    def setup(self) -> Setup:
        return self.plan.setup


@dataclass(frozen=True)
class _Trainables:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Stepper  # the lr schedule and the EMA, stepped after every optimizer step
    train_loader: Iterable
    val_loader: Iterable
    class_weights: torch.Tensor | None = None  # of the loss (--class-weights), None: unweighted


def _open_job(resolved: Plan, run_folder: contextlib.ExitStack) -> _Job:
    """Join the job's processes and take the run folder (its lock comes before any long work)."""
    cfg = resolved.cfg
    elastic.join_restarted_group(cfg.timeout)
    runs = effective(cfg)
    runs.check(cfg)  # what this strategy cannot do with these settings, in every process of the job
    accelerator = make_accelerator(resolved.process(), cfg.output_dir or "runs", **runs.accelerator_kwargs(cfg))
    job = _Job(plan.for_world(resolved, accelerator), accelerator, _run_dir(accelerator, cfg))
    run_folder.enter_context(runlock.hold_run(accelerator, job.run_dir))
    elastic.check_shared_folder(accelerator, job.run_dir)
    return job


def _check_one_global_batch(job: _Job, split) -> None:
    batch = job.setup.per_process_batch * job.setup.world_size
    if len(split.train) < batch:
        raise UserError(
            f"the train split has {len(split.train)} images, fewer than one global batch of {batch}; "
            "lower --batch-size or add images"
        )


def _adapt(cfg: TrainConfig, model: torch.nn.Module) -> tuple[torch.nn.Module, list[tuple[str, str]]]:
    """``--grad-checkpointing`` and ``--lora`` applied to the built model; the start-up rows saying how."""
    rows = []
    if cfg.grad_checkpointing:
        rows.append(("grad checkpointing", checkpointing.enable(model, cfg.model)))
    if cfg.lora:
        heads = head_names(model)
        targets = lora.resolve_targets(model, heads, cfg.lora_targets, cfg.model)
        model = lora.add_adapters(model, cfg.lora, heads, cfg.lora_alpha, cfg.lora_dropout, targets)
        trained, total = lora.size(model)
        alpha = cfg.lora if cfg.lora_alpha is None else cfg.lora_alpha
        rows.append(
            (
                "LoRA",
                f"rank {cfg.lora}, alpha {alpha:g}, dropout {cfg.lora_dropout:g} on {len(targets)} layers; "
                f"{trained:,} of {total:,} parameters train ({100 * trained / total:.2f}%), the head included",
            )
        )
    return model, rows


def _identity(job: _Job, split_rec: dict, num_classes: int, class_weights: torch.Tensor | None) -> dict:
    """What a checkpoint must match for this run to resume it."""
    lora_of = ("lora", "lora_alpha", "lora_dropout", "lora_targets")
    return {
        **({"lora": {k: getattr(job.cfg, k) for k in lora_of}} if job.cfg.lora else {}),
        "sampler": job.cfg.sampler,
        "class_weights": None if class_weights is None else class_weights.tolist(),
        "split_sha256": split_rec["sha256"],
        "model": job.cfg.model,
        "num_classes": num_classes,
        "global_batch": job.setup.global_batch,
        "batch_samples": job.setup.per_process_batch * job.setup.world_size,
        "grad_accum": job.cfg.grad_accum,
        "image_size": job.cfg.image_size,
        "interpolation": job.cfg.interpolation,
        "crop_pct": job.cfg.crop_pct,
        **{k: getattr(job.cfg, k) for k in resume.AUGMENTATION},
        "decode": job.cfg.decode,
    }


@dataclass(frozen=True)
class _Fit:
    """A run ready for its epochs: the job, what trains, and what its checkpoints and outputs carry."""

    job: _Job
    parts: _Trainables
    normalize: DeviceNormalize  # the batches' normalisation on the device
    identity: dict  # what a checkpoint must match to be resumed (``_identity``)
    resumed: Checkpoint | None  # the checkpoint this run goes on from
    info: runinfo.RunInfo  # the run's description, carried in best.safetensors
    on_epoch: OnEpoch | None  # the caller's hook (``train``)


def _hooks(run: _Fit, stop: signals.StopSignals) -> RunHooks:
    job, parts, resumed = run.job, run.parts, run.resumed
    accelerator, cfg, per_epoch = job.accelerator, job.cfg, len(parts.train_loader)
    history = list(resumed.meta["history"]) if resumed else []  # a resumed run's epochs so far
    policy = CheckpointPolicy(per_epoch, cfg.grad_accum, cfg.save_every_steps)
    steps = StepLog(accelerator, parts.optimizer, per_epoch) if cfg.log_with else None

    def evaluate_ema(ema_model):  # evaluated as the raw model is (its forward carries no autocast)
        with accelerator.autocast():
            return engine.evaluate(
                accelerator,
                ema_model,
                parts.val_loader,
                run.normalize,
                progress=cfg.progress,
                desc="val ema",
                task=job.plan.task,
            )

    return RunHooks(
        Checkpointer(accelerator, cfg, job.run_dir, parts.scheduler, policy, run.identity, history),
        EpochOutputs(
            accelerator,
            job.run_dir,
            parts.model,
            parts.optimizer,
            history,
            model_metadata=run.info.metadata(),
            save_pth=cfg.save_pth,
            per_epoch=per_epoch,
            best_metric=cfg.best_metric,
            ema=parts.scheduler.ema,
            evaluate=evaluate_ema,
            strategy=effective(cfg),
            task=job.plan.task,
        ),
        stop,
        cfg.epochs,
        steps,
        cfg.early_stop,
        run.on_epoch,
        ThreadWatch(job.plan.threads),
    )


def _start(accelerator, resumed) -> engine.StartAt:
    if resumed is None:
        return engine.StartAt()
    totals = meter.Totals.from_checkpoint(resumed.meta.get("partial_totals"), accelerator.is_main_process)
    # resume.compatible already put the position in this run's batches (it is kept in samples), so an
    # elastic job back with another number of processes, or another batch split, starts at the same sample.
    return engine.StartAt(resumed.epoch, resumed.batch, totals)


def _fit(run: _Fit) -> tuple[list[dict], dict | None]:
    """The epochs, with checkpoints, outputs and stop signals; the run's per-epoch history, and why
    ``on_epoch`` stopped it early (None: it did not)."""
    job, parts, resumed = run.job, run.parts, run.resumed
    accelerator, cfg = job.accelerator, job.cfg
    mix = None
    if cfg.mixup or cfg.cutmix:
        ranks = (accelerator.process_index, accelerator.num_processes)
        mix = BatchMix(len(run.info.classes), cfg.mixup, cfg.cutmix, cfg.seed, *ranks, task=job.plan.task)
    # SIGTERM/SIGINT/SIGUSR1 now mean "checkpoint at the next step, then exit".
    asked: list[StopAfterEpoch] = []
    with signals.StopSignals(accelerator) as stop, contextlib.suppress(EarlyStop):
        hooks = _hooks(run, stop)
        if resumed is not None and resumed.batch == 0:
            hooks.outputs.rewrite_last_epoch()  # the closed epoch's files may not have reached the disk
        opts = engine.LoopOptions(
            cfg.epochs,
            cfg.on_nan,
            cfg.progress,
            cfg.timing_warmup,
            task=job.plan.task,
            criterion=optim.criterion(cfg, job.plan.task, parts.class_weights),
            mix=mix,
            on_step=hooks.on_step,
            on_epoch_end=hooks.on_epoch_end,
            max_batches=None if cfg.max_steps is None else cfg.max_steps * cfg.grad_accum,
        )
        learner = engine.Learner(parts.model, parts.optimizer, parts.scheduler, run.normalize)
        loop = (learner, parts.train_loader, parts.val_loader)
        try:
            engine.fit(accelerator, *loop, opts, _start(accelerator, resumed))
        except BaseException as e:
            if isinstance(e, StopAfterEpoch):
                asked.append(e)
            with contextlib.suppress(Exception):  # the run's own error (a signal, a NaN) is the one to report
                hooks.outputs.writes.close()
            raise
        hooks.outputs.writes.close()  # every epoch's files on disk before the summary and the report
    stopped = {"reason": asked[0].reason, "epochs_done": asked[0].epoch + 1} if asked else None
    return hooks.history, stopped


def train(cfg: TrainConfig, images: ImageSet | None = None, on_epoch: OnEpoch | None = None) -> dict:
    """Fine-tune ``cfg.model`` on ``cfg.data`` (listed as ``images`` when given); return the run's summary.
    ``cfg`` is validated (``settings.validation.validate``: the command line's, ``visiontune.train()``'s and each
    trial's are, once).

    ``on_epoch(epoch, row)`` sees each recorded epoch, in the main process (every process of a job passes it;
    the others never call it); a reason it returns ends the run, every process of it, after that epoch
    (``summary.json``'s ``stopped``). ``visiontune tune`` prunes its trials with it."""
    with contextlib.ExitStack() as run_folder:  # holds the run folder's lock, released however the run ends
        return _train(cfg, images, run_folder, on_epoch)


def _train(
    cfg: TrainConfig, images: ImageSet | None, run_folder: contextlib.ExitStack, on_epoch: OnEpoch | None
) -> dict:
    since = time.time()
    spec = get_spec(cfg.model)
    job = _open_job(plan.for_process(cfg), run_folder)  # the input view, this world's accumulation
    cfg, accelerator, run_dir = job.cfg, job.accelerator, job.run_dir
    # The job's one listing (handed over by the command or its launcher): the model and the input are
    # checked against it before the bad-file scan, which can take minutes on a large folder.
    if images is None:  # workers started by torchrun or srun: remote shards are downloaded once per machine
        fetch_per_machine(accelerator, cfg.data)
    images = images or listed(cfg.data, cfg.image_column, cfg.label_column, tasks.reader(cfg.task))
    images, limited = limit(images, cfg.limit_images, cfg.seed)  # a smoke run's subset, before the bad-file screen
    images, edited = filelist.edit(images, cfg.exclude, cfg.relabel)  # --exclude/--relabel: an audit's findings
    resolved = plan.for_data(job.plan, images, resume.resumed_folder(cfg, run_dir), accelerator.print)
    cfg = resolved.cfg  # the best metric, a resumed run's split method
    imbalance.check_sampler(cfg, resolved.task)  # what needs no model is refused before it is built
    # The new head's init and dropout repeat run to run (so resumes can be compared); processes
    # differ by their index, and DDP copies rank 0's weights to the others anyway. Accelerate's own
    # device_specific adds the index unwrapped, which numpy refuses for the last seeds below SEEDS.
    set_seed((cfg.seed + accelerator.process_index) % SEEDS)
    weights = runinfo.best_weights(cfg.init_from) if cfg.init_from else cfg.weights
    with accelerator.local_main_process_first():  # a weights download happens once per machine
        model = build_model(
            cfg.model,
            len(images.classes),
            weights,
            cfg.freeze_backbone,
            image_size=cfg.image_size,
            say=accelerator.print,
        )
    model, adapted = _adapt(cfg, model)
    check_input(model, cfg.model, cfg.image_size, cfg.batch_size)
    # The bad-file screen, once per machine; meanwhile the optimizer's imports, while a child builds the cache.
    data = prepare_data(accelerator, cfg, run_dir, images, meanwhile=_imports_ahead())
    images, bad = data.images, data.bad
    resolved = plan.cached(resolved, data.cache_choice)
    split, split_rec = split_for(images, cfg)  # the data's own, or the seeded one (grouped, or a fold)
    if limited:  # the subset is in the lists and their hash; this says how it was drawn
        split_rec = {**split_rec, "limit_images": limited}
    if edited:
        split_rec = {**split_rec, **edited}
    _same_split_everywhere(accelerator, split_rec)
    _check_one_global_batch(job, split)
    resolved = plan.fitted(resolved, images.label_array[split.train])  # a regression's target scale
    weights = imbalance.class_weights(cfg.class_weights, images.classes, images.label_array[split.train], resolved.task)
    stats, train_loader, val_loader = loaders(cfg, data, split, run_dir, resolved.threads, resolved.task)
    resolved = plan.measured(resolved, stats)  # --normalize data's statistics
    resolved = plan.laid_out(resolved, model, accelerator.device)  # --channels-last's default, for this model
    cfg = resolved.cfg
    swept = None
    if cfg.lr == "auto":  # before the optimizer is built: lr-find's suggestion, or the resumed run's choice
        source = resume.resumed_folder(cfg, run_dir)
        # The sweep trains with the run's own loss (class weights included).
        loss = optim.criterion(cfg, resolved.task, weights) or resolved.task.mean_loss
        lr, swept = lrfind.auto_lr(accelerator, cfg, model, train_loader, loss, source)
        resolved = plan.chose_lr(resolved, lr)
    job, setup = dataclasses.replace(job, plan=resolved), resolved.setup
    mean, std = presets.mean_std(cfg)  # what the images are normalised with, recorded for every later command
    info = runinfo.describe(
        cfg.model,
        spec.source,
        images.classes,
        cfg.image_size,
        mean,
        std,
        cfg.interpolation,
        cfg.crop_pct,
        resolved.task,
        decode=cfg.decode,
    )
    per_epoch = max(1, len(train_loader) // (setup.world_size * cfg.grad_accum))  # optimizer steps
    # The train loader keeps full batches only: what an epoch trains on, of the train split.
    per_epoch_images = len(train_loader) // setup.world_size * setup.world_size * setup.per_process_batch
    weighting = imbalance.describe(cfg.class_weights, weights, images.classes, resolved.task)
    counts = (len(split.train), len(split.val), images.classes, per_epoch_images, per_epoch)
    rows = overview.rows(resolved, *counts, spec.source, weighting)
    rows.append(("image cache", resolved.cache.text()))
    rows.extend(adapted)
    optimizer, scheduler = optim.optimization(cfg, model, setup.lr, per_epoch)
    model, optimizer, (train_loader, val_loader) = prepare(accelerator, cfg, model, optimizer, train_loader, val_loader)
    scheduler.attach_ema(effective(cfg).unwrap(accelerator, model), sharded=effective(cfg).sharded)
    identity = _identity(job, split_rec, len(images.classes), weights)
    if cfg.lora:  # checkpoints hold the adapters and the head; the frozen base is built again on resume
        adapters.adapters_only(accelerator)
        identity["lora"]["base"] = adapters.base_digest(accelerator.unwrap_model(model, keep_torch_compile=False))
    resumed = resume.restore(accelerator, cfg, run_dir, identity, scheduler)
    facts = records.RunFacts(accelerator, run_dir, cfg, setup, resolved.task, images, split, resolved.cache.to_dict())
    records.announce(facts, rows, overview.recipe_note(cfg, spec.source))
    records.write_records(facts, split_rec, bad, info, rows)
    if swept is not None and accelerator.is_main_process:
        files.write_json(f"{run_dir}/{lrfind.RECORD}", swept)  # the sweep behind --lr auto's choice
    if accelerator.is_main_process:
        elastic.record_world(run_dir, setup, cfg, resumed)
    normalize = DeviceNormalize(accelerator.device, cfg.channels_last, mean, std)
    parts = _Trainables(model, optimizer, scheduler, train_loader, val_loader, weights)
    history, asked = _fit(_Fit(job, parts, normalize, identity, resumed, info, on_epoch))
    stopped = asked or _stopped_at_max_steps(cfg, per_epoch, history)
    summary = records.finish(facts, since, history, stopped)
    if accelerator.is_main_process:  # the page, made from the run folder's records as `visiontune report` makes it
        print(f"visiontune: outputs in {run_dir}; report {report.write(run_dir)}")
    return summary


def _imports_ahead() -> Callable[[], None] | None:
    """What the run's main process will import on its way, as one call (None: it has them already, and the
    image cache is built in this process, as no fork would then gain anything): the optimizer's
    ``torch._dynamo``, and pyplot, which the curves of the first epoch are drawn with. Imported while a forked
    child builds the image cache (``prepare_data``), they cost no time of their own."""
    if {"torch._dynamo", "matplotlib.pyplot"} <= sys.modules.keys():
        return None

    def imports() -> None:
        optim.warm_up()
        figures.pyplot()

    return imports


def _stopped_at_max_steps(cfg: TrainConfig, per_epoch: int, history: list[dict]) -> dict | None:
    """summary.json's ``stopped``: the run ended at --max-steps before its --epochs were done."""
    if cfg.max_steps is None or cfg.max_steps >= per_epoch * cfg.epochs:
        return None
    return {"reason": "max-steps", "optimizer_steps": cfg.max_steps, "epochs_done": len(history)}
