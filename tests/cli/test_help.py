"""`--help` that tells the truth and reads well: the --recipe help is the presets' table, rendered."""

from __future__ import annotations

import pytest

from visiontune.cli.commands import build_parser
from visiontune.settings import presets


def _subparser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def _action(parser, flag: str):
    return next(a for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize("command", ["train", "lr-find", "bench", "slurm"])
def test_recipe_help_is_the_presets_table_rendered(command, monkeypatch):
    help_text = _action(_subparser(command), "--recipe").help
    assert help_text == presets.recipe_help() + " (default blog)"
    for name, table in presets.PRESETS.items():
        described = presets.describe(name)
        assert described in help_text
        for key, value in table.items():  # every setting the recipe governs is named, with its value when on
            assert key.replace("_", "-") in described
            if value not in (0, "none", None):
                assert f"--{key.replace('_', '-')} {presets._value_text(key, value)}" in described
    # The modern recipe has neither TrivialAugment nor an EMA: the help said it had both.
    assert "trivial" not in help_text.lower() and "off: augment, random-erasing, mixup, cutmix, ema)" in help_text
    # A change to the table is a change to the help: nothing else to keep in step.
    monkeypatch.setitem(presets.PRESETS, "modern", {**presets.PRESETS["modern"], "ema": 0.999, "augment": "trivial"})
    changed = _action(_subparser(command), "--recipe").help
    assert "--ema 0.999" in changed and "--augment trivial" in changed


def test_train_help_is_in_sections_that_hold_every_flag_once():
    from dataclasses import fields

    from visiontune.cli.flags import FLAG_GROUPS, NEWCOMER_FLAGS
    from visiontune.settings.config import TrainConfig

    listed = [name for names in FLAG_GROUPS.values() for name in names]
    assert sorted(listed) == sorted(f.name for f in fields(TrainConfig))  # each field in exactly one section
    parser = _subparser("train")
    sections = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert set(sections["start here"]) == set(NEWCOMER_FLAGS)  # shown first, instead of in their sections
    for title in ("data", "model", "optimisation", "augmentation", "run folder and resume", "distributed", "logging"):
        extra = {"allow_pipe"} if title == "data" else set()  # a command-line flag, not a TrainConfig field
        assert set(sections[title]) == set(FLAG_GROUPS[title]) - set(NEWCOMER_FLAGS) | extra, title
    text = parser.format_help()
    assert text.splitlines()[0] == (
        "usage: visiontune train --data DATA [--model NAME] [--recipe {blog,modern}] [--epochs N] [options]"
    )
    assert text.index("\ndata:\n") < text.index("--interpolation") < text.index("\noptimisation:\n")


def test_train_help_opens_with_the_newcomer_flags_and_points_to_the_sections(monkeypatch):
    from visiontune.cli.flags import FLAG_GROUPS, NEWCOMER_FLAGS

    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal: a plain 80-column one
    lines = _subparser("train").format_help().splitlines()
    first_screen = "\n".join(lines[:50])
    assert len(lines) > 200  # every flag is still there, below
    assert "\nstart here:\n" in first_screen
    for name in NEWCOMER_FLAGS:
        assert f"  --{name.replace('_', '-')} " in first_screen, name
    # The pointer names every section, and each section follows in that order.
    pointer = first_screen[first_screen.index("start here:") : first_screen.index("  --data")]
    text = "\n".join(lines)
    assert [pointer.index(title) for title in FLAG_GROUPS] == sorted(pointer.index(title) for title in FLAG_GROUPS)
    assert [text.index(f"\n{title}:\n") for title in FLAG_GROUPS] == sorted(
        text.index(f"\n{title}:\n") for title in FLAG_GROUPS
    )
    assert text.index("\nstart here:\n") < text.index("\ndata:\n")
    assert "docs/training.md" in " ".join(pointer.split())


@pytest.mark.parametrize("command", ["lr-find", "bench"])
def test_lr_find_and_bench_leave_out_the_checkpoint_and_resume_flags(command):
    parser = _subparser(command)
    text = parser.format_help()
    for flag in ("--resume", "--save-every-steps", "--keep-last", "--save-pth"):
        assert flag not in text
    assert "--output-dir" in text and "resume" not in text
    with pytest.raises(Exception, match="unrecognized arguments: --resume"):
        parser.parse_args(["--data", "d", "--resume", "auto"])
    assert "--resume" in _subparser("train").format_help() and "--keep-last" in _subparser("slurm").format_help()


def test_version_prints_the_version_and_exits_0(capsys):
    from visiontune.cli.commands import main
    from visiontune.version import __version__

    with pytest.raises(SystemExit) as stopped:  # argparse's own exit, as --help's
        main(["--version"])
    assert stopped.value.code == 0
    out = capsys.readouterr()
    assert out.out == f"visiontune {__version__}\n" and out.err == ""


def test_every_argument_of_every_subcommand_has_a_help_text():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    missing = [
        f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
        for name, parser in sub.choices.items()
        for action in parser._actions
        if not (action.help or "").strip()
    ]
    assert missing == []
    assert {a.dest for a in sub._choices_actions} == set(sub.choices)  # every subcommand has its line too
    assert all(a.help for a in sub._choices_actions)


def test_the_top_level_help_lists_every_export_format_and_each_is_one_export_takes(tmp_path, capsys):
    from visiontune.cli.commands import main
    from visiontune.inference import EXPORT_FORMATS

    top = build_parser().format_help().replace("\n", " ")
    top = " ".join(top.split())
    for what in ("ONNX", "OpenVINO IR", "torch.export .pt2", "timm Hub folder"):
        assert what in top, top
    fmt_help = _action(_subparser("export"), "--format").help
    for name, what in EXPORT_FORMATS.items():
        assert what in top and f"{name}: {what}" in fmt_help
        # Each listed format is taken: the command goes on to read the run folder (absent here).
        assert main(["export", "--run", str(tmp_path / "absent"), "--format", name]) == 2
        assert "not a visiontune run folder" in capsys.readouterr().err
    assert main(["export", "--run", str(tmp_path / "absent"), "--format", "tflite"]) == 2
    assert f"one of {', '.join(EXPORT_FORMATS)}, got 'tflite'" in capsys.readouterr().err
