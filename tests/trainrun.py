"""Helpers for tests that start, kill and resume real training runs in subprocesses.

Runs use squeezenet1_1 at 32 px (1.2M parameters: checkpoints of a few MB, and a
Dropout layer, so a resume that failed to restore the RNG state would diverge)
with deterministic settings: no augmentation, no loader workers. A run's final
weights are those of its last epoch-end checkpoint, compared with ``torch.equal``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

import zygote

PYTHON = sys.executable


def flags(**options) -> list[str]:
    """Command-line flags from keywords: ``batch_size=4`` is ``--batch-size 4``, ``True`` a bare flag."""
    out: list[str] = []
    for name, value in options.items():
        out += [f"--{name.replace('_', '-')}", *([] if value is True else [str(value)])]
    return out


SQUEEZENET = flags(model="squeezenet1_1", weights="none", image_size=32, no_progress=True)
TINY = [*SQUEEZENET, *flags(num_workers=0, batch_size=4, epochs=2, timeout=60)]


# ``python FILE ARGS`` (a benchmark script) spelt as ``python -c``, which ``run`` forks: the file runs as __main__
# with its folder first on sys.path, as the interpreter runs a file.
_AS_SCRIPT = (
    "import runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, sys.argv[0].rpartition('/')[0]); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def script_argv(path: str | Path, *args: str) -> list[str]:
    return [PYTHON, "-c", _AS_SCRIPT, str(path), *args]


def train_argv(data: Path, out: Path, *extra: str) -> list[str]:
    return [PYTHON, "-m", "visiontune", "train", "--data", str(data), "--output-dir", str(out), *TINY, *extra]


def start(argv: list[str], env: dict, log: Path) -> subprocess.Popen | zygote.Forked:
    """Start a run in its own session (so the whole job can be killed as a group); output to ``log``.

    ``python -m visiontune`` is a fork of a process holding visiontune's imports where it can be (tests/zygote.py).
    """
    if zygote.forkable(argv, env):
        Path(log).write_text("")
        return zygote.Forked(argv, env, str(log), str(log))
    f = open(log, "w")
    return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def run(argv: list[str], env: dict, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` of ``argv``, capturing its output; forked where ``start`` would fork it."""
    if not zygote.forkable(argv, env):
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        out.write_text("")
        err.write_text("")
        proc = zygote.Forked(argv, env, str(out), str(err), cwd=None if cwd is None else str(cwd))
        try:
            code = proc.wait(timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(argv, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def wait_for(path: Path, proc: subprocess.Popen, limit: float = 300) -> None:
    """Poll until ``path`` exists; fail if the run ended first (a harness limit, not an assertion on time)."""
    end = time.monotonic() + limit
    while not path.exists():
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before {path} appeared"
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.02)


def checkpoints(run_dir: Path) -> list[Path]:
    """Final-named checkpoint folders, oldest first."""
    from visiontune.runs import checkpoint

    return [Path(p) for p in reversed(checkpoint.listed(str(run_dir)))]


def final_weights(run_dir: Path, epochs: int = 2) -> dict[str, torch.Tensor]:
    from visiontune.runs import checkpoint

    return load_file(str(run_dir / "checkpoints" / checkpoint.name(epochs, 0) / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def env_for(worker_env: dict, tmp: Path) -> dict:
    """``worker_env`` with a cache folder of its own: no scan cache yet, the model names listed as on any
    machine that ran visiontune before (so the launching process of a DDP job reads them, not torchvision)."""
    from visiontune.models.names import all_names

    env = dict(worker_env)
    env["VISIONTUNE_CACHE_DIR"] = str(tmp / "scan-cache")
    all_names("torchvision", env["VISIONTUNE_CACHE_DIR"])
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return env


def pids_alive(pids: list[int]) -> list[int]:
    """The ones still running (zombies waiting to be reaped do not count)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def train_ddp_beside_one(common: list[str], ddp: list[str], one: list[str], out: Path, env: dict) -> None:
    """``train common + ddp`` as a job of its own into ``out/ddp`` and, meanwhile, ``train common + one``
    in this process into ``out/one``; both must succeed."""
    from visiontune.cli.commands import main

    log = out / "ddp.log"
    job = start([PYTHON, "-m", "visiontune", "train", *common, *ddp, "--output-dir", str(out / "ddp")], env, log)
    try:
        assert main(["train", *common, *one, "--output-dir", str(out / "one")]) == 0
        job.wait(900)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # the agent and its workers
    assert job.returncode == 0, log.read_text()[-3000:]


def sharded_tensors(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint (torch.distributed.checkpoint's folder), gathered, by a flat name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp / "full.pt")
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)

    walk("", torch.load(tmp / "full.pt", weights_only=True))
    (tmp / "full.pt").unlink()
    return flat


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ||a - b|| / ||b|| over the floating-point tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(
        ((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)).item()
        for k in a
        if a[k].is_floating_point()
    )


def worker_of(launcher: psutil.Process, rank: int) -> psutil.Process:
    """The training process of ``rank`` under ``launcher``: the agent's child that names itself so (a forked
    worker's environment and command line in /proc are its agent's)."""
    for p in launcher.children(recursive=True):
        try:
            if p.name() == f"visiontune r{rank}"[:15]:
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no worker with rank {rank}")


def one_line(capsys, *fragments: str) -> str:
    """The one line a user error printed on stderr, holding every fragment."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for f in fragments:
        assert f in err[0], err[0]
    return err[0]


def tiny_train(data, out, *extra) -> list[str]:
    """``visiontune train`` arguments for resnet18 from scratch at 32 px (conftest's FAST)."""
    from conftest import FAST

    return ["train", "--data", str(data), "--output-dir", str(out), *FAST, *extra]
