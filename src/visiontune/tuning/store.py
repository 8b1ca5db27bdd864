"""The study store's one reader: every value visiontune reads back from a study goes through the schema here.

A study's storage may be shared with other users (a database, a journal file on a shared disk) and written
with Optuna's own API by anyone, so what it holds is untrusted, like a run folder from someone else. This
module reads it into plain records whose every field has been checked: the study's own record (what it is
of: its data, fixed settings and metric direction) and each trial's row (state, value, reported values,
parameters, settings, run folder, owner and heartbeat, retry history). A value of the wrong type is one line
naming the study, the trial and the field (``UserError``), never a traceback deep in the tuner; a record
Optuna itself cannot decode (a categorical index out of range) is the same line. A COMPLETE trial whose
value is not a finite number is read as a failed trial: it is never the best. An owner record that cannot
be judged is read as none (``study.fail_stale`` then goes by the trial's times). Text from the store is
shown only through ``visiontune.text`` (terminal) or ``html.escape`` and ``run_link`` (``tune.html``).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, fields
from typing import Any

from optuna.trial import TrialState

from visiontune.errors import UserError
from visiontune.settings.config import TrainConfig
from visiontune.text import printable

ATTR_DATA, ATTR_FIXED, ATTR_DIRECTION = "visiontune:data", "visiontune:fixed", "visiontune:metric"
OWNER, BEAT, FAILED = "visiontune:owner", "visiontune:beat", "visiontune:failed"
MAX_TEXT = 4096  # a run folder's path, a host name: longer is not a value visiontune wrote
MAX_HEARTBEAT = 86_400.0  # seconds between beats a record may claim; longer would keep a dead trial for ever
_SETTINGS = {f.name for f in fields(TrainConfig)}
_SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class Owner:
    """A running trial's owner, each field None where the record does not hold a usable value."""

    host: str | None = None
    pid: int | None = None
    started: int | None = None  # the process's start time (clock ticks since boot)
    since: float | None = None  # when it took the trial (seconds since the epoch)
    heartbeat: float | None = None  # seconds between its beats


@dataclass(frozen=True)
class Row:
    """One trial as read from the store: every field checked."""

    number: int
    trial_id: int
    state: TrialState  # a COMPLETE trial without a finite value reads as FAIL
    value: float | None  # COMPLETE: its value; PRUNED: its last reported one; else None
    reported: dict[int, float]  # the finite per-epoch values, by epoch index
    params: dict[str, Any]  # the sampled settings: names and scalar values
    distributions: dict
    run_dir: str | None
    config: dict | None  # the trial's settings (``results.settings_of``), a table of TrainConfig fields
    owner: Owner | None  # None: no owner record, or one that names nothing usable
    owner_recorded: bool  # whether there is an owner record at all (readable or not)
    beat: float | None
    failed_trial: int | None
    retry_history: tuple[int, ...]
    tuner_stopped: str | None  # why the trial failed when its tuner stopped (``visiontune:failed``)
    started: datetime.datetime | None
    completed: datetime.datetime | None
    note: str | None = None  # what reading it changed ("its value inf is not a finite number")


@dataclass(frozen=True)
class StudyRecord:
    """What a study says it is of; ``data`` None: a study visiontune did not make (or not yet)."""

    data: dict | None
    fixed: dict
    direction: str | None


def _where(name: str, number: int | None = None) -> str:
    return f"study {printable(name)!r}" + ("" if number is None else f" trial {number}")


def _bad(where: str, what: str, value: Any) -> UserError:
    shown = printable(repr(value))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return UserError(
        f"{where}: {what} is {shown}, not a value visiontune writes; the study store was changed by something "
        "else: repair it or give another --study"
    )


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _text(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_TEXT and "\0" not in v


def study_record(study) -> StudyRecord:
    """The study's own record, checked: its data (classes, image count, digest), fixed settings, direction."""
    attrs, where = study.user_attrs, _where(study.study_name)
    data = attrs.get(ATTR_DATA)
    if data is not None:
        ok = (
            isinstance(data, dict)
            and isinstance(data.get("classes"), list)
            and all(isinstance(c, str) for c in data["classes"])
            and isinstance(data.get("images"), int)
            and not isinstance(data.get("images"), bool)
            and isinstance(data.get("sha256"), str)
            and len(data["sha256"]) == 64
        )
        if not ok:
            raise _bad(where, f"its record of the data ({ATTR_DATA})", data)
    fixed = attrs.get(ATTR_FIXED, {})
    if not isinstance(fixed, dict):
        raise _bad(where, f"its fixed settings ({ATTR_FIXED})", fixed)
    direction = attrs.get(ATTR_DIRECTION)
    if direction not in (None, "minimize", "maximize"):
        raise _bad(where, f"its metric's direction ({ATTR_DIRECTION})", direction)
    return StudyRecord(data, fixed, direction)


def _owner(record: Any) -> Owner | None:
    """An owner record's usable fields (a shared store is anyone's: a pid of "1; touch x" is no pid)."""
    if not isinstance(record, dict):
        return None
    pid, started = record.get("pid"), record.get("started")
    heartbeat, since = record.get("heartbeat"), record.get("since")
    owner = Owner(
        host=record.get("host") if _text(record.get("host")) else None,
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) and 1 <= pid < 2**31 else None,
        started=started if isinstance(started, int) and not isinstance(started, bool) else None,
        since=float(since) if _finite(since) else None,
        heartbeat=float(heartbeat) if _finite(heartbeat) and 0 < heartbeat <= MAX_HEARTBEAT else None,
    )
    return None if owner == Owner() else owner


