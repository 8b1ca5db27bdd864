"""Start-up at ImageNet size: seconds to the first training step and peak RSS, for 25k, 250k and 1.28M files.

Data: an ImageFolder of 1,000 class folders whose files are hard links to 64 tiny
(16x16) JPEGs -- real files for the listing, ``stat`` and decoding work, made in
seconds without gigabytes of disk. Each run is ``visiontune train`` (squeezenet1_1,
32 px, batch 32) with a ``sitecustomize`` on PYTHONPATH that notes the time when
``engine.fit`` starts in each process and ends the process there: the start-up is
everything before the first training step. Peak RSS is ``getrusage``'s
``RUSAGE_CHILDREN`` of a wrapper process around the job: the largest process of
the job (the command, the launcher or a worker). "cold" is a first run (no scan
cache: every file is decoded), "warm" the same run again. A last row counts the
decodes of a first ``--cache`` run over real JPEGs (``sample_data``): one per file.
``VT_STARTUP_SIZES`` (e.g. ``25000,250000``) picks the sizes, ``VT_STARTUP_MODES``
the runs (``single,ddp,before,cache``: the job alone, ddp x2, the baseline commit
``VT_STARTUP_BASELINE`` up to ``VT_STARTUP_BASELINE_MAX`` files, the ``--cache`` row),
``VT_STARTUP_STARTS`` ``cold,warm`` or just ``warm`` (the scan cache of an earlier run
in ``VT_BENCH_WORK`` is kept; an unrecorded run makes one when there is none), and
``VT_STARTUP_OUT`` the name of the result files (``startup``).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
from PIL import Image

from common import RESULTS, ROOT, WORK, python_env, sample_data, write_result

SIZES = [int(s) for s in os.environ.get("VT_STARTUP_SIZES", "25000,250000,1280000").split(",")]
CLASSES, SOURCES = 1000, 64
TRAIN = [
    "--model",
    "squeezenet1_1",
    "--weights",
    "none",
    "--image-size",
    "32",
    "--batch-size",
    "32",
    "--epochs",
    "1",
    "--no-progress",
    "--num-workers",
    "0",
]
HOOK = """
import os, time
if os.environ.get("VT_STARTUP_MARK"):
    import visiontune.training.engine as engine
    import visiontune.data.decode as decode
    real_read = decode.read_image

    def read_image(*args, **kwargs):
        with open(os.environ["VT_STARTUP_MARK"] + ".decodes", "a") as f:
            f.write("1")
        return real_read(*args, **kwargs)

    def fit(*args, **kwargs):
        with open(os.environ["VT_STARTUP_MARK"], "a") as f:
            f.write(f"{time.time()}\\n")
        os._exit(0)

    engine.fit = fit
    if os.environ.get("VT_STARTUP_COUNT_DECODES"):
        decode.read_image = read_image
        import visiontune.data.check as check
        check.read_image = read_image
"""
WRAP = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "r = resource.getrusage(resource.RUSAGE_CHILDREN); print('PEAK', r.ru_maxrss, r.ru_utime + r.ru_stime, code)"
)
# The run before this work, for a before/after ratio at the sizes it can do in reasonable time.
BASELINE = os.environ.get("VT_STARTUP_BASELINE", "57c6fe3")
BASELINE_MAX = int(os.environ.get("VT_STARTUP_BASELINE_MAX", "250000"))
MODES = os.environ.get("VT_STARTUP_MODES", "single,ddp,before,cache").split(",")
STARTS = os.environ.get("VT_STARTUP_STARTS", "cold,warm").split(",")
OUT = os.environ.get("VT_STARTUP_OUT", "startup")


def make_folder(n: int) -> str:
    """n files in 1,000 class folders, hard links to 64 tiny JPEGs; made once and reused."""
    out = WORK / f"startup-{n}"
    if (out / ".done").exists():
        return str(out / "data")
    shutil.rmtree(out, ignore_errors=True)
    src = out / "src"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for s in range(SOURCES):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, "JPEG")
        (src / f"{s}.jpg").write_bytes(buf.getvalue())
    for c in range(CLASSES):
        folder = out / "data" / f"n{c:08d}"
        folder.mkdir(parents=True)
        for i in range(c, n, CLASSES):
            os.link(src / f"{i % SOURCES}.jpg", folder / f"n{c:08d}_{i}.JPEG")
    (out / ".done").touch()
    return str(out / "data")


def baseline_src() -> str | None:
    """The baseline's ``src`` folder, exported once from git."""
    if not BASELINE:
        return None
    out = WORK / f"baseline-{BASELINE}"
    if not (out / "src").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASELINE, "src"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return str(out / "src")


