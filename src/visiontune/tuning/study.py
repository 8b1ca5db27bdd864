"""Where a study lives, what it is of, and which of its trials nobody runs any more.

Storage (``--storage``): by default an SQLite file ``study.db`` in the tune folder; any database URL
SQLAlchemy takes (``postgresql://...``, ``mysql+pymysql://...``) through Optuna's ``RDBStorage``; or, for a
value without ``://``, a journal file through ``JournalStorage`` and ``JournalFileBackend`` (appends under a
lock file: the choice on a shared file system, where Slurm jobs on several machines share one study).

A study records what it is of when it is made: the data set (its classes, its image count and a digest of
its file names and labels), the direction of its metric and the fixed settings. A tuner pointed at a study of
other data, or with other fixed settings, stops with one line instead of mixing two searches.

Every trial being run carries its owner (host, pid, the process's start time) and a heartbeat, beaten every
``heartbeat`` seconds from a thread. A RUNNING trial is stale when its owner is gone: on this host, when no
process of that pid and start time lives (exact, whatever the load: a busy machine that delays a heartbeat
never fails a live trial); on another host, when its heartbeat is older than three beats, the only sign that
reaches across machines. The store is shared and its records read through ``store``: an owner record without
a usable pid and start time, a heartbeat that is no time or lies in the future, counts for nothing, and the
trial is judged by its last sign of life (at worst its start), so no record keeps a tuner waiting for ever.
``fail_stale`` marks it FAIL and queues its parameters again, once, as a
new WAITING trial (``retry``, as Optuna's ``RetryHeartbeatStaleTrialCallback`` does). The same code serves
every storage: Optuna's own heartbeat exists only for databases, not for the journal file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from visiontune.errors import UserError
from visiontune.text import mask_urls
from visiontune.tuning import store
from visiontune.tuning.store import ATTR_DATA, ATTR_DIRECTION, ATTR_FIXED, BEAT, FAILED, OWNER

STALE_BEATS = 3  # a heartbeat this many intervals old: the trial's tuner is gone


def storage_url(given: str | None, out: str) -> str:
    return given or f"sqlite:///{Path(out, 'study.db').resolve()}"


def open_storage(url: str):
    """The storage behind ``url`` (a database URL, or a journal file path); unreachable: one line."""
    try:
        if "://" in url:
            storage = _rdb(url)
        else:
            from optuna.storages.journal import JournalFileBackend, JournalStorage

            Path(url).parent.mkdir(parents=True, exist_ok=True)
            storage = JournalStorage(JournalFileBackend(url))
        storage.get_all_studies()  # a database that refuses connections says so here, not at the first trial
        return storage
    except UserError:
        raise
    except Exception as e:  # the driver's own errors: sqlalchemy's, a missing driver module, an OS error
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot open the study storage {mask_urls(url)}: {first[:300]}; check --storage") from None


# What a tuner that lost the race to create a new database's tables sees: a table, or the schema version's
# row (``alembic_version``), that another tuner made meanwhile.
_LOST_THE_RACE = ("already exists", "UNIQUE constraint failed: alembic_version")


def _rdb(url: str, attempts: int = 5):
    """Optuna's RDBStorage; tuners started together on a new database race to create its tables, and the
    losers see one of ``_LOST_THE_RACE``: by then the tables are there, so they try again."""
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
        except Exception as e:
            if not any(said in str(e) for said in _LOST_THE_RACE) or attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _engine_kwargs(url: str) -> dict:
    # SQLite under several tuners of one machine: wait for the file's lock rather than fail at once.
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}


def data_identity(images) -> dict:
    """What a study is of: the data's classes, its size and a digest of its file names and labels."""
    digest = hashlib.sha256()
    root = str(images.root)
    for path, label in zip(images.paths, images.labels.tolist()):
        name = str(path)
        name = name[len(root) :].lstrip("/") if name.startswith(root) else name
        digest.update(f"{name}\0{label}\n".encode("utf-8", "surrogateescape"))
    return {"classes": list(images.classes), "images": len(images.labels), "sha256": digest.hexdigest()}


def open_study(storage, url: str, name: str, direction: str, sampler, pruner, data: dict, fixed: dict):
    """Create the study ``name`` or load it; refuse one of other data, another metric or other fixed settings."""
    shown = f"study {name!r} in {mask_urls(url)}"
    try:
        study = optuna.create_study(
            storage=storage, study_name=name, direction=direction, sampler=sampler, pruner=pruner, load_if_exists=True
        )
    except Exception as e:
        raise UserError(f"cannot open {shown}: {str(e).splitlines()[0][:300]}") from None
    record = store.study_record(study)
    if record.data is None:  # new, or made with Optuna's own API (a user's enqueued trials): claim it
        study.set_user_attr(ATTR_DIRECTION, direction)
        study.set_user_attr(ATTR_FIXED, fixed)
        study.set_user_attr(ATTR_DATA, data)  # last: a study with its data recorded has the rest too
        return study
    if record.data["sha256"] != data["sha256"]:
        was = record.data
        raise UserError(
            f"{shown} is of another data set ({was['images']} images, classes "
            f"{', '.join(was['classes'])}; this one has {data['images']}): give another --study"
        )
    if (record.direction or direction) != direction or study.direction.name.lower() != direction:
        raise UserError(f"{shown} {record.direction}s its metric; this tuner would {direction} it (--best-metric)")
    was = record.fixed
    # Settings both runs gave first (the likely slip), then the ones only one of them knows.
    differ = sorted((k for k in set(fixed) | set(was) if fixed.get(k) != was.get(k)), key=lambda k: (k not in was, k))
    if differ:
        said = ", ".join(f"{k} {was.get(k)!r} -> {fixed.get(k)!r}" for k in differ[:4])
        raise UserError(
            f"{shown} was run with other fixed settings ({said}): run the same command, or give another --study"
        )
    return study


