"""``visiontune evaluate``: a trained run measured honestly on labelled data.

The data is read with the same ``discover`` as ``train`` (any layout it
accepts) and must have the run's classes. When it is the run's own data, only
the run's validation split is scored by default (``--split train|all`` for the
others), since scoring the images a model trained on says little; other data is
scored whole. The forward pass is predict's (``inference.forward``), so every image
counts once whatever the number of processes, and the numbers (see
``metrics``) are computed once, on the main process, from the gathered logits
in data order: N processes give exactly the same figures as one. Unreadable
images are left out of every figure and listed. Beside ``eval.json`` go the
confusion matrix, the top losses (PNG and CSV), and the run's report is rebuilt.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
from pathlib import Path

from visiontune import files, tasks
from visiontune.cluster import launch
from visiontune.data import remote, sources
from visiontune.data.groups import split_images
from visiontune.data.imageset import ImageSet
from visiontune.data.sources import discover
from visiontune.data.split import method_of, relative_paths, split_of, split_summary
from visiontune.errors import UserError
from visiontune.inference import loaded as inference
from visiontune.inference import tta
from visiontune.inference.loaded import InferenceConfig, LoadedModel, unreadable_reasons
from visiontune.reports import evaluations, figures, metrics, multilabel, regression
from visiontune.reports.report import beside
from visiontune.runs import runinfo, runrecords
from visiontune.tasks import UNREADABLE

SPLITS = ("val", "train", "all")


def run_data(run_dir: str | None) -> str | None:
    """The data folder a run recorded in its config.json (None when unknown)."""
    record = runrecords.read_config(run_dir) if run_dir else None
    return record["data"].get("root") if record else None


def recorded_data(run_dir: str) -> tuple[str, tuple[str | None, str | None]]:
    """What to list as the run's own data when evaluate is given none: the data argument its training was
    given (``source`` in config.json), and the hf: columns it named. One line when there is none to read."""
    record = runrecords.read_config(run_dir) or {}
    data = record.get("data") or {}
    if not (data.get("source") or data.get("root")):
        raise UserError(f"evaluate needs labelled data: {run_dir} records no data folder; pass --data FOLDER")
    source = data.get("source")
    if not source and data.get("layout") == "manifest":
        # Runs from before "source" was recorded kept only the images' folder, which is not a layout.
        raise UserError(
            f"{run_dir} was trained on a manifest and records only its images' folder ({data.get('root')}); "
            "pass --data with the folder holding train.csv, or the .csv itself"
        )
    source = source or data["root"]
    remote.refuse_command(source, str(Path(run_dir) / "config.json"))
    if not sources.exists(source):
        raise UserError(f"evaluate needs labelled data: the run's data {source} no longer exists; pass --data FOLDER")
    config = record.get("config") or {}
    return source, (config.get("image_column"), config.get("label_column"))


def _same_listing(images: ImageSet, run_dir: str, record: dict, root: str | None) -> bool:
    """Whether ``images``, less the run's bad files, split as the run split its data, give ``split.json``'s
    sha256: the run's own data, wherever it is now."""
    if not {"seed", "val_fraction", "sha256"} <= set(record):  # (read_split checked the types of those it has)
        return False
    seed, fraction, want = record["seed"], float(record["val_fraction"]), record["sha256"]
    listed = runrecords.read_bad_files(run_dir)
    if listed is None:
        return False
    bad = {os.path.relpath(p, root or images.root) for p in listed}
    names = relative_paths(images.paths, range(len(images)), images.root)
    kept = images.take([i for i, name in enumerate(names) if name not in bad])
    try:  # as the run split it: grouped or a fold when its split.json says so
        folds, fold = int(record.get("folds", 0)), int(record.get("fold", 0))
        grouped = split_images(kept, fraction, seed, record.get("group_by"), folds, fold, kept.root)
        split = grouped[0] if grouped else split_of(kept, fraction, seed, method_of(record))
    except (UserError, OSError, ValueError, TypeError):  # too few images to split as the run did: not its data
        return False
    return split_summary(split, kept.paths, kept.root, seed, fraction)["sha256"] == want


