"""Optional dependencies: a feature that needs an extra says which one to install."""

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
