"""torchvision imported without ``torch._dynamo``, which torch imports when something first needs it.

``import torchvision`` spends about a second of its two (on this project's 2-core machine) importing
``torch._dynamo``, for two names: ``torchvision.ops.roi_align`` imports ``is_compile_supported`` (called
only inside ``roi_align``), and ``torchvision.tv_tensors`` decorates ``wrap`` with ``torch.compiler.disable``.
A command that never compiles, exports or builds an optimizer (predict, evaluate, show) never needs
dynamo, and a training run needs it first when its optimizer is built (torch wraps
``Optimizer.add_param_group`` in dynamo's ``disable``): by then the trainer can import it while a forked child
builds the image cache (``training.optim.warm_up``). PyTorch's own view is the same: importing dynamo has side
effects an eager-mode user should not pay for, which is why torchvision compiles ``roi_align`` lazily.

``defer_dynamo`` (the ``visiontune`` command calls it at its start; a program that imports visiontune keeps
its own imports as they are) puts a finder first on ``sys.meta_path`` that runs those two modules' code with
stand-ins for the two names in ``sys.modules``, removed as soon as the module has run. Each stand-in imports
the real dynamo when it is first called and then does exactly what the real one does: ``disable`` wraps the
function in dynamo's ``disable`` on its first call. Only the torchvision releases this was checked against
(``TESTED``) are imported so: another one is imported as it comes, so that a torchvision that needs more of
dynamo at its import is never given a stand-in.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import re
import sys
import types
from contextlib import contextmanager

TESTED = ("0.29.",)  # torchvision releases whose import needs only the two names below of torch._dynamo
_MODULES = ("torchvision.ops.roi_align", "torchvision.tv_tensors")  # the modules that import them
_DYNAMO, _UTILS = "torch._dynamo", "torch._dynamo.utils"


def defer_dynamo() -> None:
    """Have this process import torchvision without ``torch._dynamo`` (once; nothing when it is imported
    already, or torchvision is not a release in ``TESTED``)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path) or _DYNAMO in sys.modules or "torchvision" in sys.modules:
        return
    sys.meta_path.insert(0, _Finder())


def _tested_release() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.origin:
        return False
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), encoding="utf-8") as f:
            found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", f.read(4096), re.M)
    except OSError:
        return False
    return found is not None and found.group(1).startswith(TESTED)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the modules of ``_MODULES`` as the finders after it do, their loader wrapped in ``_Loader``."""

    def __init__(self) -> None:
        self.tested: bool | None = None  # whether torchvision is a TESTED release: read at its first import

    def find_spec(self, name, path, target=None):
        if name not in _MODULES or (_DYNAMO in sys.modules and not _standing_in()):
            return None
        if self.tested is None:
            self.tested = _tested_release()
        if not self.tested:
            return None
        after = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else sys.meta_path
        for finder in after:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader, its code run with the stand-ins in place."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module's own from here on
        with _stand_ins():
            self.loader.exec_module(module)


def _standing_in() -> bool:
    return getattr(sys.modules.get(_DYNAMO), "_visiontune_stand_in", False)


@contextmanager
def _stand_ins():
    if _DYNAMO in sys.modules:  # the real one (nothing to spare), or a stand-in already (a nested import)
        yield
        return
    dynamo, utils = types.ModuleType(_DYNAMO), types.ModuleType(_UTILS)
    dynamo._visiontune_stand_in = True
    dynamo.disable, dynamo.utils, utils.is_compile_supported = _disable, utils, _is_compile_supported
    sys.modules[_DYNAMO], sys.modules[_UTILS] = dynamo, utils
    try:
        yield
    finally:
        for name, module in ((_UTILS, utils), (_DYNAMO, dynamo)):
            if sys.modules.get(name) is module:
                del sys.modules[name]
        torch = sys.modules.get("torch")
        if torch is not None and vars(torch).get("_dynamo") is dynamo:
            del torch._dynamo


def _real_dynamo():
    import torch._dynamo
    import torch._dynamo.utils  # noqa: F401

    return torch._dynamo


def _is_compile_supported(device_type):
    return _real_dynamo().utils.is_compile_supported(device_type)


def _disable(fn=None, recursive=True, *, reason=None):
    """``torch._dynamo.disable``, applied on the function's first call."""
    if fn is None:  # used as ``@disable(recursive=...)``
        return functools.partial(_disable, recursive=recursive, reason=reason)
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = _real_dynamo().disable(fn, recursive, reason=reason)
        return disabled(*args, **kwargs)

    return call
