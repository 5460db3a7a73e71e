"""Import an optional dependency for an integration module, or fail with the install line."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, package: str, integration: str) -> ModuleType:
    """Import ``module`` or raise ImportError saying which integration needs which package."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"zerokern.integrations.{integration} needs the '{package}' package, which is not "
            f"installed (pip install {package})"
        ) from exc
