"""How the package imports. Its front doors in one style (:func:`exports`): the public names,
each imported from the module that defines it on first use (PEP 562), so that importing the
package loads nothing heavy (``from replug_jax.models import DEFAULT_LM`` loads no JAX). And
optional dependencies (:func:`require`): a feature that needs an extra says which one to
install."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """A feature's optional dependency is not installed; the message names the extra."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the ``extra`` to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(
            f"{feature} needs the '{extra}' extra (module {module!r} is not installed): "
            f"pip install 'replug-jax[{extra}]'") from err


def exports(package: str, where: dict[str, str]):
    """``(__getattr__, __dir__, __all__)`` for ``package``: ``where`` maps each public name
    to the submodule that defines it."""
    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        globals_of_package = importlib.import_module(package).__dict__
        globals_of_package[name] = value  # later lookups skip __getattr__
        return value

    names = sorted(where)
    return __getattr__, (lambda: names), names
