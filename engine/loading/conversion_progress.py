"""What a GGUF conversion shows while it runs: its current stage and the tensors dequantized so far."""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

logger = logging.getLogger(__name__)

_BAR_FORMAT = "{desc}: {n_fmt}/{total_fmt} tensors [{elapsed}]{postfix}"
_REPORTED_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


class ConversionProgress:
    """On a terminal, one tqdm line: the stage, the tensors dequantized, the time spent. It shows no rate or
    ETA: most of a conversion goes to stages with nothing to count (reading the file's metadata, converting
    its tokenizer), so a rate measured on the tensors would promise a wrong end. Elsewhere (a log file, a
    pipe), where a bar's carriage returns would make one endless line, an INFO line per stage and per
    quarter of the tensors instead."""

    def __init__(self, name: str):
        self._name = name
        self._bar = None
        self._started = 0.0
        self._done = 0
        self._total: Optional[int] = None
        self._fractions = list(_REPORTED_FRACTIONS)

    def __enter__(self) -> "ConversionProgress":
        self._started = time.monotonic()
        stream = sys.stderr
        if stream is not None and stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=None, desc=f"pagedserve: converting {self._name}", bar_format=_BAR_FORMAT, file=stream
            )
        self.stage("reading the GGUF metadata")
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if self._bar is not None:
            if error_type is None:
                self._bar.set_postfix_str("done", refresh=False)
            self._bar.close()
        if error_type is None:
            logger.info("converted %s in %.0f s", self._name, time.monotonic() - self._started)

    def stage(self, text: str) -> None:
        """The conversion moved on to `text` (a lower-case phrase: "writing the weights")."""
        if self._bar is not None:
            self._bar.set_postfix_str(text)
        else:
            logger.info("converting %s: %s", self._name, text)

    def start_tensors(self, total: int) -> None:
        """`total` tensors are about to be dequantized, one `tensor_done` each."""
        self._total, self._done = total, 0
        if self._bar is not None:
            self._bar.total = total
        self.stage(f"dequantizing {total} tensors")

    def tensor_done(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update()
            return
        if self._total and self._fractions and self._done >= self._fractions[0] * self._total:
            while self._fractions and self._done >= self._fractions[0] * self._total:
                self._fractions.pop(0)
            logger.info("converting %s: %d/%d tensors dequantized", self._name, self._done, self._total)
