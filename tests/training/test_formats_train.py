"""Training on hf: data and on shards keeps a folder's guarantees: the same split and numbers, bad samples
skipped and counted, exact resume after kill -9, every validation image counted once under DDP."""

from __future__ import annotations

import http.server
import json
import os
import random
import re
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import azureserver
import gcsserver
import s3server
from conftest import FAST, _worker_env
from s3server import CREDENTIALS, s3_server
from trainrun import PYTHON, SQUEEZENET, assert_same_weights, env_for, flags, run, start, wait_for
from visiontune.cli.commands import main
from visiontune.data.sample import make_sample_data
from visiontune.data.sources import discover
from visiontune.data.split import relative_paths
from visiontune.runs import checkpoint
from visiontune.tasks import AUTO

datasets = pytest.importorskip("datasets")
pytest.importorskip("webdataset")

# timm's test_resnet: what is compared is the tensors each source trains to, whatever the model.
ONE_EPOCH = flags(model="timm/test_resnet", weights="none", image_size=32, no_progress=True)
ONE_EPOCH += flags(num_workers=0, batch_size=4, epochs=1, timeout=60, max_bad_fraction=0.1)


def _hf_copy(folder: Path, out: Path, splits: dict[str, list[str]] | None = None) -> str:
    """The folder's listing (bad file included) as a datasets set saved with save_to_disk, rows in its order;
    with ``splits`` (split name: the folder's relative names), as those splits, rows in the names' order."""
    images = discover(str(folder), task=AUTO)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=images.classes)})
    rows = {
        "image": [{"bytes": Path(p).read_bytes(), "path": None} for p in images.paths],
        "label": images.labels.tolist(),
    }
    whole = datasets.Dataset.from_dict(rows, features=features)
    if splits is None:
        whole.save_to_disk(str(out))
    else:
        row = {name: i for i, name in enumerate(relative_paths(images.paths, range(len(images)), images.root))}
        parts = {k: whole.select([row[n] for n in names]).flatten_indices() for k, names in splits.items()}
        datasets.DatasetDict(parts).save_to_disk(str(out))
    return f"hf:{out}"


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """One data set three ways: a Kaggle folder with a corrupt file, its shards, and a datasets copy."""
    tmp = tmp_path_factory.mktemp("formats-train")
    make_sample_data(tmp / "data", per_class=10, test_count=0, seed=4)
    (tmp / "data" / "train" / "cat.5.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")
    assert main(["shard", str(tmp / "data"), "--out", str(tmp / "shards"), "--shard-size", "60KB"]) == 0
    return {"folder": str(tmp / "data"), "shards": str(tmp / "shards"), "hf": _hf_copy(tmp / "data", tmp / "hf")}


