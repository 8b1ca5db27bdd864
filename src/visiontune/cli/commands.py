"""The ``visiontune`` command line: one function per subcommand, each called with ``(args, argv)``.

This module and ``flags`` (every subcommand's flags, the training ones made
from ``TrainConfig``) are the only ones that see argparse. A ``UserError`` from
anywhere below, argparse's own complaints included, becomes one line on stderr
and exit code 2; ``argv`` is the subcommand's own arguments, for relaunching
under torch.distributed.run.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
import threading
import traceback
from typing import NoReturn

from visiontune import imports
from visiontune.cli import flags
from visiontune.cli.flags import config_from_args
from visiontune.cluster import host, sbatch
from visiontune.cluster.signals import RunStopped
from visiontune.errors import UserError
from visiontune.text import shown
from visiontune.tuning import TRIAL_ENV


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.training import job

    cfg = config_from_args(args)
    on_epoch = None
    if TRIAL_ENV in os.environ:  # a trial of `visiontune tune` run as a job of its own: it reports to the study
        from visiontune.tuning import trialjob

        trialjob.die_with_tuner()
        on_epoch = trialjob.on_epoch_from_env()
    return job.run(cfg, argv, on_epoch).code


def cmd_lr_find(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.training.lrfind import lr_find

    cfg = config_from_args(args)
    found = lr_find(cfg, start=args.start_lr, end=args.end_lr, steps=args.steps)
    print(f"visiontune: suggested lr {found['suggested_lr']:.2g} (loss against lr: {found['dir']}/lr_find.png)")
    return 0


def _data_given(args: argparse.Namespace, command: str) -> None:
    """``visiontune COMMAND DATA`` or ``--data DATA``: one of them, or both the same, into ``args.data``."""
    if args.images_from and "data" in vars(args) and args.data != args.images_from:
        raise UserError("give the data once: DATA or --data DATA")
    if args.images_from:
        args.data = args.images_from
    if not getattr(args, "data", None):
        raise UserError(f"give the data to {command}: visiontune {command} DATA")


def cmd_show(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.runs.runlock import writable_file
    from visiontune.training.show import show

    _data_given(args, "show")
    cfg = config_from_args(args)
    writable_file(args.out, "--out")
    print(show(cfg, args.out, args.count))
    return 0


def cmd_audit(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.audit.audit import audit

    _data_given(args, "audit")
    if args.folds < 2:
        raise UserError(f"--folds must be 2 or more, got {args.folds}")
    audit(config_from_args(args), args.out, args.test, args.similarity, resume=args.resume_audit == "auto")
    return 0


def cmd_prepare(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.data.layouts import write_kaggle_manifest

    out, n = write_kaggle_manifest(args.data)
    print(f"visiontune: wrote {out} ({n} rows)")
    return 0


def cmd_sample_data(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.data.sample import clear_folder, make_multilabel_data, make_regression_data, make_sample_data

    if args.multi_label and args.regress:
        raise UserError("--multi-label and --regress each write a data set of their own: pass one of them")
    clear_folder(args.dir, args.force)
    if args.regress:
        info = make_regression_data(args.dir, count=args.per_class, seed=args.seed)
        print(
            f"visiontune: wrote a SYNTHETIC regression data set to {args.dir}: {len(info['values'])} images in "
            "train/ with train.csv (filename,value: the bright square's side over the image's); train it with "
            "--task regress"
        )
        return 0
    if args.multi_label:
        info = make_multilabel_data(args.dir, count=4 * args.per_class, seed=args.seed)
        print(
            f"visiontune: wrote a SYNTHETIC multi-label data set to {args.dir}: {len(info['labels'])} images in "
            f"train/ with train.csv (filename,labels); classes {', '.join(info['classes'])}"
        )
        return 0
    info = make_sample_data(args.dir, per_class=args.per_class, seed=args.seed)
    print(
        f"visiontune: wrote a SYNTHETIC data set to {args.dir}: {info['train']} labelled images "
        f"({', '.join(info['classes'])}) in train/, {info['test']} in test/"
    )
    return 0


def cmd_models(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.cluster.host import user_cache_dir
    from visiontune.models.names import model_names, with_parameters  # no torch: the names are cached per version

    names = model_names(args.source, args.filter, user_cache_dir(), pretrained=args.pretrained)
    if not names:
        kind = " pretrained" if args.pretrained else ""
        raise UserError(f"no{kind} {args.source} model name contains {args.filter!r}")
    print("\n".join(with_parameters(names, user_cache_dir()) if args.pretrained else names))
    return 0


def cmd_check(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.data.check import check_folder
    from visiontune.tasks import AUTO

    return check_folder(args.data, args.report, args.workers, (args.image_column, args.label_column), task=AUTO)


def cmd_shard(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.data.shardwriter import write
    from visiontune.tasks import AUTO

    columns = (args.image_column, args.label_column)
    write(
        args.data, args.out, args.shard_size, seed=args.seed, val_fraction=args.val_fraction, columns=columns, task=AUTO
    )
    return 0


def cmd_bench(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.cluster import jobplan, launch
    from visiontune.data.sources import discover
    from visiontune.reports.bench import bench, train_flags
    from visiontune.tasks import reader

    cfg = config_from_args(args)
    discover(cfg.data, cfg.image_column, cfg.label_column, task=reader(cfg.task))
    # Each strategy re-runs `visiontune train` with these flags.
    cfg, train_argv = train_flags(cfg, argv, "epochs" in vars(args))
    out = cfg.output_dir or launch.default_output_dir().replace("runs", "runs/bench", 1)
    bench(
        cfg,
        train_argv,
        [s.strip() for s in args.strategies.split(",") if s.strip()],
        cfg.nproc or jobplan.default_nproc(),
        args.same,
        out,
        args.repeats,
    )
    return 0


def _inference(args: argparse.Namespace, model_of_run: bool = True):
    """The model of ``--run`` or ``--weights`` (``--model``/``--classes`` for a bare file) and how to run it.
    ``model_of_run`` False (evaluate): ``--weights`` is scored on the data of ``--run``, whose classes it must have."""
    from visiontune.inference.loaded import InferenceConfig, load_model

    classes = [c.strip() for c in args.classes.split(",")] if getattr(args, "classes", None) else None
    weights = getattr(args, "weights", None)
    if weights and not model_of_run:
        from visiontune.runs import runrecords

        classes = list(runrecords.read_run(args.run).classes)
    loaded = load_model(
        args.run if model_of_run or not weights else None,
        weights,
        model=getattr(args, "model", None),
        classes=classes,
        image_size=getattr(args, "image_size", None),
    )
    if getattr(args, "threshold", None) is not None:
        loaded = _one_threshold(loaded, args.threshold)
    icfg = InferenceConfig(
        args.batch_size or loaded.batch_size, args.mixed_precision, args.progress, decode=getattr(args, "decode", None)
    )
    return loaded, icfg


def _one_threshold(loaded, threshold: float):
    """``--threshold``: a multi-label model with that threshold for every class."""
    import dataclasses

    if not loaded.info.task.thresholded:  # its decision is not one made at per-class thresholds
        raise UserError("--threshold is for multi-label models; this one picks the most probable class")
    if not 0.0 < threshold < 1.0:
        raise UserError(f"--threshold must be a probability between 0 and 1, got {threshold}")
    info = loaded.info.with_thresholds([threshold] * len(loaded.classes))
    return dataclasses.replace(loaded, info=info, thresholds_from=f"--threshold {threshold:g}")


def cmd_predict(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.cluster import launch
    from visiontune.inference.predict import check_clip, list_many, predict, skipped_path
    from visiontune.runs.runlock import writable_file

    if bool(args.images) == bool(args.data):
        raise UserError("give the images to predict: IMAGE... or --data FOLDER|LIST (one of them)")
    loaded, icfg = _inference(args)
    inputs = list_many(args.images or [args.data], (args.image_column, args.label_column))
    check_clip(args.clip)
    if args.out is not None:
        writable_file(args.out, "--out")  # before the forward pass, not after it
    unreadable: list[int] = []  # without --out, how many were skipped (said on stderr; exit 1 as with a file)
    return launch.here_or_relaunched(
        args.nproc,
        argv,
        "predict",
        skipped_path(args.out).exists if args.out is not None else lambda: sum(unreadable),
        lambda: unreadable.append(predict(loaded, icfg, inputs, args.out, clip=args.clip, tta_mode=args.tta)),
    )


def cmd_evaluate(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.cluster import launch
    from visiontune.inference.evaluate import default_out, evaluate, recorded_data
    from visiontune.runs import evalrecords

    data, columns = args.data, (args.image_column, args.label_column)
    if not data:  # the run's own data, listed as training listed it (hf: columns included unless given)
        data, recorded = recorded_data(args.run)
        columns = (columns[0] or recorded[0], columns[1] or recorded[1])
    loaded, icfg = _inference(args, model_of_run=False)
    out = args.out or default_out(args.run, getattr(args, "weights", None))
    return launch.here_or_relaunched(
        args.nproc,
        argv,
        "evaluate",
        lambda: evalrecords.read_skipped(out),  # the workers' eval.json, read back checked
        lambda: evaluate(
            loaded,
            icfg,
            data,
            out,
            run_dir=args.run,
            split=args.split,
            tta_mode=args.tta,
            top_n=args.top_losses,
            columns=columns,
        ),
    )


def _check_export_flags(args: argparse.Namespace) -> None:
    """The flag combinations export refuses, said before anything is imported or loaded."""
    fmt = args.format
    if args.with_preprocessing and fmt != "onnx":
        # hub: timm's own transforms feed the folder; openvino, pt2: the resized, normalised batch
        raise UserError(f"--with-preprocessing is for --format onnx: --format {fmt} takes the normalised batch")
    if args.int8 and fmt not in ("onnx", "openvino"):
        raise UserError(f"--int8 is for --format onnx or openvino, not {fmt}")
    if args.int8 and args.with_preprocessing:
        raise UserError(
            "--int8 quantizes the network alone, which takes the resized, normalised batch: drop "
            "--with-preprocessing, or export fp32 with it"
        )
    if args.probabilities and (args.int8 or fmt not in ("onnx", "pt2")):
        what = "--int8" if args.int8 else f"--format {fmt}"
        raise UserError(f"--probabilities is for fp32 --format onnx or pt2; {what} gives logits: drop it")


def cmd_export(args: argparse.Namespace, argv: list[str]) -> int:
    _check_export_flags(args)
    from visiontune.inference.export import SUFFIX, check_format, check_preprocessing, described, export
    from visiontune.inference.loaded import load_model

    if args.format == "hub":
        return _export_hub(args)
    if args.format == "openvino":
        return _export_openvino(args)
    check_format(args.format)
    if args.int8:
        return _export_int8(args)
    if args.with_preprocessing:  # the run's own resize decides, from its config.json: before the model loads
        from visiontune.runs import runrecords

        check_preprocessing(runrecords.read_run(args.run), args.format)
    loaded = load_model(args.run)
    out = args.out or f"{args.run.rstrip('/')}/best{SUFFIX[args.format]}"
    diff = export(loaded.model, loaded.info, args.format, out, args.with_preprocessing, args.probabilities)
    print(described(out, loaded.info, diff, args.with_preprocessing, args.probabilities))
    return 0


def _export_hub(args: argparse.Namespace) -> int:
    from visiontune.inference import hub
    from visiontune.inference.loaded import load_model

    loaded = load_model(args.run)
    out = args.out or f"{args.run.rstrip('/')}/hub"
    print(hub.described(out, loaded.info, hub.export_hub(loaded, args.run, out)))
    return 0


def _export_int8(args: argparse.Namespace) -> int:
    from visiontune.inference import quantize
    from visiontune.inference.loaded import load_model

    quantize.check_options(args.max_accuracy_drop, args.calibration_images)
    loaded = load_model(args.run)
    out = args.out or f"{args.run.rstrip('/')}/best.int8.onnx"
    record = quantize.export_int8(loaded, args.run, out, args.max_accuracy_drop, args.calibration_images)
    print(quantize.described(out, record))
    return 0


def _export_openvino(args: argparse.Namespace) -> int:
    from visiontune.inference import openvino_ir, quantize
    from visiontune.inference.loaded import load_model

    quantize.check_options(args.max_accuracy_drop, args.calibration_images)
    openvino_ir.require_openvino()
    loaded = load_model(args.run)
    out = args.out or f"{args.run.rstrip('/')}/best{'.int8' if args.int8 else ''}.xml"
    record = openvino_ir.export_openvino(
        loaded, args.run, out, args.int8, args.max_accuracy_drop, args.calibration_images
    )
    print(openvino_ir.described(out, record))
    return 0


def cmd_push(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.inference import hub

    url = hub.push(args.run, args.repo, args.private, args.revision)
    print(f"visiontune: pushed {args.run} to {args.repo}: {url}")
    return 0


def cmd_serve(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.cluster.launch import threads_choice
    from visiontune.inference.serve import ServeOptions, serve

    if args.max_wait_ms < 0 or args.max_body_mb <= 0:
        raise UserError("--max-wait-ms must be >= 0 and --max-body-mb > 0")
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    # The cores the decoding processes leave, over the workers, cut to those the machine's load leaves free, as
    # train, evaluate and predict choose theirs: on 2 cores with 2 decoders (1 thread a worker) the server
    # answered 0.96-1.15x the requests of 2 threads, quiet and beside 1 and 2 busy processes, over three runs
    # (benchmarks/contention.py). The decoders, one thread each, are busy whenever the model is.
    threads, threads_from = threads_choice(args.threads, args.workers, reserved=max(0, args.decoders))
    return serve(
        ServeOptions(
            run=args.run,
            weights=args.weights,
            model=args.model,
            classes=[c.strip() for c in args.classes.split(",")] if args.classes else None,
            image_size=args.image_size,
            compile=args.compile,
            threads=threads,
            threads_from=threads_from,
            host=args.host,
            port=args.port,
            max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms,
            workers=args.workers,
            max_body_mb=args.max_body_mb,
            max_connections=args.max_connections,
            access_log=args.access_log,
            decoders=args.decoders,
            max_request_pixels=args.max_request_pixels,
            max_pixels_in_flight=args.max_pixels_in_flight,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
        )
    )


def cmd_slurm(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.cluster import launch

    cfg = config_from_args(args)  # the train flags must make a valid run before a job is queued
    own = tuple(flag for flag, _, _ in sbatch.FLAGS) + ("--output-dir", "--strategy")
    script = sbatch.batch_script(
        launch.without_flags(argv, own),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        job_name=args.job_name,
        output_dir=cfg.output_dir,
        strategy=cfg.strategy,
    )
    sbatch.write(script, args.out)
    return 0


def cmd_tune(args: argparse.Namespace, argv: list[str]) -> int:
    from dataclasses import fields

    from visiontune.settings.config import TrainConfig
    from visiontune.settings.validation import load_config_file

    models = None
    if "," in getattr(args, "model", ""):  # --model a,b,c: the model is one of the searched settings
        models = [m.strip() for m in args.model.split(",") if m.strip()]
        args.model = models[0]
    names = {f.name for f in fields(TrainConfig)}
    fixed = {k for k in vars(args) if k in names} | (set(load_config_file(args.config)) if args.config else set())
    if models:
        fixed.discard("model")
    cfg = config_from_args(args)
    if args.slurm_script:
        return _tune_job(args, argv, cfg)
    from visiontune.tuning.tune import TuneOptions, duration, tune

    opts = TuneOptions(
        trials=args.trials,
        out=args.out,
        storage=args.storage,
        study_name=args.study,
        space_file=args.space,
        parallel=args.parallel,
        timeout=None if args.tune_timeout is None else duration(args.tune_timeout),
        sampler=args.search,
        pruner=args.pruner,
        heartbeat=args.heartbeat,
    )
    return tune(cfg, fixed, opts, argv, models)


def _tune_job(args: argparse.Namespace, argv: list[str], cfg) -> int:
    from visiontune.cluster import launch

    needed = (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node), ("--time", args.time))
    missing = [flag for flag, value in needed if value is None]
    if missing:
        raise UserError(f"--slurm-script needs {', '.join(missing)}")
    # A trial that is a job of several processes takes one GPU for each (on a CPU node, shares of its cores).
    trial_processes = 1
    if launch.needs_launcher(cfg, "tune"):
        trial_processes = cfg.nproc or max(1, args.gpus_per_node)
    # The script gives each tuner --storage and --parallel itself.
    own = ("--slurm-script", *(flag for flag, _, _ in sbatch.FLAGS if flag != "--out"), "--parallel", "--storage")
    script = sbatch.tune_script(
        launch.without_flags(argv, own),
        storage=args.storage,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        job_name=args.job_name,
        trial_processes=trial_processes,
    )
    sbatch.write(script, args.slurm_script)
    return 0


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.reports.report import write

    print(f"visiontune: wrote {write(args.run)}")
    return 0


def cmd_compare(args: argparse.Namespace, argv: list[str]) -> int:
    from visiontune.reports.compare import compare

    print(f"visiontune: wrote {compare(args.runs, args.out)}")
    return 0


# "cmd_sample_data" runs `visiontune sample-data`, and so on.
COMMANDS = {name[4:].replace("_", "-"): f for name, f in list(globals().items()) if name.startswith("cmd_")}


def build_parser() -> argparse.ArgumentParser:
    return flags.build_parser(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    from visiontune.cluster import launch

    launch.die_with_launcher()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        host.check_environment(trains=args.command in ("train", "lr-find", "bench", "tune", "audit"))
        from visiontune.data import remote

        # --allow-pipe: this command line's own data may be a command that is run; nothing else may be.
        remote.allow_command(args.data if getattr(args, "allow_pipe", False) and getattr(args, "data", None) else None)
        code = args.func(args, argv[1:])  # the subcommand's own arguments, for relaunching under torchrun
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:  # `visiontune models | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell tool killed by the signal
    except UserError as e:
        print(f"visiontune: error: {shown(e)}", file=sys.stderr)  # one line, whatever a file or store put in it
        launch.leave_process_group()
        return 2
    except RunStopped as e:  # a signal or a non-finite loss: the checkpoint is written, say where
        if launch.rank() == 0:  # every worker stops alike; one line is enough
            print(f"visiontune: {shown(e)}", file=sys.stderr)
        launch.leave_process_group()
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        if not launch.peer_gone(e):
            return _a_bug()
        # The process that failed said why, in one line; its peers' tracebacks would bury that line.
        print(
            f"visiontune: rank {launch.rank()} stopped: another process of the job ended (its message is above)",
            file=sys.stderr,
        )
        launch.leave_process_group()
        launch.outlast_peer()
        return 1
    except Exception:
        return _a_bug()


def _a_bug() -> int:
    """An exception nothing expected, called where it is handled: its traceback is what a report needs. A
    worker forked by torchrun prints it and exits 1: raised, it would reach only torch's error file, and
    the job's "its output is above" would point at nothing."""
    from visiontune.cluster import launch

    if not launch.forked_worker():
        raise  # noqa: PLE0704 (re-raises the exception being handled)
    traceback.print_exc()
    return 1


