"""A sharded checkpoint (torch.distributed.checkpoint's folder) read back without unpickling anything: a
pickled command in ``.metadata`` or in a plain item is refused in one line and never runs; a checkpoint
DCP wrote loads back as it was. Saved and loaded in this process (DCP without a process group)."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from visiontune.cluster import dcpfiles
from visiontune.errors import UserError


class Command:
    """What a hostile pickle holds: unpickling it runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _state() -> dict:
    return {
        "model": {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3, dtype=torch.float16)},
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None, "params": ["w"]}], "n": 3},
    }


def _empty() -> dict:
    return {
        "model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float16)},
        "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "foreach": None, "params": []}], "n": 0},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save(_state(), checkpoint_id=folder)
    return folder


def _copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def test_a_checkpoint_dcp_wrote_loads_back_as_it_was(saved):
    state = _empty()
    dcpfiles.load(state, str(saved))
    want = _state()
    assert torch.equal(state["model"]["w"], want["model"]["w"]) and torch.equal(state["model"]["b"], want["model"]["b"])
    assert state["optim"] == want["optim"]


def test_a_pickled_command_in_metadata_is_refused_in_one_line_and_never_runs(saved, tmp_path):
    folder, marker = _copy(saved, tmp_path), tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(Command(marker)))
    with pytest.raises(UserError) as e:
        dcpfiles.load(_empty(), str(folder))
    assert not marker.exists()
    line = str(e.value)
    assert len(line.splitlines()) == 1 and f"cannot load checkpoint {folder}: its .metadata names" in line
    assert "system" in line


def test_a_pickled_command_in_a_plain_item_is_refused_and_never_runs(tmp_path):
    """DCP's own planner loads plain items with weights_only=False: the command would run there."""
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    dcp.save({"model": {"w": torch.ones(2)}, "extra": Command(marker)}, checkpoint_id=folder)
    with pytest.raises(ValueError, match="weights_only|Unsupported global|other than"):
        dcpfiles.load({"model": {"w": torch.zeros(2)}, "extra": None}, str(folder))
    assert not marker.exists()


def test_a_plain_item_where_the_run_has_a_tensor_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    dcp.save({"model": {"w": 3.0}}, checkpoint_id=folder)
    with pytest.raises(ValueError, match="model.w is stored as a plain value where the run has a tensor"):
        dcpfiles.load({"model": {"w": torch.zeros(2)}}, str(folder))


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda info: setattr(info, "relative_path", "../ckpt/__0_0.distcp"), "names a data file outside its folder"),
        (lambda info: setattr(info, "relative_path", "/etc/passwd"), "names a data file outside its folder"),
        (lambda info: setattr(info, "length", 1 << 40), "a bad range"),
        (lambda info: setattr(info, "transform_descriptors", ["zstd"]), "asks for stream transforms"),
    ],
)
def test_an_index_pointing_outside_its_files_is_refused(saved, tmp_path, change, said):
    folder = _copy(saved, tmp_path)
    metadata = dcpfiles.read_metadata(str(folder))
    change(next(iter(metadata.storage_data.values())))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match=said):
        dcpfiles.load(_empty(), str(folder))


def test_a_shared_list_cannot_be_copied_into_millions_of_sizes(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    metadata = dcpfiles.read_metadata(str(folder))
    item = metadata.state_dict_metadata["model.w"]
    item.size = torch.Size([1] * 100)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match="not a checkpoint index|short list"):
        dcpfiles.read_metadata(str(folder))


@pytest.mark.parametrize("field", ["state_dict_metadata", "storage_data", "properties"])
def test_an_index_built_without_one_of_its_fields_is_refused_in_one_line(saved, tmp_path, field):
    # A pickle builds DCP's classes from any state it holds: a field may simply be missing (found by the fuzzer).
    folder = _copy(saved, tmp_path)
    metadata = dcpfiles.read_metadata(str(folder))
    holder = metadata.state_dict_metadata["model.w"] if field == "properties" else metadata
    del holder.__dict__[field]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match="cannot load checkpoint"):
        dcpfiles.read_metadata(str(folder))


MD = b"torch.distributed.checkpoint.metadata"


def _global(module: bytes, name: bytes) -> bytes:
    return b"\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"


