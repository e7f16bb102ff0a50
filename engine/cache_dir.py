"""Where pagedserve keeps what it makes once and reuses: converted GGUF weights, built native kernels."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedserve`, else `~/.cache/pagedserve`."""
    explicit = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedserve"
