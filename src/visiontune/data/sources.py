"""The data sources ``--data`` may name, and the one place that tells them apart.

Each source module declares its ``Source`` (``data/imageset.py``): how it is
recognised from the ``--data`` string, read into an ``ImageSet``, its reader reopened
in a worker, and described. ``SOURCES`` lists them in the order they are tried, the
folder layouts last (any path the others do not claim). Train, predict, evaluate, the
run records, the listing handed to workers and the help text ask this module, never
which kind of data they hold; a new source is one module declaring its ``SOURCE``
and one line here.
"""

from __future__ import annotations

import os

from visiontune.data import hfdata, layouts, shards, stores
from visiontune.data.imageset import ImageSet, LabelReader, Reader, Source
from visiontune.errors import UserError

# Object stores first (told by their scheme alone), hf: before the URLs (hf:// is both; hfdata claims it
# unless it names .tar shards), URLs before the local checks (which look at the file system), folders last.
SOURCES: tuple[Source, ...] = (stores.SOURCE, hfdata.SOURCE, shards.URL_SOURCE, shards.SOURCE, layouts.SOURCE)


def find(data: str) -> Source:
    """The source ``data`` names (the folder layouts when no other recognises it)."""
    return next(s for s in SOURCES if s.recognises(data))


def named(data: str) -> Source | None:
    """The source when ``data`` is a name rather than a path (``hf:...``, a URL); told from the string alone."""
    return next((s for s in SOURCES if s.named and s.recognises(data)), None)


def discover(
    data: str,
    image_column: str | None = None,
    label_column: str | None = None,
    *,
    every_split: bool = False,
    task: LabelReader,
) -> ImageSet:
    """List ``data``'s labelled images, from whichever source it names.

    ``image_column``/``label_column`` pick an ``hf:`` data set's columns when its features do not;
    ``every_split`` lists its test rows too, for predict. ``task`` reads the label cells the source lists
    (``imageset.LabelReader``: ``visiontune.tasks.reader(--task)``; ``auto`` reads them as class names, or as
    label sets where they say so themselves).
    """
    source = find(data)
    found = source.read(data, image_column, label_column, every_split=every_split, task=task)
    return _checked(found, data, every_split and source.lists_unlabelled)


def _checked(found: ImageSet, data: str, unlabelled_ok: bool = False) -> ImageSet:
    if not found.paths:
        raise UserError(f"no labelled images found in {data}")
    if not found.classes and not unlabelled_ok:  # a multi-label manifest whose label cells are all empty
        raise UserError(f"{data}: no image has a label; a classifier needs at least two classes")
    least = 2 if found.reading is None else found.reading.min_classes  # a regression's one target is enough
    if len(found.classes) < least and not unlabelled_ok:
        raise UserError(f"{data}: found only one class ({found.classes[0]}); a classifier needs at least two")
    return found


def reopen(spec: dict | None) -> Reader | None:
    """The reader a ``spec()`` describes, opened in this process (None for files)."""
    if spec is None:
        return None
    return next(s for s in SOURCES if s.name == spec["kind"] and s.reopen).reopen(spec)


def exists(data: str) -> bool:
    """Whether what ``data`` names is still there (a name or a pattern: checked when it is read)."""
    return find(data).exists(data)


def recorded(data: str) -> str:
    """How the run records name ``data``: a name as given, a path made absolute (evaluate finds the run's
    own data by it from any working folder)."""
    return data if named(data) else os.path.abspath(os.path.expanduser(data))


def hub_id(data: str) -> str | None:
    """The data set's id on the Hugging Face Hub, when ``data`` names one."""
    source = named(data)
    return source.hub_id(data) if source and source.hub_id else None


def help_text(short: bool = False) -> str:
    """What ``--data`` accepts, in the words each source gives (the folders first, as one thinks of them)."""
    told = [s.short if short else s.help for s in reversed(SOURCES) if (s.short if short else s.help)]
    if short:
        return f"{', '.join(told[:-1])} or {told[-1]}"
    return f"{', '.join(told[:-1])}, or {told[-1]}"
