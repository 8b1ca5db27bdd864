"""fastai's ``fine_tune`` as the peer in benchmarks/transfer.py, run with an interpreter that has fastai.

``vision_learner(dls, resnet18)`` loads torchvision's DEFAULT resnet18 weights (the benchmark's backbone,
under its ``TORCH_HOME``), cuts its classifier and adds fastai's head, and normalises with the weights'
ImageNet statistics. ``fine_tune(epochs - 1)`` is fastai's recipe for it: one frozen epoch (the head and
every BatchNorm train) with one-cycle at the base lr 2e-3, then everything, with discriminative lrs (the
body's first group at 1/100), one-cycle at half the base lr. Trained on ``ROOT/train`` (class folders),
the epoch best on ``ROOT/validation`` kept (SaveModelCallback, across both phases), scored on ``TEST``;
the accuracy is written to ``OUT``.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastai.vision.all import (
    CategoryBlock,
    DataBlock,
    GrandparentSplitter,
    ImageBlock,
    Resize,
    SaveModelCallback,
    accuracy,
    get_image_files,
    parent_label,
    resnet18,
    set_seed,
    vision_learner,
)

from common import peer_args


def main() -> None:
    args = peer_args(__doc__, size=False, epochs_help="in all: one frozen, then the rest")
    set_seed(args.seed)
    block = DataBlock(
        blocks=(ImageBlock, CategoryBlock),
        get_items=get_image_files,
        splitter=GrandparentSplitter(train_name="train", valid_name="validation"),
        get_y=parent_label,
        item_tfms=Resize(32),
    )
    dls = block.dataloaders(args.root, bs=args.batch, num_workers=0, device="cpu")
    learn = vision_learner(dls, resnet18, metrics=accuracy, path=Path(args.out).parent)
    keep = SaveModelCallback(monitor="accuracy", fname="best", reset_on_fit=False)
    with learn.no_bar(), learn.no_logging():
        learn.fine_tune(args.epochs - 1, cbs=keep)
        test = dls.test_dl(get_image_files(args.test), with_labels=True)
        preds, targets = learn.get_preds(dl=test)
    acc = (preds.argmax(1) == targets).float().mean().item()
    Path(args.out).write_text(json.dumps({"test_accuracy": acc, "test_count": len(targets)}))


if __name__ == "__main__":
    main()
