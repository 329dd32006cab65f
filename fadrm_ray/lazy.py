"""Attributes of a package loaded on first use (a module `__getattr__`), so importing the package
stays cheap: `import fadrm_ray` loads neither torch nor anything else heavy until a name of its
public API is asked for. This module imports nothing beyond the standard library's core (not even
`typing`), for the same reason."""
from __future__ import annotations

import importlib
import sys


def lazy_attributes(package: str, exports: dict[str, str]) -> tuple:
    """The `__getattr__` and `__dir__` of `package`, whose public names are the keys of `exports`
    (name -> the module that defines it). A name is imported on first use and kept on the package.
    No name may be a submodule's: importing that submodule would replace it."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