def _summary(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    return {k: v for k, v in s.items() if "accuracy" in k or "loss" in k or "counted" in k}


@pytest.mark.slow
def test_shards_and_hf_data_train_exactly_like_the_folder_they_were_made_from(tmp_path, formats, capsys):
    runs = {}
    for name, data in formats.items():
        runs[name] = tmp_path / name
        extra = ["--cache", str(tmp_path / f"cache-{name}")] if name != "folder" else []
        assert main(["train", "--data", data, "--output-dir", str(runs[name]), *ONE_EPOCH, *extra]) == 0
    said = capsys.readouterr()
    assert "the split recorded in index.json" in said.out and "building the image cache" in said.out
    weights = {name: load_file(str(r / "best.safetensors")) for name, r in runs.items()}
    assert_same_weights(weights["shards"], weights["folder"])
    assert_same_weights(weights["hf"], weights["folder"])
    assert _summary(runs["shards"]) == _summary(runs["hf"]) == _summary(runs["folder"])
    splits = {name: json.loads((r / "split.json").read_text()) for name, r in runs.items()}
    # Shards keep the folder's names, so the split record is the folder's to the hash; hf rows are named by row.
    assert splits["shards"]["train"] == splits["folder"]["train"] and splits["shards"]["val"] == splits["folder"]["val"]
    assert splits["shards"]["sha256"] == splits["folder"]["sha256"]
    assert splits["hf"]["counts"] == splits["folder"]["counts"] == {"train": 15, "val": 4}
    # The corrupt file: left out when sharding, skipped and reported when training on the folder and the hf rows.
    for name, row in (("folder", "cat.5.jpg"), ("hf", "train/5")):
        report = (runs[name] / "bad_files.csv").read_text().splitlines()
        assert len(report) == 2 and report[1].split(",")[0].endswith(row) and "JPEG" in report[1]
    # The same bad row is more than --max-bad-fraction allows by default: the run stops before training.
    assert main(["train", "--data", formats["hf"], "--output-dir", str(tmp_path / "stop"), *FAST]) == 2
    assert "1 of 20 files are bad" in capsys.readouterr().err


@contextmanager
def _served(folder: str):
    """``folder`` over HTTP on localhost, from a thread of this process: the base URL, and the paths asked."""
    asked: list[str] = []

    class Files(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=folder, **kwargs)

        def log_message(self, *args):
            asked.append(self.path)  # and nothing on stderr

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    thread = threading.Thread(target=server.serve_forever, args=(0.005,), daemon=True)  # its shutdown: at once
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_shards_from_an_http_url_are_copied_whole_and_train_as_the_local_shards(tmp_path, formats, monkeypatch, capsys):
    """`--data URL/shards-{...}.tar`: the shards and index.json fetched through webdataset's opener into the
    shard cache, then trained on exactly as the same shards on disk; the URL is the run's data, so a later
    evaluate finds it (served from the cache, the server gone). A missing URL: one line, exit 2."""
    monkeypatch.setenv("VISIONTUNE_SHARD_CACHE", str(tmp_path / "shard-cache"))
    local = sorted(Path(formats["shards"]).glob("*.tar"))
    pattern = f"shards-{{000000..{len(local) - 1:06d}}}.tar"
    local_run, url_run = tmp_path / "local", tmp_path / "url"
    assert main(["train", "--data", f"{formats['shards']}/{pattern}", "--output-dir", str(local_run), *ONE_EPOCH]) == 0
    with _served(formats["shards"]) as (base, asked):
        url = f"{base}/{pattern}"
        assert main(["train", "--data", url, "--output-dir", str(url_run), *ONE_EPOCH]) == 0
        assert f"downloading {len(local)} of {len(local)} shard(s) of {url}" in capsys.readouterr().out
        assert sorted(asked) == sorted(["/index.json", *(f"/{p.name}" for p in local)])
        asked.clear()
        assert main(["train", "--data", f"{base}/nowhere/{pattern}", "--output-dir", str(tmp_path / "404")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"cannot download {base}/nowhere/shards-000000.tar" in err[0] and "HTTP" in err[0]
        assert "/nowhere/shards-000000.tar" in asked and not (tmp_path / "404").exists()
    assert_same_weights(load_file(str(url_run / "best.safetensors")), load_file(str(local_run / "best.safetensors")))
    assert _summary(url_run) == _summary(local_run)
    local_split, url_split = (json.loads((r / "split.json").read_text()) for r in (local_run, url_run))
    assert (url_split["train"], url_split["val"]) == (local_split["train"], local_split["val"])
    data = json.loads((url_run / "config.json").read_text())["data"]
    assert data == {"root": url, "layout": "shards", "source": url}
    # The cache: each shard and the index whole, byte for byte, and nothing else (no partial download).
    (copies,) = [d for d in (tmp_path / "shard-cache").iterdir() if any(d.glob("*.tar"))]
    assert sorted(p.name for p in copies.iterdir()) == sorted(["index.json", *(p.name for p in local)])
    for p in [*local, Path(formats["shards"]) / "index.json"]:
        assert (copies / p.name).read_bytes() == p.read_bytes(), p.name
    # The server is gone: evaluate reads the run's URL from its cached copies and scores its validation split.
    assert (
        main(["evaluate", "--run", str(url_run), "--out", str(tmp_path / "eval" / "eval.json"), "--no-progress"]) == 0
    )
    scored = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert (scored["data"], scored["split"], scored["own_data"], scored["split_files_missing"]) == (url, "val", True, 0)


STEPS, EPOCHS = 3, 2  # 15 train images at batch 4
# One thread everywhere: the killed run is a subprocess, the reference and the resumed run are in this process,
# and a conv's sums are taken in another order with another thread count.
KILL_RUN = [*SQUEEZENET, *flags(timeout=60, epochs=EPOCHS, batch_size=4, save_every_steps=1, max_bad_fraction=0.1)]
KILL_RUN += flags(threads=1)


@pytest.fixture(scope="module")
def augmented_reference(tmp_path_factory, formats):
    """An uninterrupted --augment run on the folder: what every format's killed-and-resumed run must end with."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--data", formats["folder"], "--output-dir", str(out), *KILL_RUN, "--augment"]) == 0
    return out / "checkpoints" / checkpoint.name(EPOCHS, 0)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["shards", "hf"])
def test_kill_9_mid_epoch_then_resume_ends_with_the_folder_runs_tensors(
    tmp_path, formats, augmented_reference, worker_env, monkeypatch, capsys, fmt
):
    env = env_for(worker_env, tmp_path)
    out = tmp_path / "run"
    argv = [PYTHON, "-m", "visiontune", "train", "--data", formats[fmt], "--output-dir", str(out), *KILL_RUN]
    argv.append("--augment")
    step = random.Random(fmt).randint(1, EPOCHS * STEPS - 2)
    proc = start(argv, env, tmp_path / "killed.log")
    wait_for(out / "checkpoints" / checkpoint.name(*divmod(step, STEPS)), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "checkpoints" / checkpoint.name(EPOCHS, 0)).exists(), "the run ended before the kill"
    monkeypatch.setenv("VISIONTUNE_CACHE_DIR", env["VISIONTUNE_CACHE_DIR"])
    assert main([*argv[3:], "--resume", "auto"]) == 0
    assert "resuming from" in capsys.readouterr().out
    final = out / "checkpoints" / checkpoint.name(EPOCHS, 0)
    assert_same_weights(
        load_file(str(final / "model.safetensors")), load_file(str(augmented_reference / "model.safetensors"))
    )
    got, want = (torch.load(c / "optimizer.bin", weights_only=True)["state"] for c in (final, augmented_reference))
    assert got.keys() == want.keys()
    for k in want:
        assert all(torch.equal(got[k][n], want[k][n]) for n in want[k] if isinstance(want[k][n], torch.Tensor))


# Loaded into every process of a job (launcher and workers) through PYTHONPATH: notes each sample the loaders
# hand to training or validation -- its rank, phase (a train index carries its epoch) and file name -- one
# O_APPEND line each, so the lines of concurrent processes never interleave.
READS = """
import os
if os.environ.get("VT_TEST_READS"):
    from visiontune.loading import pipeline
    from visiontune.loading.augment import EpochIndex

    real = pipeline.ImageDataset._finish

    def _finish(self, i, img):
        phase = f"train {i.epoch}" if isinstance(i, EpochIndex) else "other -"
        name = "/".join(self.paths[i].split("/")[-2:])  # the folder's train/cat.1.jpg, an hf row's train/7
        line = f"{os.environ.get('RANK', '0')} {phase} {name}\\n"
        fd = os.open(os.environ["VT_TEST_READS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return real(self, i, img)

    pipeline.ImageDataset._finish = _finish
"""


def _reads(log: Path) -> dict[tuple[str, str], list[str]]:
    """The names read, in order, by (rank, epoch) for training and by (rank, "other") for the rest."""
    out: dict[tuple[str, str], list[str]] = {}
    for line in log.read_text().splitlines():
        rank, phase, epoch, name = line.split()
        out.setdefault((rank, epoch if phase == "train" else "other"), []).append(name)
    return out


DDP_STEPS = 4  # 16 train images, a global batch of 4


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """An uninterrupted ddp x2 --augment run on a 21-image folder (16 train, 5 validation: odd, so one rank
    has fewer), with what each rank read: the run a killed and resumed job on its shards or its hf: copy
    must end as. Each epoch it read every train image once across the ranks."""
    tmp = tmp_path_factory.mktemp("ddp-reference")
    make_sample_data(tmp / "data", per_class=11, test_count=0, seed=5)
    (tmp / "data" / "train" / "dog.10.jpg").unlink()
    hooks = tmp / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(READS)
    env = env_for(_worker_env(), tmp)
    env["PYTHONPATH"] = f"{hooks}:{env['PYTHONPATH']}"
    ref = {"tmp": tmp, "data": tmp / "data", "run": tmp / "folder-run", "env": env}
    done = run(_ddp_job(ref, str(ref["data"]), ref["run"], tmp / "folder.reads"), env)
    assert done.returncode == 0, done.stderr[-3000:]
    split = json.loads((ref["run"] / "split.json").read_text())
    assert (len(split["train"]), len(split["val"])) == (16, 5)
    ref |= {"split": split, "reads": _reads(tmp / "folder.reads")}
    for e in range(EPOCHS):
        both = ref["reads"]["0", str(e)] + ref["reads"]["1", str(e)]
        assert sorted(both) == sorted(split["train"]) and len(both) == len(split["train"])
    return ref


def _ddp_job(ref: dict, data: str, out: Path, log: Path, *extra: str) -> list[str]:
    ref["env"]["VT_TEST_READS"] = str(log)
    argv = [PYTHON, "-m", "visiontune", "train", "--data", data, "--output-dir", str(out), *SQUEEZENET]
    argv += [*flags(timeout=60, epochs=EPOCHS, batch_size=2, strategy="ddp", nproc=2), "--augment"]
    # --cache off: the read log is written where a file is decoded, and a cached epoch decodes none.
    return argv + [*flags(num_workers=0, save_every_steps=1), "--cache", "off", *extra]


def _killed_and_resumed(ref: dict, data: str, tmp_path: Path, rename=lambda name: name) -> tuple[str, dict]:
    """The ddp job on ``data`` (a copy of the reference's folder) killed with kill -9, launcher and workers,
    after a seeded random step, then ``--resume auto``: its final tensors and per-epoch numbers are the
    reference run's; rank by rank, what the killed job read before the checkpoint it resumed from and
    what the resumed job read after it are together the reference's reads, in order (so every train
    sample once per epoch across the ranks); the validation images were each counted once. ``rename``
    turns ``data``'s sample names into the folder's. The resumed job's output and split record back."""
    env, out = ref["env"], tmp_path / "run"
    proc = start(_ddp_job(ref, data, out, tmp_path / "killed.reads"), env, tmp_path / "killed.log")
    step = random.Random(data.rpartition("/")[2]).randint(1, EPOCHS * DDP_STEPS - 2)
    wait_for(out / "checkpoints" / checkpoint.name(*divmod(step, DDP_STEPS)), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "checkpoints" / checkpoint.name(EPOCHS, 0)).exists(), "the run ended before the kill"
    resumed = run(_ddp_job(ref, data, out, tmp_path / "resumed.reads", "--resume", "auto"), env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    at = re.search(r"resuming from \S+ \(Epoch (\d+)/\d+, after batch (\d+)\)", resumed.stdout)
    assert at, resumed.stdout[-3000:]
    epoch, batch = int(at[1]) - 1, int(at[2])

    # Bit-identical: every tensor of the model and of the optimizer state.
    final, want = (d / "checkpoints" / checkpoint.name(EPOCHS, 0) for d in (out, ref["run"]))
    assert_same_weights(load_file(str(final / "model.safetensors")), load_file(str(want / "model.safetensors")))
    got, expected = (torch.load(c / "optimizer.bin", weights_only=True)["state"] for c in (final, want))
    assert got.keys() == expected.keys()
    for k in expected:
        assert all(torch.equal(got[k][n], v) for n, v in expected[k].items() if isinstance(v, torch.Tensor))
    history = [json.loads((d / "history.json").read_text()) for d in (out, ref["run"])]
    assert [(h["train"]["images"], h["val"]["accuracy"]) for h in history[0]] == [
        (h["train"]["images"], h["val"]["accuracy"]) for h in history[1]
    ]

    split = json.loads((out / "split.json").read_text())
    assert [[rename(n) for n in split[k]] for k in ("train", "val")] == [ref["split"][k] for k in ("train", "val")]
    killed, after = (_reads(tmp_path / f"{n}.reads") for n in ("killed", "resumed"))
    per_rank = batch * 2  # batches of 2 per rank
    for rank in ("0", "1"):
        for e in range(EPOCHS):
            before = killed.get((rank, str(e)), []) if e <= epoch else []  # after the checkpoint: not kept
            before = before if e < epoch else before[:per_rank]
            later = after.get((rank, str(e)), [])
            assert [rename(n) for n in before + later] == ref["reads"][rank, str(e)], (rank, e)
    # Validation (and anything else read without an epoch, such as the top-losses figure): the 5 validation
    # images, counted once each.
    assert {rename(n) for rank in ("0", "1") for n in after.get((rank, "other"), [])} == set(ref["split"]["val"])
    assert json.loads((out / "summary.json").read_text())["val_images_counted"] == 5
    return resumed.stdout, split


@pytest.mark.distributed
def test_ddp_on_shards_killed_mid_epoch_resumes_to_the_folder_runs_tensors_every_sample_once(tmp_path, ddp_reference):
    """ddp x2 with --augment on the folder's shards (several of them), killed and resumed: the folder run's
    tensors, reads and split record, to its hash (``_killed_and_resumed``)."""
    data = tmp_path / "shards"
    assert main(["shard", str(ddp_reference["data"]), "--out", str(data), "--shard-size", "50KB"]) == 0
    assert len(list(data.glob("*.tar"))) > 2
    said, split = _killed_and_resumed(ddp_reference, str(data), tmp_path)
    assert "the split recorded in index.json" in said
    assert split["sha256"] == ddp_reference["split"]["sha256"]


@pytest.mark.distributed
def test_ddp_on_hf_data_with_its_own_odd_validation_split_killed_mid_epoch_resumes_to_the_folder_run(
    tmp_path, ddp_reference
):
    """ddp x2 with --augment on an hf: copy of the folder whose own train/validation splits are the folder
    run's seeded split (5 validation rows: odd), killed and resumed: the folder run's tensors and reads,
    row for image (``_killed_and_resumed``)."""
    rows = {"train": ddp_reference["split"]["train"], "validation": ddp_reference["split"]["val"]}
    data = _hf_copy(ddp_reference["data"], tmp_path / "hf", splits=rows)
    names = {f"{part}/{row}": name for part, listed in rows.items() for row, name in enumerate(listed)}
    said, split = _killed_and_resumed(ddp_reference, data, tmp_path, names.__getitem__)
    assert "its own train/validation splits" in said
    assert split["counts"] == {"train": 16, "val": 5}


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def az():
    with azureserver.azurite_server() as server:
        yield server


@pytest.fixture(scope="module")
def gs():
    with gcsserver.gcs_server() as server:
        yield server


def _from_store(ref: dict, server, folder: Path, url: str, tmp_path: Path) -> dict:
    """``folder`` uploaded to ``url`` on the local S3 server, Azurite or the GCS emulator, and the reference with
    an environment that reaches it (its endpoint and credentials, as the store's own chain reads them) and a
    shard cache of this test's."""
    {"s3": s3server, "az": azureserver, "gs": gcsserver}[url.split("://")[0]].upload(server, folder, url)
    getattr(server, "sync", lambda: None)()
    server.requests.clear()
    env = {**ref["env"], **server.env(), "VISIONTUNE_SHARD_CACHE": str(tmp_path / "shard-cache")}
    return {**ref, "env": env}


def _fetched_once_and_no_credentials_recorded(server, folder: Path, url: str, run: Path) -> None:
    """Each object GET once for both jobs and all their processes (the shard cache), and nothing of the
    credentials anywhere in the run folder."""
    getattr(server, "sync", lambda: None)()
    prefix = "/" + url.split("://", 1)[1].rstrip("/")
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    assert {n: server.gets(f"{prefix}/{n}") for n in files} == dict.fromkeys(files, 1)
    secrets = [*CREDENTIALS.values(), azureserver.KEY]
    for p in run.rglob("*"):
        if p.is_file():
            assert not any(v.encode() in p.read_bytes() for v in secrets), p


# One killed-and-resumed ddp job per store, the two layouts between them: what is the store's own is its
# client's listing and copy into the shard cache, which tests/data/test_stores*.py hold to "each object once,
# then no request" for every store and layout; once copied, a job reads local files as any other.
STORE_JOBS = [
    ("s3", "shards", "s3://train/shards/"),
    ("az", "folder", "az://train/folder"),
    ("gs", "shards", "gs://train/shards/"),
]


@pytest.mark.distributed
@pytest.mark.parametrize("store, layout, url", STORE_JOBS, ids=[f"{s}-{layout}" for s, layout, _ in STORE_JOBS])
def test_ddp_on_data_in_a_store_killed_mid_epoch_resumes_to_the_local_folder_runs_tensors_each_object_fetched_once(
    tmp_path, ddp_reference, request, store, layout, url
):
    """ddp x2 on the folder's shards, or the folder itself uploaded file by file, in a bucket of a real
    S3-protocol server, Azure's emulator (Azurite, read through adlfs) or a Google Cloud Storage emulator (read
    through gcsfs), killed with kill -9 and resumed: the local folder run's tensors, accuracy, reads and split
    record (``_killed_and_resumed``), each object fetched once by both jobs and all their processes."""
    server = request.getfixturevalue(store)
    folder = ddp_reference["data"]
    if layout == "shards":
        folder = tmp_path / "shards"
        assert main(["shard", str(ddp_reference["data"]), "--out", str(folder), "--shard-size", "50KB"]) == 0
    said, split = _killed_and_resumed(_from_store(ddp_reference, server, folder, url, tmp_path), url, tmp_path)
    assert split["sha256"] == ddp_reference["split"]["sha256"]
    if layout == "shards":
        assert "the split recorded in index.json" in said
    _fetched_once_and_no_credentials_recorded(server, folder, url, tmp_path / "run")
