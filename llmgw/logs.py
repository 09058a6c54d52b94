"""What llmgw's log says at INFO: one line per thing that happened, routine traffic below it.

An operator reads the INFO log to learn what changed (a node joined, a
replica became ready or failed and why, someone drained a node). Libraries
log their routine work at INFO too: Celery every periodic task it sends,
receives and finishes, httpx every request (the gateway reads each engine's
/metrics every second), the development server every request (an agent's
lease every few seconds). Those lines buried the few that mattered, so
`Routine` passes them on at DEBUG: `LOG_LEVEL=DEBUG` shows them again, and
their warnings and errors are untouched.
"""

from __future__ import annotations

import functools
import logging

from django.db import transaction


class Routine(logging.Filter):
    """A logger filter that demotes INFO records to DEBUG, shown only when the root logger shows DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite an INFO record as DEBUG; keep it only if DEBUG is shown. Other levels pass as they are."""
        if record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def after_commit(logger: logging.Logger, msg: str, *args: object) -> None:
    """Log msg at INFO once the current transaction commits (at once outside one).

    A change rolled back never happened: its line must not be in the log.
    """
    transaction.on_commit(functools.partial(logger.info, msg, *args))