def entry() -> int:
    """The ``visiontune`` command and ``python -m visiontune``: ``main``, then a quick exit."""
    # File names that are not UTF-8 print as the bytes they have on disk, as `ls` prints them (a UTF-8
    # locale's stdout would otherwise refuse them, with a traceback, halfway through `check`'s list).
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="surrogateescape")
    from visiontune.cluster import launch

    launch.started_by_command_line()
    code = main()
    # The interpreter's exit runs garbage collections over every object the imports made (340,000 with torch
    # and torchvision): about 0.6 CPU s a process, for each worker of a job. Frozen, they are skipped;
    # everything is still closed and flushed as before.
    gc.freeze()
    return code


def command() -> None:
    """The ``visiontune`` console script and ``python -m visiontune``: ``entry``, then ``leave``."""
    imports.defer_dynamo()  # a second of every command's start-up that imports torchvision (visiontune.imports)
    code = entry()
    from visiontune.cluster import launch

    if launch.forked_worker():  # run by its agent as a function: it must return (see __main__)
        if code:
            sys.exit(code)
        return
    leave(code)


def leave(code: int) -> NoReturn:
    """End the command's process as the interpreter's exit would, less its teardown.

    What an exit promises is kept, in the interpreter's order: the threads that are not daemons are
    joined (``threading._shutdown``, which first stops idle thread pools), the ``atexit`` handlers run
    (multiprocessing's, logging's, ``weakref.finalize``'s), and the standard streams are flushed. What is
    left out is the teardown of every module and object, torch's C++ state included: 0.2 s of every
    command's wall time on this project's 2-core machine even with the objects frozen (0.7-1 s when they
    are not, as in a plain script's exit). Every file visiontune writes is closed where it is written.
    """
    shutdown = getattr(threading, "_shutdown", None)  # CPython's own first step of an exit
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that is gone, a stream already closed: nothing left to say
            pass
    os._exit(code)
