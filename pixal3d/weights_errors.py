"""What can be wrong with the weights a config names. Below ``hub`` (which finds and fetches them) and
``tiny_weights`` (which generates the demo's), so that neither imports the other for its errors."""
from __future__ import annotations


class WeightsError(RuntimeError):
    """Base class: the weights a config names cannot be used."""


class MissingWeightsError(WeightsError):
    """Files a run needs are not on disk (and could not be downloaded)."""


class CorruptWeightsError(WeightsError):
    """A weights file exists but is truncated, corrupt or a git-lfs pointer."""


class HubUnreachableError(WeightsError):
    """The Hub (or a weights server) could not be reached at all: no network, a refused or unroutable endpoint."""


class HubAnswerError(WeightsError):
    """The Hub answered a request for a file with an error (404, 401, 500, ...)."""
