"""Memory per process of fine-tuning a ViT-B and a ConvNeXt: full fine-tuning vs ``--lora 8``, each with and
without ``--grad-checkpointing``, one process each (``_memory_run.py``, a fresh process per row so that
each peak RSS is its own).

Each row: the bytes of the parameters, of the gradients and of AdamW's state (its two moments) that the
process holds after STEPS steps at batch BATCH and SIZE px (random images, weights none: memory does not
depend on the values), the trainable state (trainable parameters + their gradients + their moments), its
share of full fine-tuning's, and the process's peak RSS (``getrusage``), which the activations of the
step dominate. Goals (issue 38): LoRA's trainable state under 5% of full fine-tuning's; grad
checkpointing a lower peak. The step time is there to show what checkpointing costs, not as a figure.

    PYTHONPATH=src python benchmarks/memory.py   # writes benchmarks/results/memory.json and memory.md
"""

from __future__ import annotations

import json
import os
import sys

from common import RESULTS, ROOT, run, write_result

MODELS = ("timm/vit_base_patch16_224", "timm/convnext_tiny")
BATCH, SIZE, STEPS = int(os.environ.get("VT_MEM_BATCH", 8)), 224, 2
MIB = 2**20


def measure(model: str, rank: int, grad_ckpt: bool) -> dict:
    script = str(ROOT / "benchmarks" / "_memory_run.py")
    res = run([sys.executable, script, model, str(rank), str(int(grad_ckpt)), str(BATCH), str(SIZE), str(STEPS)])
    return json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("MEM ")][-1][4:])


def main() -> None:
    rows = []
    for model in MODELS:
        full = None
        for rank in (0, 8):
            for grad_ckpt in (False, True):
                m = measure(model, rank, grad_ckpt)
                trainable = m["trainable_params"] + m["grads"] + m["optimizer_state"]
                full = trainable if rank == 0 and not grad_ckpt else full
                rows.append(
                    {
                        "model": model,
                        "setup": f"--lora {rank}" if rank else "full fine-tuning",
                        "grad_checkpointing": grad_ckpt,
                        "processes": 1,
                        **m,
                        "trainable_state": trainable,
                        "trainable_state_share": trainable / full,
                    }
                )
                print(rows[-1], flush=True)
    write_result("memory", {"batch": BATCH, "size": SIZE, "steps": STEPS, "rows": rows})
    lines = [
        f"Memory per process, AdamW, batch {BATCH} at {SIZE} px, {STEPS} steps on a CPU "
        "(`PYTHONPATH=src python benchmarks/memory.py`). MiB; trainable state = trainable parameters + their "
        "gradients + AdamW's moments, and its share of the model's full fine-tuning.",
        "",
        "| model | setup | grad ckpt | processes | params | grads | optimizer state | trainable state | share "
        "| peak RSS | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['setup']} | {'yes' if r['grad_checkpointing'] else 'no'} | {r['processes']} "
            f"| {r['params'] / MIB:.1f} | {r['grads'] / MIB:.1f} | {r['optimizer_state'] / MIB:.1f} "
            f"| {r['trainable_state'] / MIB:.1f} | {100 * r['trainable_state_share']:.2f}% "
            f"| {r['peak_rss_mib']:.0f} | {r['seconds_per_step']:.1f} |"
        )
    (RESULTS / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
