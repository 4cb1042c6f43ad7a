"""The ServerApp's console: one progress line per round, Flower's record dumps at DEBUG.

Flower's ``Strategy.start`` (flwr/serverapp/strategy/strategy.py) logs every round's aggregated
MetricRecords, the global evaluation's and, at the end, the whole ``Result`` at INFO.
``install_console`` adds a filter to Flower's ``flwr`` logger that re-levels exactly those
records to DEBUG, matched by logger name and message format string, so our own
``[florg] round t/T | ...`` lines (flower_app/run_output/recorder.py) and Flower's other INFO
lines stay. ``log-level=debug`` (or ``FLWR_LOG_LEVEL=DEBUG``) shows them again."""

from __future__ import annotations

import logging
import re

from flwr.common.logger import FLOWER_LOGGER, update_console_handler

LOG_LEVELS = ("info", "debug")

# Format strings (LogRecord.msg) of Flower's per-round and final record dumps, after
# stripping the tree-drawing prefix ("\t└──> ").
_DUMP_FORMATS = re.compile(
    r"(?:Aggregated )?MetricRecord: %s"  # aggregated train/evaluate, global evaluation
    r"|Initial global evaluation results: %s"  # round 0
    r"|Final results:"  # the header of the Result dump
)
_PREFIX = "\t └─├│>-"
# The Result dump itself: one "\t%s" record per line of str(Result), logged by start().
_RESULT_LINE = "\t%s"


def is_record_dump(record: logging.LogRecord) -> bool:
    """Whether ``record`` is one of Flower's MetricRecord / Result dumps (see module doc)."""
    if record.name != FLOWER_LOGGER.name or record.levelno != logging.INFO:
        return False
    msg = record.msg
    if not isinstance(msg, str):
        return False
    if msg == _RESULT_LINE:
        return record.funcName == "start"
    return _DUMP_FORMATS.fullmatch(msg.lstrip(_PREFIX)) is not None


def _demote(record: logging.LogRecord) -> None:
    record.levelno = logging.DEBUG
    record.levelname = logging.getLevelName(logging.DEBUG)


class DemoteRecordDumps(logging.Filter):
    """Re-levels Flower's record dumps from INFO to DEBUG (the record is kept, so a
    handler at DEBUG, e.g. a log file, still gets it), and an empty INFO line of Flower's
    right after another one (Flower frames the dumps with them) so that what stays at INFO
    has no runs of blank lines."""

    def __init__(self) -> None:
        super().__init__()
        self._after_blank = False  # the last record left at INFO was an empty line

    def filter(self, record: logging.LogRecord) -> bool:
        if is_record_dump(record):
            _demote(record)
            return True
        blank = record.levelno == logging.INFO and record.msg == ""
        if blank and self._after_blank and record.name == FLOWER_LOGGER.name:
            _demote(record)
            return True
        if record.levelno >= logging.INFO:
            self._after_blank = blank
        return True


def _installed() -> DemoteRecordDumps | None:
    for f in FLOWER_LOGGER.filters:
        if type(f).__name__ == DemoteRecordDumps.__name__:
            return f  # type: ignore[return-value]
    return None


def install_console(log_level: str = "info") -> None:
    """Set up the ServerApp's console (idempotent): Flower's record dumps at DEBUG and,
    with ``log_level="debug"``, the console handler at DEBUG.  ``"info"`` leaves the
    handler's level as Flower set it (``FLWR_LOG_LEVEL``)."""
    if log_level not in LOG_LEVELS:
        raise ValueError(f"log-level: bad value {log_level!r} (must be one of info, debug)")
    if _installed() is None:
        FLOWER_LOGGER.addFilter(DemoteRecordDumps())
    if log_level == "debug":
        update_console_handler(level=logging.DEBUG)


def uninstall_console() -> None:
    """Remove the filter (tests)."""
    while (f := _installed()) is not None:
        FLOWER_LOGGER.removeFilter(f)
