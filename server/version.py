"""The installed pagedserve's version (`pagedserve --version`, GET /version)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The installed distribution's version ("unknown" when run from a tree that was never installed)."""
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown"