def own_data(images: ImageSet, run_dir: str | None) -> bool | None:
    """Whether ``images`` are ``run_dir``'s own data: its recorded folder, or (moved, or recorded relative to
    another working folder) the listing its ``split.json`` hashes. None: no ``split.json`` to tell by."""
    if run_dir is None:
        return False
    root = run_data(run_dir)
    if root is not None and (root == images.root or os.path.realpath(root) == os.path.realpath(images.root)):
        return True
    record = runrecords.read_split(run_dir)
    if record is None:
        return None
    return _same_listing(images, run_dir, record, root)


def select(images: ImageSet, run_dir: str | None, split: str | None) -> tuple[ImageSet, dict]:
    """The images to score, and what they are: a split of the run's own data, or all of ``images``."""
    if split is not None and split not in SPLITS:
        raise UserError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    own = own_data(images, run_dir)
    if own is None:  # scoring it whole is all that can be done; describe() says training images may be in it
        if split in ("val", "train"):
            raise UserError(
                f"{Path(run_dir) / 'split.json'} is missing, so the run's {split} images cannot be told apart "
                f"in {images.root}; pass --split all to score every image, training images included"
            )
        return images, {"split": "all", "own_data": None}
    if not own:
        if split in ("val", "train"):
            raise UserError(
                f"--split {split} needs the run's own data ({run_data(run_dir) or 'unknown'}); "
                f"{images.root} is other data and is scored whole"
            )
        return images, {"split": "all", "own_data": False}
    split = split or "val"
    if split == "all":
        return images, {"split": "all", "own_data": True}
    split_file = Path(run_dir) / "split.json"
    lists = runrecords.read_split(run_dir) or {}
    if split not in lists:
        raise UserError(f"cannot read the {split} list of {split_file} (it has none); pass --split all")
    # The lists as the run wrote them: a val list edited since (training images in it) would be scored as held out.
    runrecords.held_to_sha256(lists, split_file)
    wanted = set(lists[split])
    keep = [i for i, p in enumerate(relative_paths(images.paths, range(len(images)), images.root)) if p in wanted]
    if not keep:
        raise UserError(
            f"none of the {len(wanted)} {split} files of {split_file} is in {images.root} now; pass --split all"
        )
    return images.take(keep), {"split": split, "own_data": True, "split_files_missing": len(wanted) - len(keep)}


def model_file(path: str | None) -> dict | None:
    """The scored model file as an evaluation records it: its name and sha256 (None: a model not read from one)."""
    if not path:
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"name": Path(path).name, "sha256": digest.hexdigest()}


def default_out(run_dir: str, weights: str | None) -> str:
    """Where ``evaluate --run RUN`` writes: ``RUN/eval.json`` for the run's own model, and beside it
    ``RUN/eval-NAME.json`` for another file of it scored on its data (an export: ``eval-best.int8.json``), so
    that neither evaluation replaces the other."""
    if not weights or Path(weights).resolve() == Path(runinfo.best_weights(run_dir)).resolve():
        return str(Path(run_dir) / "eval.json")
    return str(Path(run_dir) / f"eval-{Path(weights).stem}.json")


def describe(scored: dict, n: int, total: int) -> str:
    if scored["own_data"] is None:
        return (
            f"all {n} images, training images possibly included (the run's split.json is missing: "
            "it cannot be told whether this is the data the model trained on)"
        )
    if not scored["own_data"]:
        return f"all {n} images (not the run's own data)"
    name = {
        "val": "the run's validation split",
        "train": "the run's TRAINING split (the model has seen these)",
        "all": "all of the run's data, training images included",
    }[scored["split"]]
    return f"{name}: {n} of {total} images" + (" (--split train|all for the rest)" if scored["split"] == "val" else "")


