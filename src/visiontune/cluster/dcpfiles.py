"""Reading a sharded checkpoint (``torch.distributed.checkpoint``'s folder) without unpickling what it holds.

DCP's own reader ``pickle.load``s the folder's ``.metadata`` and its default planner loads every non-tensor
item with ``torch.load(weights_only=False)``: a checkpoint folder from someone else (or one altered after it
was written) would run code. Here ``.metadata`` is read by an unpickler that builds only DCP's metadata
classes and the few torch values they hold (sizes, dtypes, layouts), its contents are checked against the
schema DCP writes (``check``), and the items are loaded with ``weights_only=True``; anything else is a
``UserError`` naming the folder. ``load`` is the one way visiontune reads such a folder.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
from typing import Any

from visiontune.errors import UserError

METADATA = ".metadata"
MAX_METADATA_BYTES = 64 << 20  # an index of chunks: a few MB for a ViT-L on 8 processes
MAX_DIMS = 64  # a tensor's dimensions (a torch.Size in the index is built from at most this many numbers)
_MD = "torch.distributed.checkpoint.metadata"
# The classes an index is made of: each built empty (NEWOBJ) and given its fields (BUILD), never called.
_OBJECTS = {
    (_MD, "Metadata"),
    (_MD, "TensorStorageMetadata"),
    (_MD, "BytesStorageMetadata"),
    (_MD, "ChunkStorageMetadata"),
    (_MD, "TensorProperties"),
    (_MD, "MetadataIndex"),
    (_MD, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
_MAX_FIELDS = 16  # what one BUILD may set: a dataclass's fields (at most 5 in DCP's)
_MAX_NAME = 4096  # characters of a path the index names (StorageMeta.checkpoint_id)
_MAX_PARTS = 64  # the arguments of one call: a path's parts (each call's work is bounded by it)
_DATA_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.distcp")  # a file beside .metadata, never a path


def _size(dims=()):
    """``torch.Size`` as the index holds it, from a short list of numbers (a shared list referenced many
    times must not be copied into millions of sizes)."""
    import torch

    dims = tuple(dims[: MAX_DIMS + 1]) if isinstance(dims, (tuple, list)) else ()
    if len(dims) > MAX_DIMS or not all(type(d) is int and 0 <= d < 1 << 62 for d in dims):
        raise ValueError("a tensor size that is not a short list of counts")
    return torch.Size(dims)


def _layout(name):
    from torch.serialization import _get_layout

    if type(name) is not str or len(name) > 100:
        raise ValueError("a layout that is not a name")
    return _get_layout(name)


def _memory_format(code):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    if type(code) is not int:
        raise ValueError("a memory format that is not a code")
    return _MEM_FORMAT_ENCODING(code)


@functools.cache
def _object_classes() -> tuple:
    import importlib

    return tuple(getattr(importlib.import_module(m), n) for m, n in sorted(_OBJECTS))


def _path(*parts):
    """Where the checkpoint was written (unused on load): its parts, at most a path's length together."""
    from pathlib import PurePosixPath

    if len(parts) > _MAX_PARTS or not all(type(p) is str for p in parts) or sum(map(len, parts)) > _MAX_NAME:
        raise ValueError("a path that is not a few names")
    return PurePosixPath(*parts)


