"""``python -m visiontune ...`` for the tests, as a fork of a process that has imported visiontune already.

So is ``python -c CODE`` (a test's script that patches visiontune and calls it), and ``python -m`` of the two
launchers a test starts a job with (``torch.distributed.run``, ``accelerate launch``).

Every interpreter a test starts imports torch, torchvision and Accelerate first: about 4 CPU s, more than most
of the tiny runs it then does. ``start`` hands such a command line to a multiprocessing forkserver (one per
test process, started on first use, holding those imports) instead; the fork runs the CLI's own ``command`` with
the command line's arguments, environment and output files, in a session of its own, and its exit code is the
process's. It is a real process: it can be killed with ``kill -9`` (alone or as a group), it is the launching
process of a DDP job, whose workers are forks of it in turn.

A test's ``sitecustomize`` hook (a folder put first on ``PYTHONPATH`` holding one, which patches a visiontune
function to log or to fail) runs in the fork as it would at an interpreter's start: before the command, with
the command's environment. The hooks patch module and class attributes that the code looks up when it calls
them, so that they take effect although the modules were imported before. A command line that needs a new
interpreter still gets one (``subprocess``): one whose environment puts other code on ``PYTHONPATH``, or sets a
variable that a preloaded module read at its import (the Hugging Face ones), or that runs another module.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

from visiontune.cluster import launch

# What a run imports before its first step; reading them again is what every interpreter spends its seconds on.
# And pyplot, which each run's figures import after its last epoch (a quarter of a second of a tiny run's CPU);
# its backend is not chosen at import, so a run still sets the file-only one itself. And peft (with the
# transformers it imports: over a CPU second), which every process of a --lora run imports, DDP and FSDP workers
# included; a forkserver that cannot import it (the lora extra not installed) goes on without it.
PRELOAD = ["visiontune.cli.commands", "visiontune.training.trainer", "torch.distributed.run", "matplotlib.pyplot"]
PRELOAD += ["peft"]
# The modules a fork may run as ``python -m``: visiontune, and the launchers that start its workers (their
# workers are new interpreters all the same; only the launcher's own imports are saved).
MODULES = ("visiontune", "torch.distributed.run", "accelerate.commands.accelerate_cli")
_READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TIMM_")
_CONTEXT: multiprocessing.context.BaseContext | None = None
SOURCE = str(Path(__file__).resolve().parents[1] / "src")
LAUNCH_LOG = str(Path(__file__).resolve().parent / "launchlog")  # tests/tiers.py's hook: counts, runs nothing


def forkable(argv: list[str], env: dict[str, str]) -> bool:
    if argv[:1] != [sys.executable] or not (argv[1:2] == ["-c"] or argv[1:3] in (["-m", m] for m in MODULES)):
        return False
    # Other code of its own on PYTHONPATH (modules the preloaded imports would not see) needs a new interpreter.
    known = {os.path.abspath(p) for p in sys.path} | {SOURCE, LAUNCH_LOG}
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) not in known]
    if any(_hook(p) is None for p in extra):
        return False
    changed = {k for k in env.keys() | os.environ.keys() if env.get(k) != os.environ.get(k)}
    return not any(k.startswith(_READ_AT_IMPORT) for k in changed)


def _hook(folder: str) -> str | None:
    """The ``sitecustomize.py`` that is all of ``folder``'s Python (None: other modules, or none)."""
    found = {f.name for f in Path(folder).glob("*.py")} if os.path.isdir(folder) else set()
    return os.path.join(folder, "sitecustomize.py") if found == {"sitecustomize.py"} else None


def _run_hook(env: dict[str, str]) -> None:
    """What an interpreter's start runs: the first ``sitecustomize`` on ``PYTHONPATH``, if it is a test's hook."""
    for folder in env.get("PYTHONPATH", "").split(os.pathsep):
        if folder and os.path.exists(os.path.join(folder, "sitecustomize.py")):
            if os.path.abspath(folder) != LAUNCH_LOG:  # the launch log's is the preloaded process's own
                import runpy

                runpy.run_path(os.path.join(folder, "sitecustomize.py"), run_name="sitecustomize")
            return


def _context() -> multiprocessing.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _child(argv: list[str], env: dict[str, str], out: str, err: str, cwd: str | None, cores: set[int] | None) -> None:
    os.setsid()  # as start_new_session=True: the test can kill the job as a group
    if cores:
        os.sched_setaffinity(0, cores)
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, errors="surrogateescape", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    _run_hook(env)
    if argv[1] == "-c":  # python -c CODE ARGS: sys.argv is ["-c", *ARGS]
        sys.argv = ["-c", *argv[3:]]
        exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})
        sys.exit(0)
    if argv[2] != "visiontune":  # a launcher, as python -m runs it (sys.argv[0] becomes its file)
        import runpy

        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        sys.exit(0)
    sys.argv = ["visiontune", *argv[3:]]
    from visiontune.cli.commands import command

    command()  # ends the process as `python -m visiontune` does
    sys.exit(0)  # a torchrun worker forked from its agent returns from it, successfully


class Forked(launch.ForkedProcess):
    """The ``subprocess.Popen`` methods the tests use, for a command line forked from the preloaded process."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        out: str,
        err: str,
        cwd: str | None = None,
        cores: set[int] | None = None,
    ):
        self.args = argv
        super().__init__(_context().Process(target=_child, args=(argv, env, out, err, cwd, cores)))

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)
