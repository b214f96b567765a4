"""The shim's logging plumbing: the access log's batched writer, JSON lines, ``serve``'s config.

:class:`BatchedLineHandler` writes the access log's lines (rendered by
:mod:`~llm_backoff_shim.serve.observe.access_log`) in order, in batches, from a background thread;
:func:`logging_config` routes them to stdout and everything else to stderr.
"""

from __future__ import annotations

import collections
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Literal, TextIO

LogFormat = Literal["plain", "json"]

#: The access log's logger (its lines go to stdout as rendered).
LOGGER_NAME = "llm_backoff_shim.access"

#: A line queued to be rendered with its batch: ``render(record, end, now)``.
_Later = tuple[Callable[[Any, float, float], str], Any, float, float]


class BatchedLineHandler(logging.Handler):
    """Each record's message as one line of ``stream``, written in batches by a background thread.

    A line waits at most ``interval`` seconds; lines keep their order; :meth:`flush` (which
    :func:`logging.shutdown` calls at exit) writes whatever is left from the calling thread.
    One ``write`` and ``flush`` per batch instead of per line. If the stream stops taking
    lines (a full pipe), the writer blocks and, past ``max_pending`` lines, so do the callers:
    memory stays bounded, as with a plain stream handler. No formatter is applied: the message
    is written as it is. :meth:`write_later` queues a line to be rendered with its batch.
    """

    def __init__(
        self, stream: TextIO | None = None, interval: float = 0.05, max_pending: int = 100_000
    ) -> None:
        super().__init__()
        self.stream = stream if stream is not None else sys.stdout
        self.interval = interval
        self.max_pending = max_pending
        self._lines: collections.deque[str | _Later] = collections.deque()
        self._wake = threading.Event()
        self._armed = False
        self._write_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write_line(record.getMessage())
        except Exception:  # pragma: no cover - logging's own error report
            self.handleError(record)

    def write_line(self, line: str) -> None:
        """Queue ``line`` (no newline) for the next batch."""
        self._queue(line)

    def write_later(
        self,
        render: Callable[[Any, float, float], str],
        record: Any,
        end: float,
        now: float,
    ) -> None:
        """Queue the line ``render(record, end, now)`` for the next batch, rendered when it is written."""
        self._queue((render, record, end, now))

    def _queue(self, item: str | _Later) -> None:
        lines = self._lines
        lines.append(item)
        if self._closed or len(lines) > self.max_pending:
            self.flush()
        elif not self._armed:
            self._armed = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="access-log-writer", daemon=True)
                self._thread.start()
            self._wake.set()

    def flush(self) -> None:
        with self._write_lock:
            lines = self._lines
            if not lines:
                return
            batch: list[str] = []
            lost = 0
            while lines:
                item = lines.popleft()
                if isinstance(item, str):
                    batch.append(item)
                    continue
                render, record, end, now = item
                try:
                    batch.append(render(record, end, now))
                except Exception:  # pragma: no cover - a record the renderer cannot take
                    lost += 1
            batch.append("")
            if lost:  # pragma: no cover
                sys.stderr.write(f"access log: {lost} lines could not be rendered\n")
            try:
                self.stream.write("\n".join(batch))
                self.stream.flush()
            except Exception:  # pragma: no cover - a closed or broken stream
                sys.stderr.write(f"access log: {len(batch) - 1} lines could not be written\n")

    def close(self) -> None:
        self._closed = True
        self.flush()
        self._wake.set()
        super().close()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            time.sleep(self.interval)  # let a batch gather
            self._armed = False
            self.flush()


class JsonFormatter(logging.Formatter):
    """The shim's other log lines (and uvicorn's) as JSON objects, under ``--log-format json``."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=True)


def logging_config(log_format: LogFormat, level: str = "info") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for ``serve`` (given to uvicorn as ``log_config``).

    Access lines go to stdout exactly as rendered; everything else (the shim's
    warnings, uvicorn's start-up and errors) to stderr, as JSON objects under
    ``json``. uvicorn's own access log is left off: the shim's line replaces it.
    """
    plain = {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "default": {"()": f"{__name__}.JsonFormatter"} if log_format == "json" else plain,
        },
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "stream": "ext://sys.stderr",
            },
            "access": {"()": f"{__name__}.BatchedLineHandler", "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
            "llm_backoff_shim": {"handlers": ["default"], "level": level, "propagate": False},
            LOGGER_NAME: {"handlers": ["access"], "level": level, "propagate": False},
        },
    }
