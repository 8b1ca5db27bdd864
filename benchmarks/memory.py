"""Memory per process of fine-tuning a ViT-B and a ConvNeXt: full fine-tuning vs ``--lora 8``, each with and
without ``--grad-checkpointing``, one process each; then the same model in 2 processes (gloo, torchrun)
under ddp and fsdp, with and without ``--grad-checkpointing`` (``_memory_run.py``, fresh processes per
row so that each peak RSS is its own).

Each row: the bytes of the parameters, of the gradients and of AdamW's state (its two moments) that one
process holds after STEPS steps at a global batch of BATCH and SIZE px (random images, weights none:
memory does not depend on the values), the trainable state (trainable parameters + their gradients +
their moments), its share of one process's full fine-tuning, and the process's peak RSS
(``getrusage``), which the activations of the step dominate. In 2 processes: each process's own (a
sharded tensor's local shard), the larger of the two. Goals (issue 38): LoRA's trainable state under 5%
of full fine-tuning's; fsdp x2 at most 55% of ddp x2's per process; grad checkpointing a lower peak.
The step time is there to show what checkpointing costs, not as a figure (2 processes share 2 cores).
``--fsdp-offload`` moves the state from GPU to CPU memory: on a CPU there is nothing to measure.

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


def measure(model: str, rank: int, grad_ckpt: bool, strategy: str = "single", processes: int = 1) -> dict:
    """One row's figures; with several processes each field is the largest process's."""
    script = str(ROOT / "benchmarks" / "_memory_run.py")
    args = [model, str(rank), str(int(grad_ckpt)), str(BATCH // processes), str(SIZE), str(STEPS), strategy]
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    res = run([*launch, script, *args])
    each = [json.loads(ln.split("MEM ", 1)[1]) for ln in res.stdout.splitlines() if "MEM " in ln]
    assert len(each) == processes, res.stdout[-2000:]
    return {k: max(m[k] for m in each) for k in each[0] if k != "rank"}


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
        for strategy in ("ddp", "fsdp"):
            for grad_ckpt in (False, True):
                m = measure(model, 0, grad_ckpt, strategy, processes=2)
                trainable = m["trainable_params"] + m["grads"] + m["optimizer_state"]
                rows.append(
                    {
                        "model": model,
                        "setup": f"{strategy} x2",
                        "grad_checkpointing": grad_ckpt,
                        "processes": 2,
                        **m,
                        "trainable_state": trainable,
                        "trainable_state_share": trainable / full,
                    }
                )
                print(rows[-1], flush=True)
    write_result("memory", {"batch": BATCH, "size": SIZE, "steps": STEPS, "rows": rows})
    lines = [
        f"Memory per process, AdamW, global batch {BATCH} at {SIZE} px, {STEPS} steps on a CPU "
        "(`PYTHONPATH=src python benchmarks/memory.py`). MiB; trainable state = trainable parameters + their "
        "gradients + AdamW's moments, and its share of the model's full fine-tuning on one process; with 2 "
        "processes (gloo), the larger process's figures.",
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
