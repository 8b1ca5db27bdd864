"""Checkpoints: interrupted writes leave a resumable run, damaged checkpoints are skipped, mismatches refused."""

from __future__ import annotations

import gc
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from trainrun import (
    assert_same_weights,
    checkpoints,
    final_weights,
    train_argv,
)
from visiontune import cli
from visiontune.errors import UserError
from visiontune.runs import checkpoint, resume
from visiontune.tasks import AUTO


class Killed(BaseException):
    """Stands in for SIGKILL arriving at one point of a checkpoint write."""


def _fail_on_call(n: int):
    calls = {"n": 0}

    def hook(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise Killed()

    return hook


KILL_POINTS = {
    # while Accelerate writes the files (the temp folder holds some of them)
    "during save_state": ("save_state", None),
    # all files written, visiontune.json not yet
    "before the record": ("_sha256", None),
    # complete temp folder, not yet renamed
    "before the rename": ("_publish", None),
}


@pytest.mark.slow
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_kill_while_writing_a_checkpoint_leaves_a_resumable_run(tmp_path, small_data, monkeypatch, point, capsys):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = train_argv(small_data, out, "--save-every-steps", "2", "--epochs", "1")[3:]
    what = KILL_POINTS[point][0]
    if what == "save_state":
        from accelerate import Accelerator

        real = Accelerator.save_state
        hook = _fail_on_call(2)

        def partial_save(self, output_dir=None, **kw):
            (open(os.path.join(output_dir, "model.safetensors"), "wb")).write(b"\x00" * 100)
            hook()
            return real(self, output_dir, **kw)

        monkeypatch.setattr(Accelerator, "save_state", partial_save)
    else:
        real = getattr(checkpoint, what)
        hook = _fail_on_call(2 if what == "_publish" else 5)  # the second checkpoint (its 5th file hash)

        def failing(*a, **kw):
            hook()
            return real(*a, **kw)

        monkeypatch.setattr(checkpoint, what, failing)
    with pytest.raises(Killed):
        cli.main(args)
    monkeypatch.undo()
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    # The interrupted write never shows under a final name; the first checkpoint is intact.
    assert [p.name for p in checkpoints(out)] == ["epoch0001-batch0000002"]
    assert checkpoint.latest(str(out)).path.endswith("epoch0001-batch0000002")
    capsys.readouterr()
    assert cli.main([*args, "--resume", "auto"]) == 0
    assert f"resuming from {out}/checkpoints/epoch0001-batch0000002" in capsys.readouterr().out
    assert (out / "checkpoints" / "epoch0001-end").is_dir()
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the leftover was cleared when rewritten


def _finished_args(small_data, out) -> list[str]:
    return train_argv(small_data, out, "--save-every-steps", "4", "--epochs", "1")[3:]


@pytest.fixture(scope="module")
def _finished(tmp_path_factory, small_data):
    """Trained once per module: a one-epoch run with checkpoints after steps 4 and 8 (the epoch end)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert cli.main(_finished_args(small_data, out)) == 0
    return out


@pytest.fixture
def finished_run(_finished, tmp_path, small_data, monkeypatch):
    """A copy of that run for one test to damage or resume (checkpoints record no absolute paths)."""
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = shutil.copytree(_finished, tmp_path / "run")
    return out, _finished_args(small_data, out)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "garble record", "remove file"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(finished_run, capsys, damage):
    out, args = finished_run
    newest = out / "checkpoints" / "epoch0001-end"
    if damage == "truncate":
        data = (newest / "model.safetensors").read_bytes()
        (newest / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "garble record":
        (newest / "visiontune.json").write_text('{"format": 1, ')
    else:
        (newest / "optimizer.bin").unlink()
    capsys.readouterr()
    assert cli.main([*args, "--epochs", "1", "--resume", "auto"]) == 0
    said = capsys.readouterr().out
    assert f"checkpoint {newest} is unusable" in said
    assert f"resuming from {out}/checkpoints/epoch0001-batch0000004" in said
    assert checkpoint.verify(str(newest))["epoch"] == 1  # rewritten whole by the resumed run


@pytest.mark.slow
@pytest.mark.parametrize(
    "change,expected",
    [
        (["--batch-size", "8"], "the global batch"),
        (["--model", "squeezenet1_0"], "the model"),
        (["--seed", "7"], "the data split"),
        (["--image-size", "48"], "resized differently from the checkpoint's (32 px bilinear no crop there, 48 px"),
        (["--interpolation", "bicubic"], "(32 px bilinear no crop there, 32 px bicubic no crop now)"),
        (["--crop-pct", "0.5"], "(32 px bilinear no crop there, 32 px bilinear crop 0.5 now)"),
        (
            ["--decode", "fast"],
            "decoded with --decode exact, this run's with --decode fast; resume with --decode exact",
        ),
    ],
)
def test_resume_refuses_a_different_batch_model_or_split(finished_run, capsys, change, expected):
    out, args = finished_run
    capsys.readouterr()
    assert cli.main([*args, "--resume", str(out), *change]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot resume" in err[0] and expected in err[0], err


@pytest.mark.slow
def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused(finished_run, capsys):
    out, args = finished_run
    assert cli.main(args) == 2
    assert "--resume auto" in capsys.readouterr().err


class _Sentinel:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.slow
def test_a_checkpoint_file_that_runs_code_is_refused_unrun(finished_run, capsys, tmp_path):
    out, args = finished_run
    newest = out / "checkpoints" / "epoch0001-end"
    sentinel = tmp_path / "pwned"
    (newest / "optimizer.bin").write_bytes(pickle.dumps(_Sentinel(str(sentinel))))
    # A forger can also fix the record's hashes: loading must still not unpickle code.
    record = json.loads((newest / "visiontune.json").read_text())
    record["files"]["optimizer.bin"] = [
        (newest / "optimizer.bin").stat().st_size,
        checkpoint._sha256(newest / "optimizer.bin"),
    ]
    (newest / "visiontune.json").write_text(json.dumps(record))
    assert cli.main([*args, "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "cannot load checkpoint" in err and "weights_only" not in err  # no advice to load it unsafely
    assert not sentinel.exists()


def test_resume_auto_needs_an_output_dir(small_data, capsys):
    assert cli.main(["train", "--data", str(small_data), "--resume", "auto"]) == 2
    assert "--output-dir" in capsys.readouterr().err


@pytest.mark.slow
def test_checkpoint_record_holds_position_history_and_split(finished_run):
    out, _ = finished_run
    meta = checkpoint.verify(str(out / "checkpoints" / "epoch0001-batch0000004"))
    split = json.loads((out / "split.json").read_text())
    assert (meta["epoch"], meta["batch"], meta["optimizer_steps"]) == (0, 4, 4)
    assert meta["split_sha256"] == split["sha256"] and meta["global_batch"] == 4
    assert meta["partial_totals"][2] == 16  # images trained on so far in the epoch
    assert meta["history"] == []
    end = checkpoint.verify(str(out / "checkpoints" / "epoch0001-end"))
    # history.json counts epochs from 1, as the terminal does ("Epoch 1/1"), and so is the folder named: its
    # epoch 1 ends in epoch0001-end. The checkpoint keeps the loop's own count from 0 beside where training
    # goes on, and is history.json's rows otherwise.
    written = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in written] == [1] and [h["epoch"] for h in end["history"]] == [0]
    assert [{**h, "epoch": h["epoch"] + 1} for h in end["history"]] == written
    assert (end["epoch"], end["batch"]) == (1, 0)
    weights = load_file(str(out / "best.safetensors"))
    assert set(weights) == set(final_weights(out, epochs=1))


def _copy_checkpoint(run: Path, name: str, to: Path, *extra: str) -> Path:
    """``to`` as a run folder holding only checkpoint ``name`` of ``run`` (and ``extra`` files of it)."""
    (to / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / name, to / "checkpoints" / name)
    for f in extra:
        shutil.copy2(run / f, to / f)
    return to


@pytest.mark.slow
def test_resume_into_a_new_output_dir_that_does_not_exist_yet(tmp_path, small_data, baseline_run, monkeypatch):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    old = _copy_checkpoint(baseline_run, "epoch0002-batch0000007", tmp_path / "old", "best.safetensors")
    new = tmp_path / "new" / "run"
    args = train_argv(small_data, new, "--save-every-steps", "3")[3:]
    assert cli.main([*args, "--resume", str(old)]) == 0
    assert_same_weights(final_weights(new), final_weights(baseline_run))
    assert (new / "best.safetensors").is_file()


def test_checkpoint_folders_are_named_as_the_console_counts_and_old_names_still_sort_by_position(tmp_path):
    assert checkpoint.name(0, 12) == "epoch0001-batch0000012"  # taken in "Epoch 1/N" after 12 batches
    assert checkpoint.name(1, 0) == "epoch0001-end"  # "Epoch 1/N" and its validation done
    old_and_new = {
        "e0000-b0000003": 1,  # older visiontune: epoch 0 (from 0) after 3 batches
        "epoch0001-batch0000006": 2,
        "e0001-b0000000": 3,  # older visiontune: the start of epoch 1 (from 0), the end of "Epoch 1/N"
        "epoch0002-batch0000002": 4,
        "epoch0002-end": 5,
    }
    for folder in old_and_new:
        (tmp_path / "checkpoints" / folder).mkdir(parents=True)
    (tmp_path / "checkpoints" / ".tmp-epoch0003-batch0000001").mkdir()  # never a checkpoint
    listed = [Path(p).name for p in checkpoint.listed(str(tmp_path))]
    assert listed == sorted(old_and_new, key=old_and_new.get, reverse=True)  # newest first


@pytest.mark.slow
def test_a_run_folder_with_an_old_style_checkpoint_name_resumes(
    tmp_path, small_data, baseline_run, monkeypatch, capsys
):
    """A run checkpointed by an older visiontune (folders named by the 0-based next position) goes on, and
    ends as the same checkpoint under today's name does."""
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    ended = {}
    for label, folder in (("old", "e0001-b0000007"), ("new", "epoch0002-batch0000007")):  # 2nd epoch, 7 batches
        out = tmp_path / label
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(baseline_run / "checkpoints" / "epoch0002-batch0000007", out / "checkpoints" / folder)
        args = train_argv(small_data, out, "--save-every-steps", "3")[3:]
        assert cli.main([*args, "--resume", "auto"]) == 0
        assert f"resuming from {out}/checkpoints/{folder} (Epoch 2/2, after batch 7)" in capsys.readouterr().out
        assert json.loads((out / "summary.json").read_text())["epochs"] == 2
        ended[label] = final_weights(out)
    assert_same_weights(ended["old"], ended["new"])


@pytest.mark.slow
def test_resume_with_the_global_batch_split_another_way_starts_at_the_same_sample(
    tmp_path, small_data, baseline_run, monkeypatch, capsys
):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = _copy_checkpoint(baseline_run, "epoch0002-batch0000007", tmp_path / "run")  # 28 of 32 samples of epoch 1
    args = train_argv(small_data, out, "--save-every-steps", "3")[3:]
    # Global batch 4 either way: 4 x 1 there, 2 x 2 here.
    assert cli.main([*args, "--resume", "auto", "--batch-size", "2", "--grad-accum", "2"]) == 0
    assert checkpoint.verify(str(out / "checkpoints" / "epoch0002-batch0000007"))["samples"] == 28
    assert "(Epoch 2/2, after batch 14)" in capsys.readouterr().out
    history = json.loads((out / "history.json").read_text())
    assert [h["train"]["images"] for h in history] == [32, 32]  # not 28 + 18 from the wrong unit


def test_the_position_is_translated_in_samples_and_refused_off_an_optimizer_step():
    meta = {
        "epoch": 0,
        "batch": 4,
        "samples": 16,
        "split_sha256": "s",
        "model": "m",
        "num_classes": 2,
        "global_batch": 8,
        "world_size": 1,
        "config": {"batch_size": 4, "grad_accum": 2},
    }
    same = {k: meta[k] for k in ("split_sha256", "model", "num_classes", "global_batch")}
    ckpt = checkpoint.Checkpoint("c", meta)
    assert resume.compatible(ckpt, {**same, "batch_samples": 2, "grad_accum": 4}).batch == 8
    assert resume.compatible(ckpt, {**same, "batch_samples": 8, "grad_accum": 1}).batch == 2
    odd = checkpoint.Checkpoint("c", {**meta, "samples": 12})  # mid-window: not a point any run saves at
    with pytest.raises(UserError, match="cannot resume exactly: the checkpoint is 12 samples into Epoch 1"):
        resume.compatible(odd, {**same, "batch_samples": 8, "grad_accum": 1})


def test_a_resume_with_other_flips_or_crop_is_refused_and_older_checkpoints_are_not_asked():
    view = {"augment": "light", "hflip": 0.0, "vflip": 0.5, "crop_scale": [0.5, 1.0]}  # crop_scale as JSON has it
    meta = {"epoch": 0, "batch": 0, "samples": 0, "split_sha256": "s", "model": "m", "num_classes": 2}
    meta.update(global_batch=4, world_size=1, config={"batch_size": 4, "grad_accum": 1, **view})
    same = {k: meta[k] for k in ("split_sha256", "model", "num_classes", "global_batch")}
    now = {**same, "batch_samples": 4, "grad_accum": 1, **view, "crop_scale": (0.5, 1.0)}
    assert resume.compatible(checkpoint.Checkpoint("c", meta), now).batch == 0
    with pytest.raises(UserError, match=r"augmentation differs .*\(--hflip 0 there, --hflip 0.5 now\)"):
        resume.compatible(checkpoint.Checkpoint("c", meta), {**now, "hflip": 0.5})
    with pytest.raises(UserError, match=r"\(--crop-scale 0.5 1 there, --crop-scale 0.2 1 now\)"):
        resume.compatible(checkpoint.Checkpoint("c", meta), {**now, "crop_scale": (0.2, 1.0)})
    older = {**meta, "config": {"batch_size": 4, "grad_accum": 1, "augment": "light"}}  # before --hflip existed
    assert resume.compatible(checkpoint.Checkpoint("c", older), now).batch == 0


def _no_space_line(capsys, out) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on the disk of" in err[0] and "needs about" in err[0], err
    assert f"{out}/checkpoints/epoch0001-batch0000002 is kept" in err[0] and f"--resume {out}" in err[0]
    return err[0]


def _only_the_first_checkpoint_is_left(out) -> None:
    assert [p.name for p in checkpoints(out)] == ["epoch0001-batch0000002"]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    checkpoint.verify(str(out / "checkpoints" / "epoch0001-batch0000002"))


@pytest.mark.slow
def test_too_little_free_space_stops_before_writing(tmp_path, small_data, monkeypatch, capsys):
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    probes = []
    monkeypatch.setattr(
        checkpoint,
        "_free_bytes",
        lambda folder: probes.append(folder) and 0 or (10**12 if len(probes) == 1 else 3 * checkpoint.MB),
    )
    assert cli.main(train_argv(small_data, out, "--save-every-steps", "2", "--epochs", "1")[3:]) == 2
    line = _no_space_line(capsys, out)
    assert "3 MB are free" in line
    _only_the_first_checkpoint_is_left(out)


@pytest.mark.slow
def test_a_disk_that_fills_up_while_writing_leaves_the_previous_checkpoint(tmp_path, small_data, monkeypatch, capsys):
    from accelerate import Accelerator

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    real, calls = Accelerator.save_state, []

    def filling(self, output_dir=None, **kw):
        calls.append(output_dir)
        if len(calls) == 2:
            (Path(output_dir) / "model.safetensors").write_bytes(b"\x00" * 1000)
            raise OSError(28, "No space left on device")
        return real(self, output_dir, **kw)

    monkeypatch.setattr(Accelerator, "save_state", filling)
    assert cli.main(train_argv(small_data, out, "--save-every-steps", "2", "--epochs", "1")[3:]) == 2
    _no_space_line(capsys, out)
    _only_the_first_checkpoint_is_left(out)


@pytest.mark.slow
def test_a_real_full_disk_while_writing(tmp_path, small_data, monkeypatch, capsys):
    """On a 9 MB tmpfs: the first checkpoint (about 6 MB) fits, the second runs out of space mid-write."""
    out = tmp_path / "disk"
    out.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(out)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here; the monkeypatched full-disk tests above cover the code")
    try:
        monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
        monkeypatch.setattr(checkpoint, "_free_bytes", lambda folder: 10**12)  # so the write itself fails
        assert cli.main(train_argv(small_data, out, "--save-every-steps", "2", "--epochs", "1")[3:]) == 2
        _no_space_line(capsys, out)
        _only_the_first_checkpoint_is_left(out)
    finally:
        gc.collect()  # the failed writer's file objects live in traceback cycles until collected
        subprocess.run(["umount", "--lazy", str(out)], check=True)


@pytest.mark.slow
def test_a_tampered_rng_file_is_refused_not_skipped(finished_run, capsys):
    out, args = finished_run
    newest = out / "checkpoints" / "epoch0001-end"
    (newest / "random_states_0.pkl").write_bytes(pickle.dumps(_Sentinel("/nonexistent/x")))
    record = json.loads((newest / "visiontune.json").read_text())
    record["files"]["random_states_0.pkl"] = [
        (newest / "random_states_0.pkl").stat().st_size,
        checkpoint._sha256(newest / "random_states_0.pkl"),
    ]
    (newest / "visiontune.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert cli.main([*args, "--epochs", "2", "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "random_states_0.pkl" in err[0] and "never unpickles" in err[0], err


@pytest.mark.slow
def test_refusals_give_the_command_that_works(finished_run, capsys):
    out, args = finished_run
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"add --resume auto (with --output-dir {out})" in err and "give another --output-dir" in err
    for ckpt in checkpoints(out):
        (ckpt / "model.safetensors").write_bytes(b"")
    assert cli.main([*args, "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no intact checkpoint" in err and "--output-dir NEW_DIR and without --resume" in err


@pytest.mark.slow
def test_a_run_from_before_the_stratified_split_resumes_and_reruns_with_its_shuffle(
    tmp_path, small_data, monkeypatch, capsys
):
    from visiontune.data.sources import discover
    from visiontune.data.split import RANDOM, relative_paths, split_of

    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "cache"))
    old = tmp_path / "old"
    args = _finished_args(small_data, old)
    assert cli.main([*args, "--split-method", "random"]) == 0
    # As a run from before --split-method left its folder: no split_method in config.json, no method in
    # split.json (the sha256 covers the lists only).
    record = json.loads((old / "config.json").read_text())
    del record["config"]["split_method"]
    (old / "config.json").write_text(json.dumps(record))
    (tmp_path / "before.json").write_text(json.dumps(record))
    lists = json.loads((old / "split.json").read_text())
    del lists["method"]
    (old / "split.json").write_text(json.dumps(lists))
    images = discover(str(small_data), task=AUTO)
    stratified = split_of(images, 0.2, 42)
    assert relative_paths(images.paths, stratified.val.tolist(), images.root) != lists["val"]  # a test that tells
    capsys.readouterr()
    # Resumed with today's default flags: the checkpoint's split is the shuffle, and the run keeps it.
    assert cli.main([*args[:-2], "--epochs", "2", "--resume", "auto"]) == 0
    said = capsys.readouterr().out
    assert f"visiontune: {old} was split with --split-method random; the resumed run keeps it" in said
    assert f"resuming from {old}/checkpoints/" in said  # the old-style name, found and resumed
    after = json.loads((old / "split.json").read_text())
    assert (after["train"], after["val"], after["method"]) == (lists["train"], lists["val"], RANDOM)
    # --config of that config.json: a new run on the same split.
    new = tmp_path / "new"
    assert cli.main(["train", "--config", str(tmp_path / "before.json"), "--output-dir", str(new)]) == 0
    again = json.loads((new / "split.json").read_text())
    assert (again["train"], again["val"], again["sha256"]) == (lists["train"], lists["val"], lists["sha256"])