@pytest.mark.parametrize(
    ("data", "said"),
    [
        # PUT at index 2**31 - 1: the C unpickler sizes its memo array by it (16 GB).
        (b"\x80\x04Nr\xff\xff\xff\x7f.", "is not a checkpoint index"),
        # A class of the index called with arguments (MetadataIndex copies its offset: a shared list, copied
        # once per call, grows the square of the file).
        (b"\x80\x04" + _global(MD, b"MetadataIndex") + b"\x8c\x01a]\x86R.", "calls MetadataIndex, which it may not"),
        # One dict of fields set on an object that is no part of the index.
        (b"\x80\x04" + _global(b"torch", b"float32") + b"}b.", "sets fields it may not"),
        # A path of a name longer than any (a long name, referenced many times, would be joined many times).
        (b"\x80\x04" + _global(b"pathlib", b"PosixPath") + b"X\x00\x20\x00\x00" + b"a" * 8192 + b"\x85R.", "is not"),
    ],
    ids=["memo-index", "constructor-call", "build-elsewhere", "path-parts"],
)
def test_an_index_that_would_take_memory_out_of_proportion_to_its_size_is_refused(saved, tmp_path, data, said):
    folder = _copy(saved, tmp_path)
    (folder / ".metadata").write_bytes(data)
    with pytest.raises(UserError, match=f"cannot load checkpoint .*: its .metadata {said}"):
        dcpfiles.read_metadata(str(folder))


@pytest.mark.slow
def test_fsdp_resume_from_a_tampered_checkpoint_is_one_line_exit_2_and_runs_nothing(tmp_path, worker_env):
    """``train --strategy fsdp --resume auto`` on a run folder whose .metadata (and its recorded sha256) was
    replaced by a pickled command: exit 2, one line, the command never ran; the untouched folder resumes."""
    import hashlib
    import json

    from trainrun import PYTHON, env_for, flags, run
    from visiontune.data.sample import make_sample_data
    from visiontune.runs import checkpoint

    make_sample_data(tmp_path / "data", per_class=4, test_count=0, seed=3)
    env, out, marker = env_for(worker_env, tmp_path), tmp_path / "run", tmp_path / "ran"
    argv = [PYTHON, "-m", "visiontune", "train", *flags(data=tmp_path / "data", output_dir=out, strategy="fsdp")]
    argv += flags(nproc=1, model="squeezenet1_1", weights="none", image_size=32, no_progress=True, num_workers=0)
    argv += flags(batch_size=4, epochs=2, timeout=60)
    first = run(argv, env)  # forked from a process holding the imports where it can be (tests/zygote.py)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    shutil.rmtree(out / "checkpoints" / checkpoint.name(2, 0))  # the run is left after its first epoch
    good = out.with_name("good")
    shutil.copytree(out, good)
    ckpt = out / "checkpoints" / checkpoint.name(1, 0)
    data = pickle.dumps(Command(marker))
    (ckpt / ".metadata").write_bytes(data)
    meta = json.loads((ckpt / "visiontune.json").read_text())
    meta["files"][".metadata"] = [len(data), hashlib.sha256(data).hexdigest()]
    (ckpt / "visiontune.json").write_text(json.dumps(meta))

    tampered = run([*argv, "--resume", "auto"], env)
    assert not marker.exists()
    assert tampered.returncode == 2, tampered.stdout[-2000:] + tampered.stderr[-2000:]
    assert tampered.stderr.strip().splitlines() == [
        f"visiontune: error: cannot load checkpoint {ckpt}: its .metadata names posix.system, which is not part of "
        "a checkpoint's index; the folder was altered or damaged (resume from another checkpoint, or start over)"
    ]
    argv[argv.index(str(out))] = str(good)
    resumed = run([*argv, "--resume", "auto"], env)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and (good / "checkpoints" / checkpoint.name(2, 0)).is_dir()


MUTATIONS = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255), st.sampled_from("sid")), max_size=6)


@fuzz_settings(150)
@given(MUTATIONS, st.binary(max_size=300), st.booleans())
def test_fuzz_any_metadata_bytes_give_a_checked_index_or_one_line(saved, tmp_path_factory, edits, junk, raw):
    """Whatever ``.metadata`` holds (a real index with bytes set, inserted or deleted, or any bytes), reading
    it gives an index that passed the schema check or a one-line ``UserError``; nothing else escapes."""
    folder = tmp_path_factory.mktemp("fuzz")
    for f in saved.glob("*.distcp"):
        os.link(f, folder / f.name)
    data = bytearray(junk if raw else (saved / ".metadata").read_bytes())
    for at, byte, how in edits:
        at = at % (len(data) + 1)
        if how == "s" and at < len(data):
            data[at] = byte
        elif how == "i":
            data.insert(at, byte)
        elif how == "d" and at < len(data):
            del data[at]
    (folder / ".metadata").write_bytes(bytes(data))
    try:
        metadata = dcpfiles.read_metadata(str(folder))
    except UserError as e:
        assert len(str(e).splitlines()) == 1
    else:
        dcpfiles.check(metadata, str(folder))
    shutil.rmtree(folder)
