"""Runs a function once a module is imported: at once if it already is, else right after its
import completes. dcplan registers its Lightning strategy this way, without importing Lightning
(seconds) in every process that imports dcplan."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Callable


def after_import(name: str, fn: Callable[[], None]) -> None:
    if name in sys.modules:
        _run(name, fn)
    else:
        sys.meta_path.insert(0, _Finder(name, fn))


def _run(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # the user's import of name must go on
        warnings.warn(f"dcplan: what it does after importing {name} failed: {type(e).__name__}: {e}", stacklevel=3)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds name through the other finders, and wraps its loader to call fn after the module ran."""

    def __init__(self, name: str, fn: Callable[[], None]):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and find_spec below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_run(module):
            exec_module(module)
            _run(fullname, self.fn)

        spec.loader.exec_module = exec_then_run
        return spec
