"""The reference job's Accelerate script, as a baseline: its PIL pipeline and its loop, unchanged in kind.

What differs from the blog is only what a benchmark needs: the model, image
size, batch, epochs and data folder come from the command line (so both sides
train the same thing), the model starts without pretrained weights, tqdm is
off (visiontune runs with --no-progress), and the loop time is printed
precisely. It reads the Kaggle layout, splits 80/20 with ``random_split``,
loads with ``num_workers=mp.cpu_count()``, trains and validates each epoch,
keeps the best weights, saves them and draws the plot, as the blog does.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import multiprocessing as mp
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.optim as optim  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from common import BlogDataset  # noqa: E402
from visiontune.models.build import build_model  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--model", default="vgg16")
p.add_argument("--image-size", type=int, default=224)
p.add_argument("--batch-size", type=int, default=50)
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--lr", type=float, default=0.001)
p.add_argument("--out", required=True)
args = p.parse_args()

torch.manual_seed(42)
np.random.seed(42)
accelerator = Accelerator(cpu=not torch.cuda.is_available())
device = accelerator.device
train_dataset = BlogDataset(sorted(glob.glob(os.path.join(args.data, "train", "*.jpg"))), args.image_size)
n_samples = len(train_dataset)
train_size = int(n_samples * 0.8)
train_dataset, val_dataset = torch.utils.data.random_split(train_dataset, [train_size, n_samples - train_size])
datasets = {"train": train_dataset, "val": val_dataset}
dataloaders = {
    x: torch.utils.data.DataLoader(
        datasets[x], batch_size=args.batch_size, shuffle=True, pin_memory=True, num_workers=mp.cpu_count()
    )
    for x in ["train", "val"]
}
model = build_model(args.model, 2, "none")
optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
criterion = nn.CrossEntropyLoss()
model, optimizer, dataloaders["train"], dataloaders["val"] = accelerator.prepare(
    model, optimizer, dataloaders["train"], dataloaders["val"]
)

since = time.time()
history = {"accuracy": [], "val_accuracy": [], "loss": [], "val_loss": []}
best_model_wts, best_acc = copy.deepcopy(model.state_dict()), 0.0
phase_seconds = {"train": 0.0, "val": 0.0}
for epoch in range(args.epochs):
    accelerator.print(f"Epoch {epoch}/{args.epochs - 1}\n" + "-" * 10)
    for phase in ["train", "val"]:
        t0 = time.perf_counter()
        model.train() if phase == "train" else model.eval()
        running_loss, running_corrects = 0.0, 0
        for inputs, labels in dataloaders[phase]:
            optimizer.zero_grad()
            with torch.set_grad_enabled(phase == "train"):
                outputs = model(inputs)
                loss = criterion(outputs, labels)
                _, preds = torch.max(outputs, 1)
                if phase == "train":
                    accelerator.backward(loss)
                    optimizer.step()
            running_loss += loss * inputs.size(0)
            running_corrects += torch.sum(preds == labels.data)
        epoch_loss = running_loss.item() / len(dataloaders[phase].dataset)
        epoch_acc = running_corrects.double() / len(dataloaders[phase].dataset)
        phase_seconds[phase] += time.perf_counter() - t0
        accelerator.print(f"{phase} Loss: {epoch_loss:.4f} Acc: {epoch_acc:.4f}")
        if phase == "val" and epoch_acc > best_acc:
            best_acc, best_model_wts = epoch_acc, copy.deepcopy(model.state_dict())
        history["accuracy" if phase == "train" else "val_accuracy"].append(epoch_acc.item())
        history["loss" if phase == "train" else "val_loss"].append(epoch_loss)
time_elapsed = time.time() - since
accelerator.print(f"Training complete in {time_elapsed // 60:.0f}m {time_elapsed % 60:.0f}s")
model.load_state_dict(best_model_wts)
os.makedirs(args.out, exist_ok=True)
torch.save(accelerator.unwrap_model(model).to("cpu").state_dict(), os.path.join(args.out, "best.pth"))
plt.figure(figsize=(24, 8))
plt.subplot(1, 2, 1)
plt.plot(range(args.epochs), history["accuracy"], label="Training Accuracy")
plt.plot(range(args.epochs), history["val_accuracy"], label="Validation Accuracy")
plt.subplot(1, 2, 2)
plt.plot(range(args.epochs), history["loss"], label="Training Loss")
plt.plot(range(args.epochs), history["val_loss"], label="Validation Loss")
plt.savefig(os.path.join(args.out, "training_results.png"))
with open(os.path.join(args.out, "timing.json"), "w") as f:
    json.dump({"loop_seconds": time_elapsed, **phase_seconds}, f)
