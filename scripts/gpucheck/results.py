"""Reading and writing the parts' JSON files (no torch: the parent process imports this alone)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def write_json(path: Path, data: Any) -> None:
    """Atomically: a part killed mid-write leaves its last complete file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
