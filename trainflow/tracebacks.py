"""Which lines of a node's output are a Python traceback: the task log shows them at ERROR.

The node agent's output (its own, torch elastic's and every worker's) streams into the
node task's log line by line. A worker's traceback there at INFO level is easy to miss; at
ERROR it is what Airflow's log view highlights and what log alerts match.
"""

from __future__ import annotations

import logging
import re

# An optional prefix a launcher puts before a worker's line ("[rank1]: ", "[default0]:").
_PREFIX = re.compile(r"^(\[[^\]]{1,40}\]:?\s?)?")
_START = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class TracebackLevels:
    """Feed lines in order; ``level(line)`` is ``logging.ERROR`` for the lines of a
    traceback (from its header to the exception line that ends it), else ``logging.INFO``."""

    def __init__(self) -> None:
        self._inside = False

    def level(self, line: str) -> int:
        body = _PREFIX.sub("", line, count=1)
        if body.startswith(_START) or body.startswith(_CHAINED):
            self._inside = True
            return logging.ERROR
        if not self._inside:
            return logging.INFO
        if not body.strip() or body[:1].isspace() or body.startswith("^"):
            return logging.ERROR  # frames, source lines, carets
        self._inside = False  # the exception line ends the traceback
        return logging.ERROR
