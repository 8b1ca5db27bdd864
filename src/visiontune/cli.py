"""The ``visiontune`` command line: one function per subcommand, each called with ``(args, argv)``.

This module and ``flags`` (the training flags made from ``TrainConfig``) are
the only ones that see argparse. A ``UserError`` from anywhere below, argparse's
own complaints included, becomes one line on stderr and exit code 2; ``argv``
is the subcommand's own arguments, for relaunching under torch.distributed.run.
"""

from __future__ import annotations

import argparse
import os
import sys

from visiontune import slurm
from visiontune.config import TrainConfig, UserError, choices
from visiontune.faults import RunStopped
from visiontune.flags import OneLineParser, add_train_flags, config_from_args, positive
from visiontune.host import available_cores


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune import launch, models, runlock, strategy
    from visiontune.data.layouts import discover

    cfg = config_from_args(args)
    launch.join_cluster(cfg)  # Slurm started every process: take the rank it gave this one
    # Check what can be checked before any worker starts: one error line, not N. The listing is the
    # job's only one: the run in this process or the workers take it over (a worker lists nothing here).
    images = None if launch.is_worker() else discover(cfg.data)
    strategy.check(cfg)
    models.get_spec(cfg.model)  # an unknown or unreachable model: one line now
    if launch.needs_launcher(cfg):
        from visiontune.data.jobdata import shared_listing

        models.ensure_weights(cfg.model, cfg.weights)
        if cfg.output_dir is None:  # fixed here, so that every worker writes the same folder
            cfg = cfg.replace(output_dir=launch.run_folder(cfg))
            argv = [*argv, "--output-dir", cfg.output_dir]
        # One machine: this process outlives any worker restart, so it holds the run folder's lock.
        one_machine = launch.node_range(launch.plan(cfg).nnodes) == (1, 1)
        with runlock.hold_for_workers(cfg.output_dir if one_machine else None), shared_listing(images, cfg.data):
            return launch.relaunch(cfg, argv)
    from visiontune.trainer import train

    train(cfg, images)
    return 0