def write_top_losses(out: str, items: list[dict], paths: list[str], classes: list[str]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["rank", "path", "true", "predicted", "probability", "true_probability", "loss"])
    for rank, it in enumerate(items, 1):
        w.writerow(
            [
                rank,
                paths[it["index"]],
                classes[it["true"]],
                classes[it["predicted"]],
                f"{it['probability']:.6f}",
                f"{it['true_probability']:.6f}",
                f"{it['loss']:.6f}",
            ]
        )
    files.atomic_write(beside(out, "top_losses.csv"), buf.getvalue())
    figures.plot_top_losses(beside(out, "top_losses.png"), items, paths, classes)


WORST = "worst_per_class.csv"
PREDICTIONS = "predictions.csv"  # multi-label: the scored images' true labels and probabilities


def _multilabel(accelerator, loaded, outputs, paths, chosen, images, scored, tta_mode, top_n, out) -> dict:
    """A multi-label model's ``eval.json`` (mAP, per-class AP and F1 at the model's thresholds, exact match),
    ``worst_per_class.csv`` and ``predictions.csv``, from the gathered outputs."""
    logits, got = outputs
    skipped = unreadable_reasons(paths, got, chosen.reader, tasks.MULTI_LABEL)
    ok = tasks.MULTI_LABEL.readable(got)
    kept = [p for p, k in zip(paths, ok.tolist()) if k]
    probs, targets = tasks.MULTI_LABEL.probabilities(logits[ok]), got[ok]
    thresholds = loaded.info.decision_thresholds
    report = {
        "data": images.root,
        "layout": images.layout,
        **scored,
        "scored": describe(scored, int(ok.sum()), len(images.paths)),
        "tta": tta_mode,
        "classes": loaded.classes,
        "task": loaded.info.task.name,
        "report": evaluations.of(loaded.info.task).name,
        "thresholds_from": loaded.thresholds_from if loaded.info.thresholds else "0.5 (none recorded)",
        **multilabel.multilabel_metrics(probs, targets, loaded.classes, thresholds),
        "world_size": accelerator.num_processes,
        "skipped": [{"path": p, "reason": r} for p, r in skipped],
    }
    worst = multilabel.worst_per_class(probs, targets, top_n)
    report["worst_per_class"] = {
        name: [{**it, "path": kept[it["index"]]} for it in items] for name, items in zip(loaded.classes, worst)
    }
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["class", "rank", "path", "labelled", "probability", "threshold"])
    for (name, items), t in zip(report["worst_per_class"].items(), thresholds):
        for rank, it in enumerate(items, 1):
            w.writerow([name, rank, it["path"], int(it["positive"]), f"{it['probability']:.6f}", f"{t:.6f}"])
    folder = Path(out).parent
    files.atomic_write(beside(out, WORST), buf.getvalue())
    # The scored outputs at full precision (repr): every figure of eval.json can be recomputed from them.
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["path", "labels", *(f"prob_{c}" for c in loaded.classes)])
    for path, row, ys in zip(kept, probs.tolist(), (targets > 0.5).tolist()):
        w.writerow([path, ";".join(c for c, y in zip(loaded.classes, ys) if y), *map(repr, row)])
    files.atomic_write(beside(out, PREDICTIONS), buf.getvalue())
    files.write_json(out, report)
    print(multilabel.table(report))
    print(
        f"visiontune: scored {report['scored']}{'; TTA ' + tta_mode if tta_mode != 'none' else ''}\n"
        f"visiontune: mAP {_num(report['map'])} (micro {_num(report['map_micro'])}), exact match "
        f"{_num(report['exact_match'])}, micro F1 {_num(report['averages']['micro']['f1'])}, macro F1 "
        f"{_num(report['averages']['macro']['f1'])} at the thresholds of {report['thresholds_from']}"
    )
    print(f"visiontune: wrote {out}, {beside(out, WORST).name} and {beside(out, PREDICTIONS).name} in {folder}")
    return report


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def print_report(report: dict) -> None:
    print(metrics.confusion_text(report))
    print(metrics.per_class_table(report))
    top = f", top-{report['top_k']} {_num(report['top_k_accuracy'])}" if report["top_k"] else ""
    print(
        f"visiontune: scored {report['scored']}{'; TTA ' + report['tta'] if report['tta'] != 'none' else ''}\n"
        f"visiontune: accuracy {_num(report['accuracy'])}, balanced accuracy {_num(report['balanced_accuracy'])}"
        f"{top}, macro F1 {_num(report['averages']['macro']['f1'])}, "
        f"macro AP {_num(report.get('macro_average_precision'))}, log loss {_num(report['log_loss'])}, "
        f"ECE {_num(report['ece'])}"
    )


