"""The model card of a run: the ``README.md`` of its Hugging Face Hub folder (``inference.hub``).

Hub front matter (YAML: ``library_name: timm``, the tags, the ``hf:`` data set when there is one, the
metrics, and a ``model-index`` carrying the best epoch's validation metrics exactly as ``summary.json``
has them), then the data set's name and size, the recipe (the resolved setup the run announced,
``config.json``'s ``overview``), the best validation metrics with the count of images they were
computed on, the curves picture, and how to load the model with timm, transformers (its timm wrapper)
and visiontune. Every number
comes from ``summary.json`` (the body rounds to four decimals) or from the announced recipe. Only the
data folder's name is shown, never its path: a card is published.
"""

from __future__ import annotations

import html
import re
from pathlib import PurePosixPath

import yaml

from visiontune.data import sources
from visiontune.tasks import SINGLE_LABEL, Task, recorded

# The announced setup lines that make the recipe (the rest -- image counts, cache paths -- are not the
# recipe, or are local to the machine that trained).
RECIPE = (
    "model",
    "recipe",
    "batch",
    "optimizer steps",
    "optimizer",
    "lr schedule",
    "loss",
    "sampler",
    "augmentation",
    "EMA",
    "normalisation",
    "decode",
)


def dataset_name(config: dict) -> tuple[str, str | None]:
    """(the data set's name, its Hub id when it came from ``hf:``)."""
    source = str((config.get("data") or {}).get("source") or (config.get("config") or {}).get("data") or "data")
    hub_id = sources.hub_id(source)
    if hub_id:
        return hub_id, hub_id
    return PurePosixPath(source.split("?")[0].rstrip("/")).name or "data", None


def metrics(summary: dict) -> list[tuple[str, str, float]]:
    """(model-index type, name, value) of the best epoch's validation metrics."""
    named = (("accuracy", "accuracy"), ("map", "mAP"), ("mae", "MAE"), ("rmse", "RMSE"), ("r2", "R²"))
    rows = [
        (k, f"validation {n}", summary[f"best_val_{k}"]) for k, n in named if summary.get(f"best_val_{k}") is not None
    ]
    rows.append(("loss", "validation loss", summary["best_val_loss"]))
    return rows


def front_matter(config: dict, summary: dict, name: str) -> dict:
    data, hub_id = dataset_name(config)
    meta: dict = {
        "library_name": "timm",
        "pipeline_tag": "image-classification",
        "tags": ["image-classification", "timm", "visiontune"],
    }
    if hub_id:
        meta["datasets"] = [hub_id]
    meta["metrics"] = [t for t, _, _ in metrics(summary) if t != "loss"]
    meta["model-index"] = [
        {
            "name": name,
            "results": [
                {
                    "task": {"type": "image-classification", "name": "Image Classification"},
                    "dataset": {"name": data, "type": hub_id or "imagefolder", "split": "validation"},
                    "metrics": [{"type": t, "name": n, "value": v} for t, n, v in metrics(summary)],
                }
            ],
        }
    ]
    return meta


def card(config: dict, summary: dict, architecture: str, repo: str | None, curves: str | None) -> str:
    """The README.md text; ``repo`` (ORG/NAME) names the Hub repository in the loading snippets."""
    model = config.get("model") or {}
    classes = summary.get("classes") or model.get("classes") or []
    task = recorded(model) or SINGLE_LABEL
    data, _ = dataset_name(config)
    name = repo.split("/")[-1] if repo else f"{architecture}-{data}"
    where = f"hf-hub:{repo}" if repo else "local-dir:PATH/TO/THIS/FOLDER"
    overview = config.get("overview") or {}
    lines = [
        "---",
        yaml.safe_dump(front_matter(config, summary, name), sort_keys=False).rstrip(),
        "---",
        "",
        f"# {_md(name)}",
        "",
        f"{_code(model.get('model', architecture))} ({_md(model.get('source', 'timm'))}; timm architecture "
        f"{_code(architecture)}) trained with visiontune to "
        f"{task.card_verb} {len(classes)} {task.classes_word}: "
        f"{', '.join(_md(c) for c in classes)}.",
        "",
        "## Data",
        "",
        f"- data set: {_md(data)} ({_md((config.get('data') or {}).get('layout') or 'folder')} layout)",
        f"- training split: {summary['train_split_size']} images",
        f"- validation split: {summary['val_split_size']} images",
        "",
        "## Recipe",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {k} | {_md(overview[k])} |" for k in RECIPE if k in overview),  # a value cannot end the row
        "",
        "## Validation results",
        "",
        f"The best epoch ({summary['best_epoch']}, counting from 1, of {summary['epochs']}; "
        f"{_md(summary['best_weights'])} weights), on {summary['val_images_counted']} validation images:",
        "",
        "| metric | value |",
        "|---|---|",
        *(f"| {n} | {v:.4f} |" for _, n, v in metrics(summary)),
        "",
    ]
    if curves:
        lines += [f"![training curves]({curves})", ""]
    lines += _usage(where, repo, task)
    return "\n".join(lines) + "\n"