def retry(study, trial: store.Row, max_retry: int = 1) -> None:
    """Queue ``trial``'s parameters again as a WAITING trial, ``max_retry`` times at most, as Optuna's
    ``RetryHeartbeatStaleTrialCallback`` does (its ``failed_trial`` and ``retry_history`` attributes), but
    without the dead tuner's own attributes (owner, heartbeat, run folder): the retry is a trial of its own."""
    history = [*trial.retry_history, trial.number]
    if len(history) > max_retry:
        return
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            system_attrs={"failed_trial": history[0], "retry_history": history},
        )
    )


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc's field 22), to tell it from a later
    process given the same pid; None where /proc does not say (another system, or no such process)."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (which, in parentheses, may hold spaces)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _owner_alive(owner: store.Owner) -> bool | None:
    """On this host: whether the owning process still runs (True/False); on another host, or for an owner
    record that names no process (the study's storage may be shared, and written by anyone): None."""
    if owner.host != socket.gethostname() or owner.pid is None:
        return None
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    except OSError:
        return None
    fields = _stat(owner.pid)
    if fields is None:  # no /proc: the pid is all there is to go by
        return True
    if fields[0] in ("Z", "X"):  # killed, and not yet reaped (a container without an init that reaps)
        return False
    if owner.started is None:  # a live pid ("pid": 1), but nothing tells it is the owner: the heartbeat tells
        return None
    return owner.started == int(fields[19])


# When this process first saw a running trial that carries no time it can be judged by (a shared store is
# anyone's: a journal file may hold a trial without a start time): its heartbeat window starts then.
_FIRST_SEEN: dict[tuple[str, int], float] = {}


def _last_sign(t: store.Row, now: float, every: float, study_name: str) -> float:
    """The latest time ``t``'s owner was known to be at work: its last beat, when it took the trial, or when
    Optuna started it; a time in the future (beyond the window) is no sign."""
    for when in (t.beat, t.owner.since if t.owner else None, t.started.timestamp() if t.started else None):
        if when is not None and when <= now + STALE_BEATS * every:
            return when
    return _FIRST_SEEN.setdefault((study_name, t.trial_id), now)


def fail_stale(study, storage, heartbeat: float) -> list[int]:
    """FAIL the RUNNING trials nobody runs any more and queue each again, once; their numbers. A trial is
    judged by its owner's process on this host; else by its heartbeat, at the interval its owner recorded
    (at most a day) or this tuner's; an owner record that names nothing usable (``"pid": "1; touch x"``, a
    heartbeat of 1e309) counts as no owner, so such a trial too is failed once its window has passed."""
    failed = []
    now = time.time()
    ours = ATTR_DATA in study.user_attrs  # a study visiontune made (its record checked when it was opened)
    for t in store.trials(study, states=(TrialState.RUNNING,)):
        if not t.owner_recorded and not ours:
            continue  # a trial started by another program (in a study visiontune did not make): not ours to judge
        alive = None if t.owner is None else _owner_alive(t.owner)
        if alive is None:  # another host's, or no usable record: its heartbeat (or its start) tells
            every = t.owner.heartbeat if t.owner and t.owner.heartbeat else heartbeat
            alive = now - _last_sign(t, now, every, study.study_name) <= STALE_BEATS * every
        if alive:
            continue
        try:  # the reason first: a finished trial takes no attributes
            storage.set_trial_system_attr(t.trial_id, FAILED, "its tuner stopped while running it")
            storage.set_trial_state_values(t.trial_id, state=TrialState.FAIL)
        except (UpdateFinishedTrialError, RuntimeError):
            continue  # another tuner failed it first (and queued it again)
        retry(study, t)
        failed.append(t.number)
    return failed


class Heartbeat:
    """While a trial runs: its owner recorded, and a heartbeat written every ``interval`` seconds."""

    def __init__(self, storage, trial_id: int, interval: float):
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "heartbeat": interval}
        owner["started"] = _started(os.getpid())
        storage.set_trial_system_attr(trial_id, OWNER, owner)
        storage.set_trial_system_attr(trial_id, BEAT, time.time())
        self._thread = self._beating()

    def _beating(self) -> threading.Thread:
        return threading.Thread(target=self._beat, args=(self._stop,), name="visiontune-heartbeat", daemon=True)

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                self.storage.set_trial_system_attr(self.trial_id, BEAT, time.time())
            except Exception:  # the trial just finished (or the database hiccupped): the next beat or none
                if stop.is_set():
                    return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def paused(self):
        """No beat for a moment: this process has no thread of its own then, and may fork a trial's job."""
        from visiontune.cluster.launch import ended

        self._stop.set()
        ended(self._thread)
        try:
            yield
        finally:
            self._stop = threading.Event()
            self._thread = self._beating()
            self._thread.start()


def fixed_record(cfg_dict: dict) -> dict:
    """The fixed settings a study compares: JSON values, without where the data and the trials live."""
    leave_out = {"data", "output_dir", "threads", "progress", "num_workers", "cache"}
    return json.loads(json.dumps({k: v for k, v in cfg_dict.items() if k not in leave_out}))
