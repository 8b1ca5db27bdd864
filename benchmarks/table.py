"""The README's benchmark table, built from ``benchmarks/results/*.json``."""

from __future__ import annotations

import json

from common import RESULTS


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _best(ips: dict, a: str, b: str) -> str:
    """Ratio of the best repeats: on a shared machine, the least disturbed run of each side."""
    return f"{max(ips[a]['samples']) / max(ips[b]['samples']):.2f}"


def rows() -> list[tuple[str, ...]]:
    out = []
    if r := _load("loader"):
        ips = r["images_per_s"]
        b = ips["blog_pil"]["median"]
        for key, label, target in (
            ("visiontune", "visiontune", ">= 2.5x"),
            ("visiontune_cache", "visiontune `--cache`", ">= 10x"),
            ("visiontune_cpu_normalize", "visiontune + normalise on CPU", ""),
            ("visiontune_cache_cpu_normalize", "`--cache` + normalise on CPU", ""),
        ):
            if key not in ips:
                continue
            out.append(
                (
                    f"Loader 224 px, 1 worker: {label} / blog PIL pipeline",
                    f"{ips[key]['median']:.0f} / {b:.0f} img/s",
                    f"{ips[key]['median'] / b:.2f}x",
                    _best(ips, key, "blog_pil") + "x",
                    target,
                )
            )
        for size, q in r.get("decode", {}).items():
            fast, exact = f"fast_{size}", f"exact_{size}"
            out.append(
                (
                    f"Loader {size} px, 1 worker: `--decode fast` / `exact` "
                    f"(blog PIL pipeline: {ips[f'blog_{size}']['median']:.0f} img/s)",
                    f"{ips[fast]['median']:.0f} / {ips[exact]['median']:.0f} img/s",
                    f"{q['fast_vs_exact']:.2f}x (fast / blog {q['fast_vs_blog']:.2f}x)",
                    _best(ips, fast, exact) + "x",
                    "",
                )
            )
            if "cpu_fast_vs_exact" in q:
                cpu, ms = r["decode_images_per_cpu_s"], r["decode_cpu_ms"]
                out.append(
                    (
                        f"Decode + resize to {size} px, CPU per image: `--decode exact` / `fast` (1 thread)",
                        f"{ms[exact]:.2f} / {ms[fast]:.2f} ms",
                        f"{q['cpu_fast_vs_exact']:.2f}x",
                        _best(cpu, fast, exact) + "x",
                        "",
                    )
                )
    if r := _load("overhead"):
        ips = r["images_per_s"]
        out.append(
            (
                "Trainer overhead: `visiontune train` / hand-written loop (resnet18 32 px, 1 thread)",
                f"{ips['visiontune']['median']:.1f} / {ips['hand_loop']['median']:.1f} img/s",
                f"{r['ratio_visiontune_vs_hand_loop']:.3f}",
                _best(ips, "visiontune", "hand_loop"),
                ">= 0.97",
            )
        )
    if r := _load("e2e"):
        m, q = r["median_seconds"], r["ratios"]
        best = {k: min(x["wall"] for x in v) for k, v in r["runs"].items()}
        for key, label in (
            ("visiontune", f"`visiontune train` ({r['what'].split(', ')[2]})"),
            ("visiontune_cold", "`visiontune train`, a first run (the cache built)"),
            ("visiontune_fast", "`visiontune train --decode fast`"),
            ("visiontune_1worker", "`visiontune train --num-workers 1`"),
            ("visiontune_cache", "`visiontune train --cache` (warm)"),
        ):
            if key not in m:
                continue
            out.append(
                (
                    f"Whole command, {r['what'].split(',')[0]}: blog script / {label}",
                    f"wall {m['blog']['wall']:.1f} / {m[key]['wall']:.1f} s "
                    f"(epochs {m['blog']['epoch']:.1f} / {m[key]['epoch']:.1f} s)",
                    f"{q[key + '_vs_blog_wall']:.2f}x (epochs {q[key + '_vs_blog_epoch']:.2f}x)",
                    f"{best['blog'] / best[key]:.2f}x",
                    {"visiontune": ">= 1.5x", "visiontune_fast": ">= 1.5x", "visiontune_cold": ">= 2x"}.get(key, ""),
                )
            )
    if r := _load("contention"):
        for res in r.get("results", []):  # one row per machine condition
            where = "quiet" if not res["busy_processes"] else f"beside {res['busy_processes']} busy process(es)"
            ratios = []
            for rates in res["rates"].values():
                medians = {k: v["median"] for k, v in rates.items()}
                fixed = [v for k, v in medians.items() if k.startswith("--threads")]
                ratios.append(medians["default"] / max(fixed))
            out.append(
                (
                    f"Default threads / the faster of `--threads 1` and N, {where} (train, evaluate, predict, serve)",
                    " / ".join(f"{x:.2f}" for x in ratios),
                    f"{min(ratios):.2f}",
                    "",
                    ">= 0.90",
                )
            )
    if r := _load("ddp"):
        ips = r["images_per_s"]
        out.append(
            (
                "CPU DDP 2 proc x 1 thread / 1 proc x 2 threads (resnet18 32 px, global batch 32)",
                f"{ips['ddp_2x1']['median']:.1f} / {ips['single_1x2']['median']:.1f} img/s",
                f"{r['ratio_ddp_2x1_vs_single_1x2']:.2f}",
                _best(ips, "ddp_2x1", "single_1x2"),
                f"all-reduce {r['allreduce_share_of_ddp_step']:.0%} of a step",
            )
        )
    if r := _load("rss"):
        g, f = r["growth_small_to_large_mib"], r["cache_file_growth_mib"]
        for w, who in (("0", "main process, no loader workers (CPU default)"), ("1", "main / loader worker")):
            if f"cache, {w} workers" not in g:
                continue
            show = (
                (lambda d: f"{d['main_mib']:+.0f}")
                if w == "0"
                else (lambda d: f"{d['main_mib']:+.0f} / {d['largest_worker_mib']:+.0f}")
            )
            out.append(
                (
                    f"Peak RSS growth, 600 -> 2,400 images, {who}",
                    f"cache: {show(g[f'cache, {w} workers'])} MiB; no cache: {show(g[f'no cache, {w} workers'])} MiB",
                    f"cache file +{f:.0f} MiB",
                    "",
                    "flat",
                )
            )
    if r := _load("process"):
        cpu, s = r["cpu_seconds_per_process"], r["samples_per_cpu_second"]
        out.append(
            (
                "CPU per process: `visiontune train` (1 epoch of 16 images) / the same with the usual exit",
                f"{cpu['visiontune']:.2f} / {cpu['plain_exit']:.2f} s (import alone {cpu['import_only']:.2f} s)",
                f"{r['ratio_visiontune_vs_plain_exit']:.2f}",
                f"{max(s['plain_exit']['samples']) / max(s['visiontune']['samples']):.2f}",  # the least CPU of each
                "< 1",
            )
        )
    return out


def write_table() -> str:
    m = next((r["machine"] for n in ("loader", "overhead", "e2e", "ddp", "rss") if (r := _load(n))), {})
    lines = [
        f"Measured on {m.get('cores', '?')} cores of {m.get('cpu', '?')}, torch {m.get('torch', '?')}, "
        "no GPU; a machine shared with other work (load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in m.get('load_average_at_end') or [])}). Medians of 5 interleaved repeats.",
        "",
        "| Benchmark | Measured (medians) | Ratio of medians | Ratio of best runs | Target |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    text = "\n".join(lines) + "\n"
    (RESULTS / "table.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    write_table()
