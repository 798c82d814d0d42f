"""The one line a visitor sees when a job fails because of what they gave it.

The library's user-caused errors (bad image, missing weights, empty structure, a policy or config that
cannot work, not enough memory, stages that do not fit together) already say what went wrong and what
to do; the page shows their text on one line. Anything else is a bug or an environment failure: the
page says so in one line and the traceback goes to the log. This is the one place to swap in a
central classifier of user errors.
"""
from __future__ import annotations

import logging

from pixal3d.config import ConfigError
from pixal3d.hub import WeightsError
from pixal3d.models.loading import CheckpointError
from pixal3d.models.preprocess import ImageError
from pixal3d.staging import PolicyError, StageGraphError

from ..pipeline import NotEnoughMemoryError
from ..structure import EmptyStructureError

logger = logging.getLogger(__name__)

USER_ERRORS = (ImageError, WeightsError, CheckpointError, EmptyStructureError, PolicyError, NotEnoughMemoryError,
               ConfigError, StageGraphError)


def error_line(err: BaseException) -> str:
    """``str(err)`` on one line for a user-caused error; for anything else a line naming it as unexpected
    (its traceback is logged)."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, USER_ERRORS):
        return text
    logger.error("job failed unexpectedly", exc_info=err)
    return f"unexpected error ({type(err).__name__}: {text}); the server log has the traceback"
