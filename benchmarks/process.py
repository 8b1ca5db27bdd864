"""Process cost: the CPU time one ``visiontune`` process takes, with and without its quick exit.

Every worker of a DDP job, every launcher and every short command (``check``, ``models``, a one-epoch
``train``) is a fresh Python process that imports torch and torchvision; at exit the interpreter's
garbage collections walk every object those imports made. ``visiontune`` (``cli.entry``) freezes them
first. Both candidates run the same tiny ``train`` (squeezenet1_1, 32 px, one epoch of 16 images, one
thread) as a child process; the figure is the child's CPU seconds (user + system), interleaved
repeats, and the import alone (``import torch, torchvision, accelerate``) is measured beside them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from common import REPEATS, interleave, python_env, sample_data, write_result

PLAIN = "import sys; from visiontune.cli import main; sys.exit(main())"  # the same command, the usual exit


def child_cpu(argv: list[str]) -> float:
    """CPU seconds of one child process running ``argv`` (fails loudly if it fails)."""
    proc = subprocess.Popen(argv, env=python_env(threads=1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.read()}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    data = sample_data(10)  # 20 images: 16 train, 4 val
    train = "train --model squeezenet1_1 --weights none --image-size 32 --no-progress --epochs 1 --batch-size 4"

    def run(head: list[str]) -> float:
        with tempfile.TemporaryDirectory() as out:
            return 1.0 / child_cpu([*head, *train.split(), "--data", str(data), "--output-dir", out])

    candidates = {
        "visiontune": lambda: run([sys.executable, "-m", "visiontune"]),
        "plain_exit": lambda: run([sys.executable, "-c", PLAIN]),
        "import_only": lambda: 1.0 / child_cpu([sys.executable, "-c", "import torch, torchvision, accelerate"]),
    }
    rates = interleave(candidates, repeats=REPEATS)
    cpu = {k: round(1.0 / v["median"], 3) for k, v in rates.items()}
    result = {
        "cpu_seconds_per_process": cpu,
        "samples_per_cpu_second": rates,
        "ratio_visiontune_vs_plain_exit": round(cpu["visiontune"] / cpu["plain_exit"], 3),
    }
    print(result)
    write_result("process", result)


if __name__ == "__main__":
    main()
