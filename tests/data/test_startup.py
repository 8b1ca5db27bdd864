"""Start-up at scale: one listing per job, a scan no collective times out on, one decode per cached file,
and a split record that round-trips at size with a stable hash."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter

import pytest

from conftest import PYTHON, _worker_env
from trainrun import SQUEEZENET, flags, run
from visiontune.cli.commands import main
from visiontune.data import check, decode, sources
from visiontune.data.sample import make_sample_data
from visiontune.data.split import (
    make_split,
    split_record,
    split_summary,
    write_split,
)
from visiontune.runs import runrecords

TINY = [*SQUEEZENET, *flags(epochs=1, batch_size=4, num_workers=0)]

# Run in the job's launching process (a sitecustomize on PYTHONPATH; its workers are forks of it, or run it too):
# counts discover(task=AUTO) calls and decodes, and makes each decode slow.
HOOKS = """
import os, threading, time
if os.environ.get("VT_TEST_LOG"):
    import visiontune.data.check as check
    import visiontune.data.sources as sources

    def note(what):
        with open(os.environ["VT_TEST_LOG"], "a") as f:
            f.write(f"{what} {os.getpid()}\\n")

    real_discover, real_check = sources.discover, check._check_one
    one_at_a_time = threading.Lock()  # the scan's duration does not depend on the core count

    def discover(*args, **kwargs):
        note("discover")
        return real_discover(*args, **kwargs)

    def slow_check(*args, **kwargs):
        note("decode")
        with one_at_a_time:
            time.sleep(float(os.environ["VT_TEST_DECODE_DELAY"]))
        return real_check(*args, **kwargs)

    sources.discover, check._check_one = discover, slow_check
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("startup") / "data"
    make_sample_data(out, per_class=7, test_count=0, seed=1)  # 14 images: 11 train, one global batch of 8
    return out


