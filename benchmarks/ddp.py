"""CPU DDP: 2 processes x 1 thread against 1 process x 2 threads, same global batch.

Both read the same warm ``--cache`` with no loader workers, so the figure is
compute and communication only. ``resnet18`` at 32 px, global batch 32 (16 per
process under DDP), 2 epochs; the figure is the second epoch's train images/s
as visiontune records it (counted over all processes). To say what limits
DDP, the gloo all-reduce of resnet18's gradients is timed on its own in the
same 2-process setup and set against the step time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from common import ROOT, WORK, interleave, python_env, run, sample_data, write_result

MODEL, SIZE, GLOBAL_BATCH, PER_CLASS = "resnet18", 32, 32, 100


def train_rate(data, name, rec, extra) -> float:
    with tempfile.TemporaryDirectory() as out:
        run(
            [
                sys.executable,
                "-m",
                "visiontune",
                "train",
                "--data",
                str(data),
                "--output-dir",
                out,
                "--model",
                MODEL,
                "--weights",
                "none",
                "--image-size",
                str(SIZE),
                "--epochs",
                "2",
                "--lr",
                "0.01",
                "--no-progress",
                "--num-workers",
                "0",
                "--cache",
                str(WORK / "cache"),
                *extra,
            ],
            env=python_env(),
        )
        with open(os.path.join(out, "history.json")) as f:
            rate = json.load(f)[1]["train"]["images_per_s"]
    rec[name].append(rate)
    return rate


def main() -> None:
    data = sample_data(PER_CLASS)
    rec = {"ddp_2x1": [], "single_1x2": []}
    res = interleave(
        {
            "ddp_2x1": lambda: train_rate(
                data, "ddp_2x1", rec, ["--strategy", "ddp", "--nproc", "2", "--batch-size", str(GLOBAL_BATCH // 2)]
            ),
            "single_1x2": lambda: train_rate(data, "single_1x2", rec, ["--batch-size", str(GLOBAL_BATCH)]),
        }
    )
    out = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "benchmarks" / "allreduce.py"),
            MODEL,
        ],
        env=python_env(threads=1),
    )
    allreduce = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    ddp_rate = res["ddp_2x1"]["median"]
    step = GLOBAL_BATCH / ddp_rate
    ratio = ddp_rate / res["single_1x2"]["median"]
    result = {
        "what": f"train images/s, 2nd epoch, {MODEL} {SIZE} px, global batch {GLOBAL_BATCH}, cached data",
        "images_per_s": res,
        "ratio_ddp_2x1_vs_single_1x2": ratio,
        "ddp_step_seconds": step,
        "allreduce": allreduce,
        "allreduce_share_of_ddp_step": allreduce["seconds"] / step,
    }
    print(
        f"ddp: 2x1 {ddp_rate:.1f} img/s vs 1x2 {res['single_1x2']['median']:.1f} img/s, ratio {ratio:.2f}; "
        f"all-reduce {allreduce['seconds'] * 1e3:.0f} ms of a {step * 1e3:.0f} ms step"
    )
    write_result("ddp", result)


if __name__ == "__main__":
    sys.exit(main())
