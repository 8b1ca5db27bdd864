"""``--cache fit``, the default: the user cache folder when the array fits under the cap, else (too big, or a
folder that cannot be written) one line and the files decoded every epoch; the trained weights are the same."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shutil

import pytest

import visiontune.loading.cache as cache_mod
from trainrun import SQUEEZENET, assert_same_weights, final_weights, flags
from visiontune.cli.commands import main
from visiontune.data import sources
from visiontune.loading import jobdata
from visiontune.settings.config import TrainConfig
from visiontune.tasks import AUTO
from visiontune.training import plan

ARGS = [*SQUEEZENET, *flags(epochs=1, batch_size=4, num_workers=0)]
BUILD = "building the image cache"


@pytest.fixture(scope="module")
def default_runs(small_data, tmp_path_factory):
    """Runs on ``small_data`` (40 images at 32 px: a 120 KiB cache): name -> (run folder, stdout, user cache files)."""
    tmp = tmp_path_factory.mktemp("default-cache")
    out = {}

    def train(name: str, user: str, *extra: str) -> None:
        mp.setenv("VISIONTUNE_CACHE_DIR", str(tmp / user))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(["train", *flags(data=small_data, output_dir=tmp / name), *ARGS, *extra])
        assert code == 0, printed.getvalue()[-2000:]
        # The image cache's files (the scan keeps its verdicts beside them, as scan-*, and the model check its
        # list of torchvision's names, as model-names-*)
        others = ("scan-", "model-names-")
        files = {p.name: p.stat().st_mtime_ns for p in (tmp / user).iterdir() if not p.name.startswith(others)}
        out[name] = (tmp / name, printed.getvalue(), files)

    with pytest.MonkeyPatch.context() as mp:
        train("first", "user", "--save-every-steps", "4")  # a checkpoint half way through the epoch, too
        # The first run as if stopped after step 4, continued without a cache: the cache is for speed only.
        shutil.copytree(tmp / "first", tmp / "resumed")
        shutil.rmtree(tmp / "resumed" / "checkpoints" / "epoch0001-end")
        train("resumed", "user", "--resume", "auto", "--cache", "off")
        train("second", "user")
        train("off", "off-user", "--cache", "off")
        # A disk whose quarter of the free space is one byte short of the cache: over the cap.
        need = 40 * 3 * 32 * 32
        mp.setattr(cache_mod, "free_bytes", lambda folder: 4 * (need - 1))
        train("over", "small-disk")
    return out


def _record(run, name: str) -> dict:
    return json.loads((run / name).read_text())["image_cache"]


@pytest.mark.slow
def test_the_default_builds_the_cache_in_the_user_cache_folder_and_the_next_run_reuses_it(default_runs):
    first, printed, files = default_runs["first"]
    arrays = [name for name in files if name.endswith(".u8")]
    assert len(arrays) == 1 and printed.count(BUILD) == 1
    path = str(first.parent / "user" / arrays[0])
    for name in ("config.json", "summary.json"):
        assert _record(first, name) == {"setting": "fit", "path": path, "why": "--cache fit: built, 0.1 MiB"}
    assert f"image cache      {path} (--cache fit: built" in printed
    second, printed, again = default_runs["second"]
    # Nothing rebuilt: the same files, the array not rewritten; the header, once the array hashed to its
    # digest again, took a fresh stamp (loading/cache.py: the next start need not hash it).
    arrays = {n: t for n, t in files.items() if n.endswith(".u8")}
    assert BUILD not in printed and again.keys() == files.keys()
    assert {n: t for n, t in again.items() if n.endswith(".u8")} == arrays
    assert _record(second, "summary.json")["why"] == "--cache fit: reused, 0.1 MiB"
    assert_same_weights(final_weights(first, 1), final_weights(second, 1))


@pytest.mark.slow
def test_a_run_continued_with_another_cache_setting_ends_with_the_same_weights(default_runs):
    resumed, printed, _ = default_runs["resumed"]
    assert "resuming from" in printed and "epoch0001-batch0000004" in printed
    assert _record(resumed, "summary.json")["setting"] == "off"
    assert_same_weights(final_weights(default_runs["first"][0], 1), final_weights(resumed, 1))


@pytest.mark.slow
def test_off_decodes_every_epoch_and_trains_the_same_weights_as_the_default(default_runs):
    off, printed, files = default_runs["off"]
    assert BUILD not in printed and not files
    assert _record(off, "summary.json") == {
        "setting": "off",
        "path": None,
        "why": "--cache off: every epoch decodes the images",
    }
    assert_same_weights(final_weights(default_runs["first"][0], 1), final_weights(off, 1))


@pytest.mark.slow
def test_a_data_set_over_the_cap_says_so_in_one_line_and_trains_as_off(default_runs):
    over, printed, files = default_runs["over"]
    lines = [line for line in printed.splitlines() if "no image cache" in line]
    assert len(lines) == 1 and BUILD not in printed, printed
    assert "the cache would take 0.1 MiB, over --cache fit's cap" in lines[0] and "pass --cache DIR" in lines[0]
    assert not files
    record = _record(over, "config.json")
    assert record["setting"] == "fit" and record["path"] is None and "over --cache fit's cap" in record["why"]
    assert_same_weights(final_weights(default_runs["off"][0], 1), final_weights(over, 1))


def test_a_cache_folder_that_cannot_be_written_falls_back_to_the_scan(small_data, tmp_path, monkeypatch, capsys):
    """A quota that runs out while the array is written: one line, no half cache, the scan finds the bad files."""
    user = tmp_path / "user"
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(user))
    real = cache_mod.atomic_file

    @contextlib.contextmanager
    def over_quota(path):
        with real(path) as f:
            f.write(b"\0" * 1000)
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        yield  # never reached

    monkeypatch.setattr(cache_mod, "atomic_file", over_quota)
    (data := tmp_path / "data" / "train").mkdir(parents=True)
    for f in (small_data / "train").iterdir():
        (data / f.name).write_bytes(f.read_bytes())
    (data / "cat.999.jpg").write_bytes(b"not a jpeg")
    cfg = plan.view(
        TrainConfig(data=str(data.parent), model="squeezenet1_1", image_size=32)
    ).cfg  # as train resolves it
    bad, cache, choice = jobdata._screen(cfg, sources.discover(str(data.parent), task=AUTO))
    assert cache is None and choice.path is None and "no space was left" in choice.why
    assert [p for p, _ in bad] == [str(data / "cat.999.jpg")]  # found by the scan instead
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if "no image cache" in line]) == 1, out
    assert not [p.name for p in user.iterdir() if not p.name.startswith("scan-")]  # no array, no temp file
