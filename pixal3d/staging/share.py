"""One instance for identical loads while a run lives (e.g. one DINOv3 backbone for every extractor)."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .release import is_released

logger = logging.getLogger(__name__)


def _key(build: Callable, args: tuple, kwargs: dict) -> Hashable:
    key = (build, args, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError as err:
        # Never fall back to repr(): two different objects can print the same.
        raise TypeError(
            f"cannot share {getattr(build, '__qualname__', build)!r}: an argument is unhashable "
            f"({err}); pass hashable arguments (str, int, tuple, frozen dataclass) or call "
            f"SharedInstances.get with an explicit key"
        ) from err
    return key


class SharedInstances:
    """A per-run cache: the first load under a key builds, later loads under it get the same object.

    A cached instance that has since been released (its weights on meta) is rebuilt on the next
    request, so sharing never hands out a dead module. Keep one ``SharedInstances`` per run.
    ``builds[key]`` counts how often each key was built.
    """

    def __init__(self) -> None:
        self._instances: dict[Hashable, nn.Module] = {}
        self.builds: dict[Hashable, int] = {}

    def get(self, key: Hashable, build: Callable[[], nn.Module]) -> nn.Module:
        """The live instance stored under ``key``, building it with ``build()`` when there is none."""
        instance = self._instances.get(key)
        if instance is None or is_released(instance):
            instance = build()
            self._instances[key] = instance
            self.builds[key] = self.builds.get(key, 0) + 1
            logger.debug("built shared instance %r", key)
        return instance

    def loader(self, build: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> SharedLoader:
        """A registry loader for ``build(*args, **kwargs)``; names given equal loaders share one instance.

        The registry recognises these loaders: it keeps the instance while any stage it enters
        needs one of the names, and releases it once, when none does.
        """
        return SharedLoader(self, _key(build, args, kwargs), functools.partial(build, *args, **kwargs))

    def wrap(self, build: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        """``build`` made sharing, for users outside the registry: equal arguments give one instance."""

        @functools.wraps(build)
        def shared(*args: Any, **kwargs: Any) -> nn.Module:
            return self.get(_key(build, args, kwargs), functools.partial(build, *args, **kwargs))

        return shared

    def __len__(self) -> int:
        return len(self._instances)

    def clear(self) -> None:
        """Forget every instance (the end of a run)."""
        self._instances.clear()


@dataclass(frozen=True)
class SharedLoader:
    """A zero-argument loader that returns the instance ``cache`` holds under ``key``."""

    cache: SharedInstances = field(repr=False)
    key: Hashable
    build: Callable[[], nn.Module] = field(repr=False)

    @property
    def share_key(self) -> tuple[int, Hashable]:
        """Equal for loaders that return the same instance."""
        return (id(self.cache), self.key)

    def __call__(self) -> nn.Module:
        return self.cache.get(self.key, self.build)