def import_rss() -> int:
    """Peak RSS (MiB) of a process that only imports the trainer: the floor under every run's figure."""
    done = subprocess.run(
        [sys.executable, "-c", WRAP, sys.executable, "-c", "import visiontune.training.trainer"],
        env=python_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return round(int(done.stdout.split()[1]) / 1024)


def start_up(
    data: str, extra: list[str], cache_dir: str, hooks: str, count_decodes: bool = False, src: str | None = None
) -> dict:
    mark = WORK / "startup-mark"
    for p in (mark, WORK / "startup-mark.decodes"):
        p.unlink(missing_ok=True)
    env = python_env()
    env.update(
        PYTHONPATH=os.pathsep.join([hooks, src or env["PYTHONPATH"]]),
        VT_STARTUP_MARK=str(mark),
        VISIONTUNE_CACHE_DIR=cache_dir,
        OMP_NUM_THREADS="1",
    )
    if count_decodes:
        env["VT_STARTUP_COUNT_DECODES"] = "1"
    out = WORK / "startup-run"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WRAP,
            sys.executable,
            "-m",
            "visiontune",
            "train",
            "--data",
            data,
            *TRAIN,
            "--output-dir",
            str(out),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    peak, cpu, code = done.stdout.strip().splitlines()[-1].split()[1:]
    if code != "0" or not mark.exists():
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"start-up run failed ({code})")
    first_step = max(float(t) for t in mark.read_text().split())  # the step starts when every process is there
    decodes = len((WORK / "startup-mark.decodes").read_text()) if count_decodes else None
    return {
        "seconds": round(first_step - t0, 2),
        "cpu_seconds": round(float(cpu), 1),
        "peak_rss_mib": round(int(peak) / 1024),
        "decodes": decodes,
    }


def main() -> None:
    hooks = WORK / "startup-hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(HOOK)
    rows, floor, base = [], import_rss(), baseline_src()
    for n in SIZES:
        t = time.time()
        data = make_folder(n)
        print(f"startup: {n} files ready ({time.time() - t:.0f} s)", flush=True)
        runs = [("single", [], None)] if "single" in MODES else []
        if "ddp" in MODES:
            runs.append(("ddp x2", ["--strategy", "ddp", "--nproc", "2"], None))
        if base and n <= BASELINE_MAX and "before" in MODES:
            runs.append((f"single, before ({BASELINE})", [], base))
        for mode, extra, src in runs:
            cache = WORK / "startup-scan-cache"
            if "cold" in STARTS:
                shutil.rmtree(cache, ignore_errors=True)
            elif not (cache / f"primed-{n}").exists():
                start_up(data, extra, str(cache), str(hooks), src=src)  # unrecorded: makes the warm cache
                (cache / f"primed-{n}").touch()
            for temp in STARTS:
                r = {"files": n, "mode": mode, "start": temp, **start_up(data, extra, str(cache), str(hooks), src=src)}
                rows.append(r)
                print(f"startup: {r}", flush=True)
    result = {
        "what": "seconds from the command's start to the first training step, CPU seconds of the whole job, "
        "and peak RSS of its largest process, squeezenet1_1 32 px",
        "rows": rows,
        "import_only_rss_mib": floor,
        "load_average_at_start": list(os.getloadavg()),
    }
    if "cache" in MODES:
        result["first_cache_run"] = first_cache_run(hooks)
    write_result(OUT, result)
    (RESULTS / f"{OUT}.md").write_text(table(result) + "\n")
    print(table(result))


def first_cache_run(hooks: Path) -> dict:
    """A first ``--cache`` run over real JPEGs, its decodes counted."""
    real = sample_data(1000)  # 2,000 real JPEGs, 300-500 px
    cache = WORK / "startup-image-cache"
    shutil.rmtree(cache, ignore_errors=True)
    first_cache = start_up(
        str(real),
        ["--cache", str(cache), "--image-size", "64"],
        str(WORK / "startup-sc"),
        str(hooks),
        count_decodes=True,
    )
    first_cache["files"] = 2000
    print(f"startup: first --cache run: {first_cache}", flush=True)
    return first_cache


def table(result: dict) -> str:
    """Markdown: one row per (mode, cold/warm), one column per size, growth factor between sizes."""
    rows, first_cache = result["rows"], result.get("first_cache_run")
    sizes = sorted({r["files"] for r in rows})
    head = ["run"] + [f"{n:,} files" for n in sizes] + [f"growth {a:,} -> {b:,}" for a, b in pairwise(sizes)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for temp in ("cold", "warm"):
            got = {r["files"]: r for r in rows if r["mode"] == mode and r["start"] == temp}
            cells = [
                f"{got[n]['seconds']:.1f} s ({got[n]['cpu_seconds']:.1f} s CPU), {got[n]['peak_rss_mib']:,} MiB"
                if n in got
                else ""
                for n in sizes
            ]
            growth = [
                f"{got[b]['seconds'] / got[a]['seconds']:.1f}x "
                f"({got[b]['cpu_seconds'] / got[a]['cpu_seconds']:.1f}x CPU)"
                if a in got and b in got
                else ""
                for a, b in pairwise(sizes)
            ]
            lines.append(f"| {mode}, {temp} | " + " | ".join(cells + growth) + " |")
    lines.append(
        f"\nSeconds: from the command's start to the first training step (wall; CPU: user + system of every "
        f"process of the job). MiB: peak RSS of the job's largest process; a process that only imports "
        f"the trainer peaks at {result['import_only_rss_mib']:,} MiB."
        + (
            f" First `--cache` run over {first_cache['files']:,} real JPEGs: {first_cache['decodes']:,} decodes "
            f"({first_cache['decodes'] / first_cache['files']:.2f} per file)."
            if first_cache
            else ""
        )
    )
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:  # re-render results/startup.md from results/startup.json
        import json

        (RESULTS / f"{OUT}.md").write_text(table(json.loads((RESULTS / f"{OUT}.json").read_text())) + "\n")
        sys.exit(0)
    sys.exit(main())
