"""``visiontune tune``: trials of ``train`` with sampled settings, until the study has its trials.

Each trial is an ordinary run folder, ``OUT/trial-NNNN`` (NNNN: the trial's number in the study), made by
``training.trainer.train`` with the sampled values on top of the fixed settings. After each epoch the run's
``on_epoch`` hands the validation metric to Optuna (``trial.report``) and asks the pruner; a pruned trial
ends at that epoch boundary, its ``summary.json`` saying ``stopped: {"reason": "pruned ..."}``. A trial whose
settings ask for several processes (``--strategy ddp --nproc N``) is a job of its own (``trialjob``).

A tuner runs trials until the study holds ``trials`` finished ones (COMPLETE or PRUNED), counting every
tuner's, so several tuners on one storage (``--parallel K`` on one machine, or one per machine on a journal
file) share the budget; Optuna gives each trial to one tuner. A trial whose tuner died (kill -9, a lost node)
is failed and retried from its first epoch by the next tuner that looks (``study.fail_stale``): a retry
repeats the trial exactly (the same settings and seed), where resuming a half-trial would mix a dead
process's reports with a new one's; trials are short, so little is lost. A failed trial never counts.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

from visiontune.cluster import launch
from visiontune.cluster.host import available_cores
from visiontune.errors import UserError
from visiontune.runs import runrecords
from visiontune.settings.config import TrainConfig
from visiontune.settings.validation import validate
from visiontune.tasks import RANKED, reader
from visiontune.text import mask_urls, shown
from visiontune.tuning import results, space, store, study, trialjob

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
MAX_DIVERGED = 5
WORKER_ENV = "VISIONTUNE_TUNE_WORKER"  # set in the processes --parallel starts: their index


@dataclass(frozen=True)
class TuneOptions:
    trials: int
    out: str
    storage: str | None = None
    study_name: str = "visiontune"
    space_file: str | None = None
    parallel: int = 1
    timeout: float | None = None  # seconds after which no trial starts
    sampler: str = "tpe"
    pruner: str = "median"
    heartbeat: float = 30.0


def duration(text: str) -> float:
    """``--timeout``: seconds, or a number with s, m, h or d (``90m``, ``2h``, ``1h30m``)."""
    m = re.fullmatch(r"(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text)
    if not text or not m or not any(m.groups()):
        raise UserError(f"--timeout {text!r} is not a duration: write e.g. 3600, 90m, 2h or 1h30m")
    d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def _direction(metric: str) -> str:
    return "minimize" if metric == "loss" or RANKED.get(metric) == -1 else "maximize"


def _sampler(name: str, seed: int):
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant_liar: trials other tuners are running count as bad guesses, so tuners spread out.
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


def summary_value(summary: dict, metric: str) -> float:
    return float(summary[f"best_val_{metric}"])


@dataclass
class Tuner:
    """One tuner process: its study, the fixed settings and the space."""

    opts: TuneOptions
    cfg: TrainConfig  # the fixed settings, validated
    params: list[space.Param]
    images: object  # the data's listing, made once
    metric: str  # accuracy, loss or map: what the study optimises
    url: str  # the storage's, for a trial that runs as a job of its own
    storage: object
    study: optuna.Study
    diverged: int = 0  # trials in a row that ended in a non-finite loss

    def run(self, deadline: float | None) -> int:
        """Trials until the study has enough finished ones (or the deadline); how many this tuner ran."""
        ran = 0
        while True:
            with _asking(self.opts.out):  # the count and the ask, one tuner at a time (of those sharing OUT)
                study.fail_stale(self.study, self.storage, self.opts.heartbeat)
                trials = store.trials(self.study)
                if not trials and (start := space.recipe_values(self.params, self.cfg)):
                    self.study.enqueue_trial(start)  # a new study's first trial: the recipe's own settings
                    trials = store.trials(self.study)
                done = store.count(trials, *FINISHED)
                waiting = store.count(trials, TrialState.WAITING)
                if done >= self.opts.trials or (deadline is not None and time.time() >= deadline):
                    return ran
                busy = done + store.count(trials, TrialState.RUNNING) + waiting >= self.opts.trials and not waiting
                trial = None if busy else self.study.ask()
                # Owned from the start: another tuner never takes a trial without an owner for a stale one.
                beat = None if trial is None else study.Heartbeat(self.storage, trial._trial_id, self.opts.heartbeat)
            if trial is None:
                time.sleep(min(5.0, self.opts.heartbeat))  # the last trials are other tuners': wait for them
                continue
            with beat:
                self.one_trial(trial, beat, quiet=ran > 0)
            ran += 1

    def one_trial(self, trial, beat: study.Heartbeat, quiet: bool = False) -> None:
        """Run ``trial`` and tell the study how it ended. ``quiet``: the trial's own output (the start-up block
        the first trial showed, its epochs) goes to ``OUT/trial-NNNN.log``, and the trial is one line here."""
        from visiontune.cluster.signals import RunStopped
        from visiontune.training.engine import NonFiniteLoss
        from visiontune.training.trainer import train

        where = f"trial {trial.number} (queued in the study store)"
        try:  # a trial queued with Optuna's API (by anyone sharing the store) may hold values outside the space
            values = space.sample(self.params, trial)
            space.check_values(self.params, values, where)
        except (ValueError, UserError) as e:  # Optuna's ValueError: a choice not in the space's choices
            self.study.tell(trial, state=TrialState.FAIL)  # not left RUNNING for other tuners to wait on
            said = str(e) if isinstance(e, UserError) else f"{where}: {e}"
            raise UserError(f"{shown(said)}; it is marked failed: run the same command to go on") from None
        run_dir = str(Path(self.opts.out, f"trial-{trial.number:04d}").resolve())
        cfg = validate(self.cfg.replace(**values, output_dir=run_dir))  # each value was checked; now together
        settings = results.settings_of(cfg)
        trial.set_user_attr("run_dir", run_dir)
        trial.set_user_attr("config", settings)
        job = launch.needs_launcher(cfg, "tune")  # several processes here: a job of its own, its main one reporting
        log = Path(self.opts.out, f"trial-{trial.number:04d}.log") if quiet and not job else None
        said = f"visiontune: trial {trial.number}: {results.describe(values)}"
        if log is None:
            print(f"{said} -> {shown(run_dir)}", flush=True)
        else:  # the line is ended by how the trial ends
            print(f"{said} (output: {shown(log.name)}) ...", end=" ", flush=True)
        ended = print if log is not None else lambda text: print(f"visiontune: trial {trial.number}: {text}")
        try:
            if job:
                summary = self._as_job(trial, run_dir, cfg.epochs, beat, settings)
            else:
                hook = trialjob.pruning(trial, self.metric, cfg.epochs, self.opts.pruner)
                with _output_to(log):
                    summary = train(cfg, self.images, on_epoch=hook)
        except NonFiniteLoss as e:  # these settings diverge: the search goes on (a few times in a row at most)
            self._diverged(trial, str(e), ended)
            return
        except UserError as e:  # the space was checked before: this is about the data or the machine
            trial.set_user_attr("error", str(e))
            self.study.tell(trial, state=TrialState.FAIL)
            if log is not None:
                print("failed")
            raise
        except RunStopped:  # a signal: the tuner stops; the trial goes back in the queue
            self.storage.set_trial_system_attr(trial._trial_id, "visiontune:failed", "stopped by a signal")
            self.study.tell(trial, state=TrialState.FAIL)
            study.retry(self.study, store.trials(self.study)[trial.number])
            raise
        except Exception:  # a bug: the trial failed (not retried: it would fail again), the traceback follows
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("epochs_done", summary["epochs"])
        if trialjob.was_pruned(summary):
            self.diverged = 0
            self.study.tell(trial, state=TrialState.PRUNED)
            ended(f"pruned after epoch {summary['epochs']}")
            return
        value = summary_value(summary, self.metric)
        if not math.isfinite(value):  # never a best: a failed trial, and, as a diverged one, the search goes on
            self._diverged(trial, f"its val {self.metric} is {value}", ended)
            return
        self.diverged = 0
        self.study.tell(trial, value)
        ended(f"val {self.metric} {value:.4g}")

    def _diverged(self, trial, why: str, ended) -> None:
        """A trial whose loss or value is not finite: failed; a few in a row end the search in one line."""
        trial.set_user_attr("error", why)
        self.study.tell(trial, state=TrialState.FAIL)
        ended(f"failed: {why}")
        self.diverged += 1
        if self.diverged >= MAX_DIVERGED:
            raise UserError(f"{self.diverged} trials in a row diverged (the last: {why}); narrow the space (lower lr)")

    def _as_job(self, trial, run_dir: str, epochs: int, beat: study.Heartbeat, settings: dict) -> dict:
        """The trial as ``visiontune train`` under its own launcher; its summary (its failures raised as the
        in-process run raises them)."""
        spec = {"storage": self.url, "study": self.study.study_name, "trial_id": trial._trial_id}
        spec |= {"metric": self.metric, "epochs": epochs, "pruner": self.opts.pruner}
        toml = results.config_toml(settings, [f"visiontune tune: trial {trial.number}"])
        code = trialjob.run_as_job(toml, run_dir, self.opts.out, trial.number, spec, beat.paused)
        trialjob.outcome(code, trial.number)
        # Written by the job this tuner just launched; read back bounded and checked all the same, as any run's.
        summary = runrecords.read_summary(run_dir)
        if summary is None:
            raise UserError(f"trial {trial.number} ended without its {Path(run_dir, 'summary.json')}")
        return summary


@contextlib.contextmanager
def _output_to(log: Path | None):
    """What a trial prints, into ``log`` (None: here). Its progress bars stay on stderr: they are one line."""
    if log is None:
        yield
        return
    with open(log, "a") as f, contextlib.redirect_stdout(f):
        yield


@contextlib.contextmanager
def _asking(out: str):
    """A lock on OUT/.ask.lock: tuners sharing a tune folder count the trials and ask for one in turn, so
    that together they start no more trials than the study needs (Optuna alone would give each its own)."""
    with open(Path(out, ".ask.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _die_with_parent() -> None:
    """A worker of --parallel: SIGKILLed when its tuner dies, so that a kill -9 leaves no trial training on."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def prepare(cfg: TrainConfig, fixed: set[str], opts: TuneOptions, models: list[str] | None, say=print) -> Tuner:
    """Everything checked before a trial: options, space, data, storage and study; the tuner."""
    from visiontune.data.sources import discover
    from visiontune.training import plan

    if opts.trials < 1 or opts.parallel < 1 or opts.heartbeat <= 0:
        raise UserError("--trials and --parallel must be positive integers, --heartbeat a positive number")
    if (cfg.nnodes or 1) > 1:
        raise UserError("each trial of `visiontune tune` runs on this machine: drop --nnodes (one tuner per machine)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the tuner says what happens, one line a trial
    params = space.resolve(cfg, fixed, opts.space_file, models)
    images = discover(cfg.data, cfg.image_column, cfg.label_column, task=reader(cfg.task))
    task = plan.task_of(cfg, images)
    params = space.for_task(params, cfg, task, opts.space_file)
    metric = plan.best_metric(cfg, task)
    cfg = cfg.replace(best_metric=metric)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    url = study.storage_url(opts.storage, opts.out)
    storage = study.open_storage(url)
    seed = (cfg.seed * 1_000_003 + os.getpid() + int(os.environ.get(WORKER_ENV, "0"))) % 2**32
    with _asking(opts.out):  # tuners started together: one makes the study and records what it is of
        the_study = study.open_study(
            storage,
            url,
            opts.study_name,
            _direction(metric),
            _sampler(opts.sampler, seed),
            trialjob.pruner(opts.pruner, cfg.epochs),
            study.data_identity(images),
            study.fixed_record({k: v for k, v in cfg.to_dict().items() if k not in {p.name for p in params}}),
        )
    so_far = store.trials(the_study)  # every record read once through the schema before any trial
    say(f"visiontune: study {shown(opts.study_name)!r} in {shown(mask_urls(url))}: {len(so_far)} trial(s) so far")
    say(f"visiontune: searching {'; '.join(p.describe() for p in params)} ({metric}, {_direction(metric)})")
    return Tuner(opts, cfg, params, images, metric, url, storage, the_study)


def tune(cfg: TrainConfig, fixed: set[str], opts: TuneOptions, argv: list[str], models: list[str] | None) -> int:
    """The command: prepare, run the trials here or in ``--parallel`` processes, then the results."""
    worker = WORKER_ENV in os.environ
    if worker:
        _die_with_parent()
    tuner = prepare(cfg, fixed, opts, models, say=(lambda *_: None) if worker else print)
    deadline = None if opts.timeout is None else time.time() + opts.timeout
    k = 1 if worker else _tuners(tuner)
    if k == 1:
        tuner.run(deadline)
    else:
        _run_workers(tuner, argv, deadline, k)
    if worker:
        return 0
    table = results.write_all(tuner.study, tuner.opts.out, tuner.metric, tuner.cfg)
    print(table)
    return 0


def _per_trial(cfg: TrainConfig) -> int:
    """The devices a trial takes: N GPUs, or N shares of the cores, for a trial that is a job of N processes."""
    return launch.plan(cfg, cluster=False).nproc if launch.needs_launcher(cfg, "tune") else 1


def _tuners(tuner: Tuner) -> int:
    """How many tuners ``--parallel K`` starts: no more than the trials left to run, nor than the machine runs
    at once (a GPU, or a core, per process of a trial); said in one line when that is fewer than K."""
    asked, per = tuner.opts.parallel, _per_trial(tuner.cfg)
    left = max(0, tuner.opts.trials - store.count(store.trials(tuner.study), *FINISHED))
    gpus = _gpu_count() if asked > 1 else 0
    devices, kind = (gpus, "GPU") if gpus else (available_cores(), "core")
    k = max(1, min(asked, left, devices // per))
    if k < asked:
        each = f" ({per} per trial)" if per > 1 else ""
        print(
            f"visiontune: --parallel {asked}: {k} tuner(s), for {left} trial(s) left to run on "
            f"{devices} {kind}{'s' * (devices != 1)}{each}"
        )
    return k


def _run_workers(tuner: Tuner, argv: list[str], deadline: float | None, k: int) -> None:
    """``--parallel K``: K tuner processes on this study, cores split between them (or one GPU each)."""
    per = _per_trial(tuner.cfg)
    threads = tuner.cfg.threads or max(1, available_cores() // (k * per))
    gpus = _gpu_count()
    procs = []
    from visiontune.cluster.launch import without_flags

    args = without_flags(argv, ("--timeout",))  # the workers get what is left of it
    if deadline is not None:
        args += ["--timeout", f"{max(1.0, deadline - time.time()):.0f}"]
    # On a CPU machine each tuner is a fork of this one: it starts holding the imports, seconds sooner.
    forked = launch.can_fork_workers()
    for i in range(k):
        env = {**os.environ, WORKER_ENV: str(i), "OMP_NUM_THREADS": str(threads)}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str((i * per + j) % gpus) for j in range(per))
        log, cmd = Path(tuner.opts.out, f"tuner-{i}.log"), ["tune", *args, "--threads", str(threads)]
        if forked:
            procs.append(launch.ForkedCommand(cmd, env, str(log)))
            continue
        with open(log, "a") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "visiontune", *cmd], env=env, stdout=f, stderr=f))
    print(f"visiontune: {k} tuner processes, {threads} thread(s) each; their output in {tuner.opts.out}/tuner-*.log")
    # A stop signal (Slurm's USR1 before the time limit, SIGTERM) is each worker's to act on: passed on.
    forward = lambda signum, _frame: [p.send_signal(signum) for p in procs]  # noqa: E731
    before = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    stopped = [c for c in codes if c not in (0, 2) and c > 128]
    if stopped:
        from visiontune.cluster.signals import RunStopped

        raise RunStopped("stopped by a signal; run the same command to continue the study", max(stopped))
    bad = [(i, c) for i, c in enumerate(codes) if c != 0]
    if bad:
        raise UserError(
            "tuner process(es) "
            + ", ".join(f"{i} (exit {c})" for i, c in bad)
            + f" failed; see {tuner.opts.out}/tuner-N.log, then run the same command to continue the study"
        )


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