def evaluate(
    loaded: LoadedModel,
    icfg: InferenceConfig,
    data: str,
    out: str,
    *,
    run_dir: str | None = None,
    split: str | None = None,
    tta_mode: str = "none",
    top_n: int = 16,
    columns: tuple[str | None, str | None] = (None, None),
) -> dict:
    """Measure ``model`` on ``data`` (its val split when it is the run's data); write ``out`` and the figures."""
    if top_n < 0:
        raise UserError(f"--top-losses must be 0 or more, got {top_n}")
    task = loaded.info.task
    # the model's task reads the data's labels: labels of another kind are refused as it lists them
    images, classes = discover(data, *columns, task=task), loaded.classes
    # Case aside (Kaggle's cat/dog, PetImages' Cat/Dog), the names (a regression's targets) and their order
    # must agree.
    if [c.lower() for c in images.classes] != [c.lower() for c in classes]:
        raise UserError(
            f"{data} has classes {images.classes} but the model was trained on {classes}; "
            "evaluate on data with the same classes"
        )
    if launch.rank() == 0:
        print(images.describe())
    chosen, scored = select(images, run_dir, split)
    scored = {**scored, "model_file": model_file(loaded.file)}  # what was scored: these images, by this file
    paths = list(chosen.paths)
    accelerator = inference.start(icfg)
    model = tta.wrap_loaded(loaded, tta_mode)
    logits, got = inference.forward(
        accelerator, model, icfg, paths, chosen.label_array, "evaluate", chosen.reader, task
    )
    report = {}
    if accelerator.is_main_process:
        report = evaluations.of(task).write(
            accelerator, loaded, (logits, got), paths, chosen, images, scored, tta_mode, top_n, out
        )
        if run_dir:
            from visiontune.reports import report as run_report

            # An export's evaluation beside the run's own (eval-NAME.json) is shown beside it, not instead of it.
            shown = None if run_report.is_beside(run_dir, out) else out
            print(f"visiontune: report {run_report.write(run_dir, eval_json=shown)}")
    accelerator.wait_for_everyone()
    return report


def _single_label(accelerator, loaded, outputs, paths, chosen, images, scored, tta_mode, top_n, out) -> dict:
    """A single-label model's ``eval.json`` (accuracy, per-class precision and recall, AP, log loss, ECE), its
    confusion matrix and its top losses, from the gathered outputs."""
    logits, got = outputs
    classes = loaded.classes
    skipped = unreadable_reasons(paths, got, chosen.reader)
    ok = got != UNREADABLE
    kept = [p for p, k in zip(paths, ok.tolist()) if k]
    report = {
        "data": images.root,
        "layout": images.layout,
        **scored,
        "scored": describe(scored, int(ok.sum()), len(images.paths)),
        "tta": tta_mode,
        "classes": classes,
        "task": loaded.info.task.name,
        "report": evaluations.of(loaded.info.task).name,
        **metrics.classification_metrics(logits[ok], got[ok], classes),
        "world_size": accelerator.num_processes,
        "skipped": [{"path": p, "reason": r} for p, r in skipped],
    }
    losses = metrics.top_losses(logits[ok], got[ok], top_n)
    report["top_losses"] = [{**it, "path": kept[it["index"]]} for it in losses]
    folder = Path(out).parent
    figures.plot_confusion(beside(out, "confusion_matrix.png"), report)
    write_top_losses(out, losses, kept, classes)
    files.write_json(out, report)
    print_report(report)
    named = ", ".join(beside(out, n).name for n in ("confusion_matrix.png", "top_losses.png"))
    print(f"visiontune: wrote {out}, {named} and {beside(out, 'top_losses.csv').name} in {folder}")
    return report


