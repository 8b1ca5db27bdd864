"""fastai's one-cycle as a peer in benchmarks/recipe.py, run with an interpreter that has fastai.

Trains torchvision's resnet18 from scratch on ``ROOT/train`` (class folders), keeps the epoch best on
``ROOT/validation`` (SaveModelCallback), and writes the accuracy on ``TEST`` (class folders) to ``OUT``.
fastai's defaults otherwise: ``fit_one_cycle`` (Adam, lr_max 1e-3, weight decay 0.01 not on norms),
batch statistics for the normalisation, no augmentation (the other tools get none either).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torchvision
from fastai.vision.all import (
    CategoryBlock,
    DataBlock,
    GrandparentSplitter,
    ImageBlock,
    Learner,
    Normalize,
    Resize,
    SaveModelCallback,
    accuracy,
    get_image_files,
    parent_label,
)

from common import peer_args


def main() -> None:
    args = peer_args(__doc__)
    torch.manual_seed(args.seed)
    block = DataBlock(
        blocks=(ImageBlock, CategoryBlock),
        get_items=get_image_files,
        splitter=GrandparentSplitter(train_name="train", valid_name="validation"),
        get_y=parent_label,
        item_tfms=Resize(args.size),
        batch_tfms=Normalize(),
    )
    dls = block.dataloaders(args.root, bs=args.batch, num_workers=0, device="cpu")
    model = torchvision.models.resnet18(num_classes=len(dls.vocab))
    learn = Learner(dls, model, metrics=accuracy, path=Path(args.out).parent)
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(args.epochs, cbs=SaveModelCallback(monitor="accuracy", fname="best"))
        test = dls.test_dl(get_image_files(args.test), with_labels=True)
        preds, targets = learn.get_preds(dl=test)
    acc = (preds.argmax(1) == targets).float().mean().item()
    Path(args.out).write_text(json.dumps({"test_accuracy": acc, "test_count": len(targets)}))


if __name__ == "__main__":
    main()
