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