RESIDUALS = "largest_residuals.csv"


def _regression(accelerator, loaded, outputs, paths, chosen, images, scored, tta_mode, top_n, out) -> dict:
    """A regression model's ``eval.json`` (MAE, RMSE and R² per target, in their units), ``predictions.csv``
    (every scored image's true and predicted values), the largest residuals and ``scatter.png``."""
    logits, got = outputs
    task = loaded.info.task
    skipped = unreadable_reasons(paths, got, chosen.reader, task)
    ok = task.readable(got)
    kept = [p for p, k in zip(paths, ok.tolist()) if k]
    pred, true = task.values(logits[ok]).numpy(), got[ok].double().numpy()
    names = list(loaded.classes)
    report = {
        "data": images.root,
        "layout": images.layout,
        **scored,
        "scored": describe(scored, int(ok.sum()), len(images.paths)),
        "tta": tta_mode,
        "classes": names,
        "task": task.name,
        "report": evaluations.of(task).name,
        **regression.regression_metrics(pred, true, names),
        "world_size": accelerator.num_processes,
        "skipped": [{"path": p, "reason": r} for p, r in skipped],
    }
    # what the task ranks by beyond these (its own metrics), from the same outputs
    report.update({k: v for k, v in task.ranking(logits, got).items() if k not in report})
    worst = regression.largest_residuals(pred, true, top_n)
    report["largest_residuals"] = [{**it, "path": kept[it["index"]]} for it in worst]
    folder = Path(out).parent
    # The scored outputs at full precision (repr): every figure of eval.json can be recomputed from them.
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["path", *(f"true_{n}" for n in names), *(f"predicted_{n}" for n in names)])
    for path, t, p in zip(kept, true.tolist(), pred.tolist()):
        w.writerow([path, *map(repr, t), *map(repr, p)])
    files.atomic_write(beside(out, PREDICTIONS), buf.getvalue())
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["rank", "path", "error", *(f"true_{n}" for n in names), *(f"predicted_{n}" for n in names)])
    for rank, it in enumerate(report["largest_residuals"], 1):
        w.writerow([rank, it["path"], repr(it["error"]), *map(repr, it["true"]), *map(repr, it["predicted"])])
    files.atomic_write(beside(out, RESIDUALS), buf.getvalue())
    regression.plot_scatter(beside(out, "scatter.png"), pred, true, names)
    files.write_json(out, report)
    print(
        f"visiontune: scored {report['scored']}{'; TTA ' + tta_mode if tta_mode != 'none' else ''}\n"
        f"visiontune: MAE {_num(report['mae'])}, RMSE {_num(report['rmse'])}, R² {_num(report['r2'])} "
        f"(always the mean: MAE {_num(report['baseline_mae'])})"
    )
    named = ", ".join(beside(out, n).name for n in (PREDICTIONS, RESIDUALS))
    print(f"visiontune: wrote {out}, {named} and {beside(out, 'scatter.png').name} in {folder}")
    return report


# The eval.json writer of each built-in task; its page section is registered beside it by ``reports.report``.
evaluations.register(tasks.SINGLE_LABEL.name, write=_single_label)
evaluations.register(tasks.MULTI_LABEL.name, write=_multilabel)
evaluations.register(tasks.REGRESSION.name, write=_regression)