class _Unpickler(pickle._Unpickler):
    """Builds DCP's index: its classes (made empty, then given their fields), ``torch.Size``, dtypes, layouts
    and the memory-format code, through short checked calls; any other global, or any other call, is refused.

    The pure-Python unpickler, not the C one: the C unpickler's memo is an array sized by the largest index a
    file names, so nine bytes (``PUT`` at index 2**31) ask for 16 GB; this one's memo is a dict. With every
    call bounded and no constructor run, what it builds is at most a constant times the file's size."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        import torch

        calls = {
            ("torch", "Size"): _size,
            ("torch.serialization", "_get_layout"): _layout,
            ("pathlib", "PosixPath"): _path,
            ("pathlib", "PurePosixPath"): _path,
            (_MD, "_MEM_FORMAT_ENCODING"): _memory_format,
        }
        if (module, name) in calls:
            return calls[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _OBJECTS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"names {module}.{name}, which is not part of a checkpoint's index")

    def load_reduce(self) -> None:
        args, func = self.stack[-1], self.stack[-2]
        if func not in (_size, _layout, _path, _memory_format) or type(args) is not tuple or len(args) > _MAX_PARTS:
            raise pickle.UnpicklingError(f"calls {getattr(func, '__name__', type(func).__name__)}, which it may not")
        super().load_reduce()

    def load_newobj(self) -> None:
        if self.stack[-2] not in _object_classes() or self.stack[-1] != ():
            raise pickle.UnpicklingError("makes an object of a class that is not part of a checkpoint's index")
        super().load_newobj()

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) not in _object_classes() or type(state) not in (dict, tuple) or len(state) > _MAX_FIELDS:
            raise pickle.UnpicklingError("sets fields it may not")
        super().load_build()

    def _instantiate(self, klass, args) -> None:  # INST and OBJ: a class called with arguments
        raise pickle.UnpicklingError("calls a class, which it may not")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = lambda self: self._refuse_newobj_ex()
    dispatch[pickle.BUILD[0]] = load_build

    def _refuse_newobj_ex(self) -> None:
        raise pickle.UnpicklingError("makes an object with keyword arguments, which it may not")


def _fail(folder: str, why: str) -> UserError:
    return UserError(
        f"cannot load checkpoint {folder}: its {METADATA} {why}; the folder was altered or damaged "
        "(resume from another checkpoint, or start over)"
    )


def read_metadata(folder: str):
    """The checked index of the sharded checkpoint in ``folder``, or a ``UserError``."""
    path = os.path.join(folder, METADATA)
    try:
        size = os.path.getsize(path)
        if size > MAX_METADATA_BYTES:
            raise _fail(folder, f"has {size} bytes, more than the {MAX_METADATA_BYTES} an index may have")
        with open(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)  # read whole: a length in the pickle can ask for no more
        metadata = _Unpickler(io.BytesIO(data)).load()
    except UserError:
        raise
    except OSError as e:
        raise _fail(folder, f"cannot be read ({e.strerror or e.__class__.__name__})") from None
    except Exception as e:  # noqa: BLE001  (any malformed pickle: the refusal above, truncation, bad arguments)
        why = str(e).splitlines()[0][:200] if isinstance(e, pickle.UnpicklingError) and str(e) else ""
        raise _fail(folder, why or f"is not a checkpoint index ({e.__class__.__name__})") from None
    try:
        check(metadata, folder)
    except ValueError as e:
        raise _fail(folder, str(e)) from None
    except (AttributeError, TypeError) as e:  # a pickle may build DCP's classes without their fields
        raise _fail(folder, f"is not a checkpoint index ({e.__class__.__name__})") from None
    return metadata


def check(metadata, folder: str) -> None:
    """ValueError unless ``metadata`` is the index DCP writes: tensors and plain items by name, each stored
    chunk inside a ``.distcp`` file of ``folder`` and inside its tensor, no stream transforms."""
    import torch
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    def size(value, what: str) -> tuple[int, ...]:
        ok = type(value) is torch.Size and len(value) <= MAX_DIMS
        need(ok and all(type(d) is int and d >= 0 for d in value), what)
        return tuple(value)

    need(type(metadata) is md.Metadata, "is not a checkpoint index")
    need(metadata.version is None or type(metadata.version) is str, "has a version that is not text")
    need(metadata.storage_meta is None or type(metadata.storage_meta) is md.StorageMeta, "has bad storage notes")
    items = metadata.state_dict_metadata
    need(type(items) is dict and all(type(k) is str for k in items), "has no table of items by name")
    for name, item in items.items():
        if type(item) is md.BytesStorageMetadata:
            continue
        need(type(item) is md.TensorStorageMetadata, f"describes {name[:80]!r} as neither a tensor nor a value")
        props = item.properties
        need(type(props) is md.TensorProperties and isinstance(props.dtype, torch.dtype), f"{name[:80]!r}: no dtype")
        shape = size(item.size, f"{name[:80]!r}: a bad size")
        need(type(item.chunks) is list, f"{name[:80]!r}: no list of chunks")
        for chunk in item.chunks:
            need(type(chunk) is md.ChunkStorageMetadata, f"{name[:80]!r}: a chunk that is not one")
            at, n = size(chunk.offsets, f"{name[:80]!r}: bad chunk"), size(chunk.sizes, f"{name[:80]!r}: bad chunk")
            need(len(at) == len(n) == len(shape), f"{name[:80]!r}: a chunk of other dimensions than its tensor")
            need(all(a + b <= s for a, b, s in zip(at, n, shape)), f"{name[:80]!r}: a chunk outside its tensor")
    planned = metadata.planner_data
    need(
        planned is None
        or (type(planned) is dict and all(type(k) is str and type(v) is tuple for k, v in planned.items())),
        "has a bad table of names",
    )
    need(planned is None or all(type(p) in (str, int) for v in planned.values() for p in v), "has a bad table of names")
    stored = metadata.storage_data
    need(type(stored) is dict, "has no table of stored chunks")
    sizes: dict[str, int] = {}
    for key, where in stored.items():
        need(type(key) is md.MetadataIndex and type(key.fqn) is str, "has a stored chunk without a name")
        need(key.offset is None or type(key.offset) is torch.Size, "has a stored chunk with a bad offset")
        need(type(where) is _StorageInfo, "has a stored chunk without a place")
        rel = where.relative_path
        need(type(rel) is str and _DATA_FILE.fullmatch(rel) is not None, "names a data file outside its folder")
        need(not where.transform_descriptors, "asks for stream transforms, which visiontune does not write")
        need(type(where.offset) is int and type(where.length) is int, "has a chunk without a place in its file")
        if rel not in sizes:
            full = os.path.join(folder, rel)
            need(os.path.isfile(full), f"names {rel}, which is not in the folder")
            sizes[rel] = os.path.getsize(full)
        need(0 <= where.offset and 0 <= where.length <= sizes[rel] - where.offset, f"{rel}: a bad range")


def _plain_reader(folder: str, metadata):
    """DCP's file reader, handed the checked index instead of unpickling one."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(folder)


def _planner():
    """DCP's default load planner, loading each plain (non-tensor) item with ``weights_only=True`` and only
    where the state being restored holds a plain value too."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            if isinstance(self.state_dict.get(fqn), torch.Tensor):
                raise ValueError(f"{fqn} is stored as a plain value where the run has a tensor")
            loaded = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return Planner()


def load(state: dict, folder: str) -> None:
    """``torch.distributed.checkpoint.load(state, folder)`` (in place, resharded to this world), with its
    index checked and nothing unpickled; a folder that is not a checkpoint DCP wrote is a ``UserError``,
    one that does not fit ``state`` a ``ValueError``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    metadata = read_metadata(folder)  # every process reads the same file, so all refuse it or none does
    try:
        dcp.load(state, storage_reader=_plain_reader(folder, metadata), planner=_planner())
    except CheckpointException as e:  # a BaseException: the first process's failure, as an error
        first = next(iter(e.failures.values()), None)
        raise ValueError(str(first[0] if isinstance(first, tuple) else first or e).splitlines()[0]) from None
