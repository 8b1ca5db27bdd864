"""``visiontune slurm``: no value given to it becomes a line of its own in the batch script.

Values that go into ``#SBATCH`` lines (which sbatch reads without quoting) are held to Slurm's syntax for them;
values on the ``srun`` line are shell-quoted, so a path with ``$(...)``, backticks, quotes or ``;`` reaches
``visiontune train`` intact. The written script is run by bash with stand-ins for srun, scontrol and sbatch that
record their arguments, and a marker file shows whether anything injected ran.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from visiontune import cli

REQUIRED = ["--nodes", "2", "--gpus-per-node", "4", "--time", "4:00:00"]


def _hostile(marker: Path) -> list[str]:
    """Each way a value could leave its place: a new line, command substitution, quotes, a second command."""
    return [
        f"gpu\ntouch {marker}",
        f"x\n#SBATCH --wrap=touch {marker}",
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"gpu'; touch {marker}; '",
        f'gpu"; touch {marker}; "',
        f"gpu;touch {marker}",
        f"gpu touch {marker}",
        "gpu\rx",
        "",
    ]


def _slurm(capsys, out: Path, *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    data = [] if "--data" in argv else ["--data", "/data/cats"]
    code = cli.main(["slurm", *data, *REQUIRED, "--out", str(out), *argv])
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("flag", ["--partition", "--job-name", "--time"])
def test_a_value_outside_slurms_syntax_is_refused_and_nothing_is_written(tmp_path, capsys, flag):
    marker = tmp_path / "pwned"
    values = [*_hostile(marker), f"\n4:00:00\ntouch {marker}", "4:00:00\n", "٤:00:00"]  # the last: Arabic-Indic 4
    for value in values if flag == "--time" else _hostile(marker):
        out = tmp_path / "job.sbatch"
        code, err = _slurm(capsys, out, flag, value)
        assert code == 2, (flag, value, err)
        assert len(err) == 1 and err[0].startswith(f"visiontune: error: {flag} "), (value, err)
        assert not out.exists() and not marker.exists()


@pytest.mark.parametrize("flag", ["--data", "--output-dir", "--model"])
def test_a_control_character_in_any_value_of_the_srun_line_is_refused(tmp_path, capsys, flag):
    for value in ["/runs/a\ntouch x", "/runs/a\tb", "/runs/a\x1b[2Jb", "/runs/a\u2028b"]:
        out = tmp_path / "job.sbatch"
        code, err = _slurm(capsys, out, flag, value)
        assert code == 2, (flag, value, err)
        assert len(err) == 1 and flag in err[0] and "control character" in err[0], err
        assert not out.exists()


def test_a_cpu_count_below_one_is_refused(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    for value in ("0", "-4"):  # 0 once meant "the default" without a word
        code, err = _slurm(capsys, out, "--cpus-per-task", value)
        assert code == 2 and len(err) == 1 and "--cpus-per-task must be >= 1" in err[0]
        assert not out.exists()


def _stand_ins(bin_: Path, log: Path, marker: Path) -> dict[str, str]:
    """srun, scontrol and sbatch that write their arguments (NUL-separated) to ``log.NAME``; srun exits 138."""
    bin_.mkdir()
    for name, code in (("srun", 138), ("scontrol", 0), ("sbatch", 0)):
        tool = bin_ / name
        tool.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {log}.{name}\nexit {code}\n")
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "MARKER": str(marker)}


@pytest.mark.slow
def test_paths_with_shell_characters_reach_the_train_command_intact_and_run_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"
    # Legal, if unwise, folder names: every shell character that could end a quote or start a command.
    data = f"/data/cats $(touch {marker}) `touch {marker}`; touch {marker} 'q' \"dq\" $MARKER * ~ \\ &|<>"
    run_dir = f'runs/it\'s "{marker.name}" $(touch {marker});`touch {marker}`&& touch {marker} #'
    out = tmp_path / "job.sbatch"
    code, err = _slurm(
        capsys, out, "--data", data, "--output-dir", run_dir, "--partition", "gpu,gpu-long", "--job-name", "cats.v2"
    )
    assert code == 0, err
    assert subprocess.run(["bash", "-n", str(out)], check=False).returncode == 0
    log = tmp_path / "argv"
    done = subprocess.run(["bash", str(out)], env=_stand_ins(tmp_path / "bin", log, marker), cwd=tmp_path, check=False)
    assert done.returncode == 138  # srun's code, passed on after the requeue
    assert not marker.exists()
    srun = Path(f"{log}.srun").read_bytes().decode().split("\0")[:-1]
    assert srun[srun.index("--data") + 1] == data
    assert srun[srun.index("--output-dir") + 1] == run_dir
    assert srun[:5] == ["--kill-on-bad-exit=1", sys.executable, "-m", "visiontune", "train"]
    assert srun[-2:] == ["--resume", "auto"]
    assert Path(f"{log}.scontrol").read_bytes() == b"requeue\x004242\x00"
    assert not Path(f"{log}.sbatch").exists()
    text = out.read_text()
    assert "#SBATCH --partition=gpu,gpu-long\n" in text and "#SBATCH --job-name=cats.v2\n" in text


@pytest.mark.slow  # bash reads the script
def test_the_script_runs_the_environment_it_was_written_from_and_says_what_must_be_on_path(tmp_path, capsys):
    """Not a bare `visiontune` found on the job's PATH (another install, or none): this interpreter, by absolute
    path, with its environment's bin/ first on PATH; the comment says what else the nodes need."""
    from visiontune.cluster import sbatch

    out = tmp_path / "job.sbatch"
    code, err = _slurm(capsys, out)
    assert code == 0, err
    lines = out.read_text().splitlines()
    srun = next(line for line in lines if line.startswith("srun "))
    assert shlex.split(srun)[2:6] == [sys.executable, "-m", "visiontune", "train"]
    assert f'export PATH={shlex.quote(os.path.join(sys.prefix, "bin"))}:"$PATH"' in lines
    assert lines.index(next(line for line in lines if line.startswith("export PATH="))) < lines.index(srun)
    comment = " ".join(line[2:] for line in lines if line.startswith("# "))
    assert "Every node must see that path" in comment and "srun and scontrol must be on PATH" in comment
    # An environment at a path with spaces and quotes: each stays one word, and bash reads the script.
    odd = str(tmp_path / "my envs" / "it's")
    script = sbatch.batch_script(
        ["--data", "/d"],
        nodes=1,
        gpus_per_node=0,
        time="60",
        partition=None,
        cpus_per_task=None,
        job_name="j",
        output_dir=None,
        python=f"{odd}/bin/python",
        prefix=odd,
    )
    (tmp_path / "odd.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "odd.sbatch")], check=False).returncode == 0
    words = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    assert words[2] == f"{odd}/bin/python"
    path_line = next(line for line in script.splitlines() if line.startswith("export PATH="))
    assert shlex.split(path_line[len("export ") :]) == [f"PATH={odd}/bin:$PATH"]


@pytest.mark.parametrize(
    "given,expected", [([], "ddp"), (["--strategy", "single"], "ddp"), (["--strategy", "fsdp"], "fsdp")]
)
def test_the_job_runs_a_strategy_of_several_processes_the_one_asked_for_when_it_is_one(
    tmp_path, capsys, given, expected
):
    out = tmp_path / "job.sbatch"
    code, err = _slurm(capsys, out, *given)
    assert code == 0, err
    srun = shlex.split(next(line for line in out.read_text().splitlines() if line.startswith("srun ")))
    assert srun[srun.index("--strategy") + 1] == expected and srun.count("--strategy") == 1
