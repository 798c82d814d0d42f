"""One instance for identical loads while a run lives (e.g. one DINOv3 backbone for every extractor)."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from typing import TypeVar

from torch import nn

from .release import is_released

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


class SharedInstances:
    """A per-run cache: the first load under a key builds, later loads under it get the same object.

    A cached instance that has since been released (its weights on meta) is rebuilt on the next
    request, so sharing never hands out a dead module. Keep one ``SharedInstances`` per run.
    """

    def __init__(self) -> None:
        self._instances: dict[Hashable, nn.Module] = {}
        self.builds: dict[Hashable, int] = {}

    def get(self, key: Hashable, build: Callable[[], M]) -> M:
        """The live instance stored under ``key``, building it with ``build()`` when there is none."""
        instance = self._instances.get(key)
        if instance is None or is_released(instance):
            instance = build()
            self._instances[key] = instance
            self.builds[key] = self.builds.get(key, 0) + 1
            logger.debug("built shared instance %r", key)
        return instance

    def wrap(self, build: Callable[..., M]) -> Callable[..., M]:
        """``build`` made sharing: calls with equal arguments return one instance.

        Arguments must be hashable, so that two different objects can never be mistaken for one;
        an unhashable argument is an error rather than a silent second copy.
        """

        @functools.wraps(build)
        def shared(*args, **kwargs) -> M:
            key = (build, args, tuple(sorted(kwargs.items())))
            try:
                hash(key)
            except TypeError as err:
                raise TypeError(
                    f"SharedInstances.wrap({getattr(build, '__qualname__', build)!r}) got an "
                    f"unhashable argument ({err}); pass hashable arguments (str, int, tuple, "
                    f"frozen dataclass) or call SharedInstances.get with an explicit key."
                ) from err
            return self.get(key, functools.partial(build, *args, **kwargs))

        return shared

    def __len__(self) -> int:
        return len(self._instances)

    def clear(self) -> None:
        """Forget every instance (the end of a run)."""
        self._instances.clear()