# Markdown's inline marks (emphasis, code, links and images, table bars, strike-through, a heading's closing
# hashes): backslash-escaped in text from a run folder, so a name shows as written and builds nothing.
_MARKS = re.compile(r"([\\`*_\[\]|~#])")


def _md(value) -> str:
    """Text from a run folder (a class name, a data set's name, a recipe line) as inline markdown that shows
    exactly that text: on one line (line breaks and other control characters become spaces, so it cannot
    start a heading, a list or front matter), HTML's ``< > &`` as entities (no tag reaches the page), and
    markdown's marks escaped."""
    return _MARKS.sub(r"\\\1", html.escape(_one_line(value), quote=False))


def _one_line(value) -> str:
    return " ".join("".join(c if c.isprintable() else " " for c in str(value)).split())


def _code(value) -> str:
    """A name in a code span, where nothing is markup; one holding a backtick (which would end it) as text."""
    text = _one_line(value)
    return f"`{text}`" if text and "`" not in text else _md(text)


def _usage(where: str, repo: str | None, task: Task) -> list[str]:
    weights = f'hf_hub_download("{repo}", "model.safetensors")' if repo else '"PATH/TO/THIS/FOLDER/model.safetensors"'
    lines = [
        "## How to use",
        "",
        "With timm (its own preprocessing, configured as the model was trained):",
        "",
        "```python",
        "import timm, torch",
        "from PIL import Image",
        "from timm.data import create_transform, resolve_data_config",
        "",
        f'model = timm.create_model("{where}", pretrained=True).eval()',
        "transform = create_transform(**resolve_data_config(model=model))",
        "labels = model.pretrained_cfg['label_names']",
        "with torch.no_grad():",
        '    logits = model(transform(Image.open("image.jpg").convert("RGB")).unsqueeze(0))',
        f"probabilities = dict(zip(labels, {task.activation_code}[0].tolist()))",
        "```",
        "",
    ]
    if task.card_note:
        lines += [task.card_note, ""]
    folder = repo or "PATH/TO/THIS/FOLDER"
    lines += [
        "With transformers (its timm wrapper, with timm's transforms from the same config):",
        "",
        "```python",
        "import torch",
        "from PIL import Image",
        "from transformers import AutoImageProcessor, AutoModelForImageClassification",
        "",
        f'model = AutoModelForImageClassification.from_pretrained("{folder}").eval()',
        f'processor = AutoImageProcessor.from_pretrained("{folder}")',
        "with torch.no_grad():",
        '    logits = model(**processor(Image.open("image.jpg").convert("RGB"), return_tensors="pt")).logits',
        f"probabilities = dict(zip(model.config.id2label.values(), {task.activation_code}[0].tolist()))",
        "```",
        "",
        "With visiontune (its own decode and resize, as in training; thresholds applied):",
        "",
        "```python",
        *(["from huggingface_hub import hf_hub_download"] if repo else []),
        "import visiontune",
        "",
        f"predictor = visiontune.load({weights})",
        'print(predictor.predict("image.jpg"))',
        "```",
        "",
    ]
    return lines