def cmd_lr_find(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.lrfind import lr_find

    cfg = config_from_args(args)
    found = lr_find(cfg, start=args.start_lr, end=args.end_lr, steps=args.steps)
    print(f"visiontune: suggested lr {found['suggested_lr']:.2g} (loss against lr: {found['dir']}/lr_find.png)")
    return 0


def cmd_prepare(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.data.layouts import write_kaggle_manifest

    out, n = write_kaggle_manifest(args.data)
    print(f"visiontune: wrote {out} ({n} rows)")
    return 0


def cmd_sample_data(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.sample_data import clear_folder, make_sample_data

    clear_folder(args.dir, args.force)
    info = make_sample_data(args.dir, per_class=args.per_class, seed=args.seed)
    print(
        f"visiontune: wrote a SYNTHETIC data set to {args.dir}: {info['train']} labelled images "
        f"({', '.join(info['classes'])}) in train/, {info['test']} in test/"
    )
    return 0


def cmd_models(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.models import model_names

    names = model_names(args.source, args.filter)
    if not names:
        raise UserError(f"no {args.source} model name contains {args.filter!r}")
    print("\n".join(names))
    return 0


def cmd_check(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.data.check import scan, write_report
    from visiontune.data.layouts import discover

    images = discover(args.data)
    print(images.describe())
    folder = args.data if os.path.isdir(args.data) else os.path.dirname(os.path.abspath(args.data))
    report = args.report or os.path.join(folder, "bad_files.csv")
    if not os.access(os.path.dirname(os.path.abspath(report)) or ".", os.W_OK):
        raise UserError(f"cannot write the report to {report}; pass --report PATH")
    # Layout rejects (Thumbs.db in a Kaggle folder, ...) first, then every file that does not decode.
    bad = list(images.rejects) + scan(images.paths, workers=args.workers)
    write_report(bad, report)
    for path, problem in bad:
        print(f"{path}: {problem}")
    print(f"visiontune: {len(bad)} bad of {len(images.paths) + len(images.rejects)} files; report in {report}")
    return 1 if bad else 0


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune import launch
    from visiontune.bench import bench
    from visiontune.data.layouts import discover

    cfg = config_from_args(args)
    discover(cfg.data)
    # Each strategy re-runs `visiontune train` with these flags; bench's own are
    # dropped and the per-strategy ones are appended (argparse: the last wins).
    train_argv = launch.without_flags(argv, ("--strategies", "--same", "--output-dir", "--repeats"))
    if "epochs" not in vars(args):
        train_argv += ["--epochs", "1"]
        cfg = cfg.replace(epochs=1)
    out = cfg.output_dir or launch.default_output_dir().replace("runs", "runs/bench", 1)
    bench(
        cfg,
        train_argv,
        [s.strip() for s in args.strategies.split(",") if s.strip()],
        cfg.nproc or launch.default_nproc(),
        args.same,
        out,
        args.repeats,
    )
    return 0


def _inference(args: argparse.Namespace):
    """The model (``--run RUN_DIR`` or ``--weights FILE``, self-describing or with ``--model NAME --classes
    a,b``) and how to run it."""
    from visiontune.inference import InferenceConfig, load_model

    weights = getattr(args, "weights", None)
    if weights is None and not args.run:
        raise UserError("give --run RUN_DIR (a training run folder), or --weights FILE")
    if weights and args.run:
        raise UserError("give --run RUN_DIR or --weights FILE, not both")
    classes = [c.strip() for c in args.classes.split(",")] if getattr(args, "classes", None) else None
    loaded = load_model(
        args.run,
        weights,
        model=getattr(args, "model", None),
        classes=classes,
        image_size=getattr(args, "image_size", None),
    )
    return loaded, InferenceConfig(args.batch_size or loaded.batch_size, args.mixed_precision, args.progress)


def _in_processes(args: argparse.Namespace, argv: list[str], command: str, skipped, run) -> int:
    """``run()`` here, or with ``--nproc N`` > 1 in N processes; exit 1 when ``skipped()`` files were unreadable.

    Under a launcher a worker exits 0 with skips (exit 1 would read as a crashed worker); the
    launching process reads ``skipped()`` from the output the workers wrote and reports it.
    """
    from visiontune import launch
    from visiontune.launch import inside_launcher

    cfg = TrainConfig(data="-", strategy="ddp", nproc=args.nproc)
    if launch.needs_launcher(cfg, command):
        code = launch.relaunch(cfg, argv, command)
        return 1 if code == 0 and skipped() else code
    run()
    return 1 if not inside_launcher() and skipped() else 0


def cmd_predict(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.predict import check_clip, list_inputs, predict, skipped_path
    from visiontune.runlock import writable_file

    loaded, icfg = _inference(args)
    inputs = list_inputs(args.data)
    check_clip(args.clip)
    writable_file(args.out, "--out")  # before the forward pass, not after it
    return _in_processes(
        args,
        argv,
        "predict",
        skipped_path(args.out).exists,
        lambda: predict(loaded, icfg, inputs, args.out, clip=args.clip, tta_mode=args.tta),
    )


def cmd_evaluate(args: argparse.Namespace, argv: list[str]) -> int:
    import json
    from pathlib import Path

    from visiontune.evaluate import evaluate

    loaded, icfg = _inference(args)
    out = args.out or str(Path(args.run) / "eval.json")
    return _in_processes(
        args,
        argv,
        "evaluate",
        lambda: json.loads(Path(out).read_text())["skipped"],
        lambda: evaluate(
            loaded, icfg, args.data, out, run_dir=args.run, split=args.split, tta_mode=args.tta, top_n=args.top_losses
        ),
    )


def cmd_export(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.export import SUFFIX, check_format, export
    from visiontune.inference import load_model

    check_format(args.format)
    loaded = load_model(args.run)
    info = loaded.info
    out = args.out or f"{args.run.rstrip('/')}/best{SUFFIX[args.format]}"
    diff = export(loaded.model, info, args.format, out)
    s = info.image_size
    print(
        f"visiontune: wrote {out}: input float32 [N, 3, {s}, {s}] RGB scaled to [0, 1] then normalised "
        f"with mean {info.mean} std {info.std}; output [N, {len(info.classes)}] logits for "
        f"{', '.join(info.classes)}; checked against the eager model, max difference {diff:.1e}; "
        f"the file carries this description under the metadata key 'visiontune'"
    )
    return 0


def cmd_slurm(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune import launch

    cfg = config_from_args(args)  # the train flags must make a valid run before a job is queued
    own = tuple(flag for flag, _, _ in slurm.FLAGS) + ("--output-dir", "--strategy")
    script = slurm.batch_script(
        launch.without_flags(argv, own),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        job_name=args.job_name,
        output_dir=cfg.output_dir,
    )
    slurm.write(script, args.out)
    return 0


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.report import write

    print(f"visiontune: wrote {write(args.run)}")
    return 0


def _add_inference_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=positive, help="images per batch PER PROCESS (default: the run's)")
    p.add_argument("--mixed-precision", choices=choices()["mixed_precision"], default="no")
    p.add_argument("--nproc", type=positive, default=1, help="processes (DDP-style sharding; same output)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    p.add_argument(
        "--tta",
        choices=("none", "flip", "flip+crop"),
        default="none",
        help="test-time augmentation: average the probabilities of mirrored (and centre-cropped) views",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="visiontune",
        description="Fine-tune torchvision and timm image classifiers on a folder of images, on one CPU or many GPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="fine-tune a torchvision, timm or Hugging Face Hub classifier")
    add_train_flags(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("lr-find", help="a short exponential lr sweep: loss-vs-lr PNG and a suggested lr")
    add_train_flags(p)
    p.add_argument("--steps", type=positive, default=100, help="batches in the sweep (default 100)")
    p.add_argument("--start-lr", type=float, default=1e-7, help="first lr (default 1e-7)")
    p.add_argument("--end-lr", type=float, default=10.0, help="last lr (default 10)")
    p.set_defaults(func=cmd_lr_find)
    p = sub.add_parser("prepare", help="write DATA/train.csv from the Kaggle layout")
    p.add_argument("data")
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("sample-data", help="write a small synthetic data set in the Kaggle layout")
    p.add_argument("dir")
    p.add_argument("--per-class", type=positive, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace the data set in a folder that is not empty")
    p.set_defaults(func=cmd_sample_data)
    p = sub.add_parser("models", help="list the model names --model accepts (Hub models: hf-hub:ORG/NAME)")
    p.add_argument("--source", choices=("torchvision", "timm", "all"), default="torchvision")
    p.add_argument("--filter", default="", help="only names containing this text (any case)")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("check", help="decode every image of a data set and report the bad ones")
    p.add_argument("data")
    p.add_argument("--report", help="CSV report path (default DATA/bad_files.csv)")
    p.add_argument("--workers", type=positive, default=available_cores(), help="decoding threads (default: cores)")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="train once per strategy and compare time and accuracy fairly")
    add_train_flags(p)
    p.add_argument("--strategies", default="single,dp,ddp", help="comma-separated (default single,dp,ddp)")
    p.add_argument(
        "--same",
        default="global",
        choices=("global", "per-device"),
        help="keep the global batch (default) or the per-device batch equal across strategies",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="train each strategy N times, interleaved; report the median run and the spread",
    )
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("slurm", help="write a Slurm batch script for `visiontune train` (requeued on preemption)")
    add_train_flags(p)
    for flag, kind, help_text in slurm.FLAGS:
        p.add_argument(
            flag,
            type=kind,
            required=help_text.startswith("required"),
            default="visiontune" if flag == "--job-name" else None,
            help=help_text,
        )
    p.set_defaults(func=cmd_slurm)
    p = sub.add_parser("predict", help="predict images with a trained model (Kaggle test/ -> submission)")
    p.add_argument("--run", help="a training run folder")
    p.add_argument(
        "--weights",
        help="instead of --run: a visiontune .safetensors file (it says what it is), "
        "or a .pth/.safetensors state_dict with --model and --classes",
    )
    p.add_argument("--model", help="with --weights: the model name (checked against the file's own)")
    p.add_argument("--classes", help="with --weights: class names in training order, comma-separated")
    p.add_argument(
        "--image-size",
        type=int,
        help="with --weights: input size (default: the file's, else the model's pretrained size)",
    )
    p.add_argument("--data", required=True, help="a folder of images, Kaggle's test/, or a file listing paths")
    p.add_argument("--out", required=True, help="CSV to write (unreadable files go to OUT.skipped.txt)")
    p.add_argument("--clip", type=float, default=0.0, help="clamp probabilities to [EPS, 1-EPS] (log loss)")
    _add_inference_flags(p)
    p.set_defaults(func=cmd_predict)
    p = sub.add_parser("evaluate", help="accuracy, F1, calibration, confusion matrix, top losses on labelled data")
    p.add_argument("--run", required=True, help="a training run folder")
    p.add_argument("--data", required=True, help="labelled data in any layout train accepts")
    p.add_argument("--out", help="JSON report (default RUN/eval.json; the figures and top_losses.csv go beside it)")
    p.add_argument(
        "--split",
        choices=("val", "train", "all"),
        help="with the run's own data: which images to score (default val); other data is scored whole",
    )
    p.add_argument("--top-losses", type=int, default=16, help="misclassified images in top_losses.png/.csv")
    _add_inference_flags(p)
    p.set_defaults(func=cmd_evaluate)
    p = sub.add_parser("export", help="export a run's best model to ONNX or a torch.export .pt2 archive")
    p.add_argument("--run", required=True, help="a training run folder")
    p.add_argument("--format", required=True, help="onnx or pt2 (torch.export; TorchScript's successor)")
    p.add_argument("--out", help="file to write (default RUN/best.onnx or RUN/best.pt2)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("report", help="rebuild RUN/report.html, one self-contained page about the run")
    p.add_argument("run", help="a training run folder (or a bench folder)")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from visiontune import launch

    launch.die_with_launcher()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        code = args.func(args, argv[1:])  # the subcommand's own arguments, for relaunching under torchrun
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:  # `visiontune models | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell tool killed by the signal
    except UserError as e:
        print(f"visiontune: error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:  # a signal or a non-finite loss: the checkpoint is written, say where
        if launch.rank() == 0:  # every worker stops alike; one line is enough
            print(f"visiontune: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