def _row(t, name: str) -> Row:
    where = _where(name, t.number)
    user, system = t.user_attrs, t.system_attrs
    params = {}
    for k, v in t.params.items():
        if not (isinstance(k, str) and isinstance(v, _SCALARS)) or (isinstance(v, float) and not math.isfinite(v)):
            raise _bad(where, f"parameter {printable(k)!r}", v)
        params[k] = v
    reported = {int(s): float(v) for s, v in t.intermediate_values.items() if _finite(v)}
    run_dir = user.get("run_dir")
    if run_dir is not None and not _text(run_dir):
        raise _bad(where, "its run folder (run_dir)", run_dir)
    config = user.get("config")
    if config is not None:
        from visiontune.settings.validation import check_types

        if not isinstance(config, dict) or not set(config) <= _SETTINGS:
            raise _bad(where, "its settings (config)", config)
        try:
            check_types(config, f"{where}'s settings (config)")
        except UserError as e:
            raise UserError(f"{printable(e)}; the study store was changed by something else") from None
    history = system.get("retry_history", [])
    if not (isinstance(history, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in history)):
        raise _bad(where, "its retry history (retry_history)", history)
    failed_trial = system.get("failed_trial")
    if failed_trial is not None and not (isinstance(failed_trial, int) and not isinstance(failed_trial, bool)):
        raise _bad(where, "the trial it retries (failed_trial)", failed_trial)
    stopped = system.get(FAILED)
    beat = system.get(BEAT)
    state, value, note = t.state, None, None
    if state == TrialState.COMPLETE:
        if _finite(t.value):
            value = float(t.value)
        else:  # Optuna keeps inf; a best of "val accuracy inf" is no best
            state, note = TrialState.FAIL, f"its value {printable(t.value)} is not a finite number"
    elif state == TrialState.PRUNED and reported:
        value = reported[max(reported)]
    return Row(
        number=t.number,
        trial_id=t._trial_id,
        state=state,
        value=value,
        reported=reported,
        params=params,
        distributions=dict(t.distributions),
        run_dir=run_dir,
        config=config,
        owner=_owner(system.get(OWNER)),
        owner_recorded=OWNER in system,
        beat=float(beat) if _finite(beat) else None,
        failed_trial=failed_trial,
        retry_history=tuple(history),
        tuner_stopped=printable(stopped) if isinstance(stopped, str) else None,
        started=t.datetime_start,
        completed=t.datetime_complete,
        note=note,
    )


def trials(study, states: tuple[TrialState, ...] | None = None) -> list[Row]:
    """The study's trials (those in ``states``, as Optuna stores them), each read through the schema."""
    try:
        stored = study.get_trials(deepcopy=False, states=states)
    except Exception as e:  # Optuna decoding a record it did not write (a categorical index out of range...)
        raise UserError(
            f"{_where(study.study_name)}: a trial record Optuna cannot read ({type(e).__name__}: "
            f"{printable(str(e).splitlines()[0] if str(e) else '')[:200]}); the study store was changed by "
            "something else: repair it or give another --study"
        ) from None
    return [_row(t, study.study_name) for t in stored]


def best(rows: list[Row], direction: str) -> Row | None:
    """The finished trial with the best finite value (the first of equals), or None."""
    done = [r for r in rows if r.state == TrialState.COMPLETE and r.value is not None]
    if not done:
        return None
    pick = min if direction == "minimize" else max
    return pick(done, key=lambda r: r.value)


def count(rows: list[Row], *states: TrialState) -> int:
    return sum(r.state in states for r in rows)