@pytest.mark.distributed
def test_ddp_job_whose_scan_outlasts_the_timeout_completes_and_lists_once(data, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOKS)
    log = tmp_path / "calls.log"
    env = _worker_env()
    # 14 files x 0.3 s, one at a time: the scan takes >= 4.2 s, 1.4 times --timeout.
    env.update(
        PYTHONPATH=f"{hooks}:{env['PYTHONPATH']}",
        VT_TEST_LOG=str(log),
        VT_TEST_DECODE_DELAY="0.3",
        VISIONTUNE_CACHE_DIR=str(tmp_path / "cache"),
    )
    out = tmp_path / "run"
    argv = [PYTHON, "-m", "visiontune", "train", *flags(data=data), *TINY]
    # --cache off: the scan, not the cache build that replaces it by default. Forked, the hook run first.
    done = run([*argv, *flags(strategy="ddp", nproc=2, timeout=3, output_dir=out, cache="off")], env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    calls = Counter(line.split()[0] for line in log.read_text().splitlines())
    assert calls["discover"] == 1, calls  # the command listed the folder; neither worker did
    assert calls["decode"] == 14, calls  # one machine, one scan: each file decoded once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["train_split_size"] + summary["val_split_size"] == 14


@pytest.mark.slow
def test_single_process_job_lists_the_data_once(data, tmp_path, monkeypatch):
    calls = []
    real = sources.discover
    monkeypatch.setattr(sources, "discover", lambda d, *a, **kw: calls.append(d) or real(d, *a, **kw))
    assert main(["train", "--data", str(data), *TINY, "--output-dir", str(tmp_path / "run")]) == 0
    assert calls == [str(data)]


@pytest.mark.slow
def test_first_cached_run_decodes_each_file_exactly_once(data, tmp_path, monkeypatch):
    decoded = []
    real = decode.read_image

    def counting(path, **kwargs):
        decoded.append(str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(decode, "read_image", counting)  # what the cache build calls
    monkeypatch.setattr(check, "read_image", counting)  # what the bad-file scan calls
    (data_copy := tmp_path / "data").mkdir()
    for f in (data / "train").iterdir():
        (data_copy / "train").mkdir(exist_ok=True)
        (data_copy / "train" / f.name).write_bytes(f.read_bytes())
    (data_copy / "train" / "cat.99.jpg").write_bytes(b"not a jpeg")  # a bad file: found by the build
    run, again = tmp_path / "run", tmp_path / "again"
    argv = ["train", *flags(data=data_copy, cache=tmp_path / "c", max_bad_fraction=0.1), *TINY]
    assert main([*argv, "--output-dir", str(run)]) == 0
    files = sorted(str(p) for p in (data_copy / "train").iterdir())
    assert sorted(decoded) == files  # 15 files, 15 decodes
    rows = (run / "bad_files.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == [str(data_copy / "train" / "cat.99.jpg")]
    decoded.clear()
    assert main([*argv, "--output-dir", str(again)]) == 0
    assert decoded == []  # the warm cache decodes nothing, and still knows the bad file
    assert (again / "bad_files.csv").read_text() == (run / "bad_files.csv").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dir", "off"])
def test_a_damaged_cache_of_the_bad_files_is_read_again_and_the_run_names_the_same_bad_files(
    data, tmp_path, monkeypatch, capsys, cache
):
    """The image cache's header (--cache DIR) and the bad-file scan's cache (--cache off), damaged between two
    runs: the second run decodes again what it cannot trust and names the same bad files, without a traceback."""
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", str(tmp_path / "user-cache"))
    shutil.copytree(data, data_copy := tmp_path / "data")
    (data_copy / "train" / "cat.99.jpg").write_bytes(b"not a jpeg")
    folder = tmp_path / "c" if cache == "dir" else "off"
    argv = ["train", *flags(data=data_copy, cache=folder, max_bad_fraction=0.1), *TINY]
    assert main([*argv, "--output-dir", str(run := tmp_path / "run")]) == 0
    if cache == "dir":
        [header] = (tmp_path / "c").glob("*.json")
        header.write_text(json.dumps({**json.loads(header.read_text()), "bad": {"0": "not a row"}}))
    else:
        [verdicts] = (tmp_path / "user-cache").glob("scan-*.bad")
        with open(verdicts, "a") as f:
            f.write('[-1, "x"]\n[Infinity, "y"]\n' + "[" * 5000 + "\n")
    capsys.readouterr()
    assert main([*argv, "--output-dir", str(again := tmp_path / "again")]) == 0
    assert (again / "bad_files.csv").read_text() == (run / "bad_files.csv").read_text()
    assert "cat.99.jpg" in (again / "bad_files.csv").read_text() and "Traceback" not in capsys.readouterr().err


def test_split_record_round_trips_at_100k_files_with_a_stable_hash(tmp_path):
    n = 100_000
    paths = [f"/data/train/c{i % 1000}/img_{i:06d}.jpg" for i in range(n)]
    split = make_split(n, 0.2, 7)
    record = split_record(split, paths, "/data", 7, 0.2)
    summary = split_summary(split, paths, "/data", 7, 0.2)
    write_split(str(tmp_path / "split.json"), summary, split, paths, "/data")  # streamed, chunk by chunk
    back = runrecords.read_split_record(tmp_path / "split.json")
    assert back == record and back["counts"] == {"train": 80_000, "val": 20_000}
    assert summary == {k: v for k, v in record.items() if k not in ("train", "val")}
    # The hash is the one every earlier release wrote (resume compares it): computed here independently.
    lists = {
        "train": [paths[i][len("/data/") :] for i in split.train],
        "val": [paths[i][len("/data/") :] for i in split.val],
    }
    assert back["sha256"] == hashlib.sha256(json.dumps(lists, sort_keys=True).encode()).hexdigest()
    assert split_record(make_split(n, 0.2, 7), paths, "/data/", 7, 0.2)["sha256"] == back["sha256"]
    raw = (tmp_path / "split.json").read_bytes()
    assert raw.count(b"\n") == 1 and b", " not in raw  # compact: no indentation, no padding
    record_text = json.dumps(record)
    (tmp_path / "edited.json").write_text(record_text.replace("img_000001", "img_999999"))
    from visiontune.errors import UserError

    with pytest.raises(UserError, match="do not match its sha256"):
        runrecords.read_split_record(tmp_path / "edited.json")
