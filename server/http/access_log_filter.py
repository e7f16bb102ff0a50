"""--disable-access-log-for-endpoints: uvicorn's access log without the lines of some paths (vLLM's flag), so that
health checks and metric scrapes, a line a second each, do not bury the requests worth reading."""

from __future__ import annotations

import logging
from typing import Iterable


class QuietPaths(logging.Filter):
    """Drops uvicorn access records (client, method, path?query, http version, status) whose path is one of
    `paths`, whatever their query string."""

    def __init__(self, paths: Iterable[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in self.paths
        return True
