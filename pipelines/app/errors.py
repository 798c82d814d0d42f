"""The one line a visitor sees when a job fails because of what they gave it.

``pipelines.errors.classify`` decides, as for the command: a user-caused error (bad image, missing
weights, empty structure, a policy or config that cannot work, not enough memory, a full disk, ...) is
shown as its one line, which already says what went wrong and what to do. Anything else is a bug or an
environment failure: the page says so in one line and the traceback goes to the log.
"""
from __future__ import annotations

import logging

from ..errors import classify, one_line

logger = logging.getLogger(__name__)


def error_line(err: BaseException) -> str:
    """The classifier's line for a user-caused error; for anything else a line naming it as unexpected
    (its traceback is logged)."""
    failure = classify(err, started=True)
    if failure is not None:
        return failure.message
    logger.error("job failed unexpectedly", exc_info=err)
    return f"unexpected error ({type(err).__name__}: {one_line(err)}); the server log has the traceback"
