"""The executor: the one loop over items × stages that every run goes through (a single input is a batch of one).
An *item* is one input of a run (an image, say) with the state the stages build for it; a *span* is a stretch
of work measured as one (an item, in item order; the whole batch, in stage order).

- ``by_item(items)``: each item through every stage, then the next. ``items`` may be any iterable, read as
  the run goes: a job queue or a claim on a shared list can feed it.
- ``by_stage(items)``: every item through stage 1, then every item through stage 2, ... so each model is
  loaded once for all of them; states wait in the store between stages.
- ``drive(items, order)``: the one place the order is chosen (``stage`` for several items, else ``by_item``).
- ``run(state)``: one state the caller built through every stage (an item whose source is its state).

What the executor is given:

- ``start(item, k)`` (optional): a fresh state for ``item`` that is to run from stage ``k`` (its provided
  fields); without it an item's ``source`` is its state;
- ``open(item)`` (optional): check the item before any of its stages (an unusable input raises here);
- ``finish(item)`` (optional): what a finished item becomes (``item.result``); called once the item's span
  has closed in item order, inside the batch's span in stage order;
- a ``Store``: where an item's state waits between stages, and what is recorded of each stage. The base
  class keeps every state in memory and records nothing; a store may record every stage as it finishes
  (``resume`` then says how many leading stages need not run again), and hold in memory only what fits,
  keeping the rest itself until ``restore``;
- ``hooks``: ``Hook`` objects told of the session, each span, each stage an item starts, the stages it has
  done and its failure: progress bars and callbacks, memory meter windows, a parallel leader's framing.
  A hook stops the run by raising from ``before`` (cancellation);
- ``isolate(item, error)`` (optional): True when an error concerns that item alone; the item is then yielded
  failed (``item.error``, ``item.failed_at``) and the run goes on. Any other error stops the run.

Every item is yielded once, finished or failed, as soon as it is.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .runner import Stage, StageRecord, StageRunner


@dataclass
class Item:
    """One input of a run and how far it got.

    done:      leading stages finished (run, or taken from the store)
    resumed:   the names of those the store already had (``Store.resume``)
    at:        the stage it is in (None between stages); a failed item keeps it (``failed_at``)
    notes:     lines about it (a stale record and why)
    result:    what ``finish`` made of it
    """

    index: int
    name: str
    source: Any
    label: str = ""
    state: Any = None
    records: list[StageRecord] = field(default_factory=list)
    done: int = 0
    resumed: tuple[str, ...] = ()
    at: str | None = None
    notes: list[str] = field(default_factory=list)
    error: BaseException | None = None
    result: Any = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def failed_at(self) -> str | None:
        """The stage whose run raised ``error`` (None: before any stage)."""
        return self.at if self.error is not None else None


class Store:
    """Where states wait between stages: here, every state stays in memory and nothing is recorded."""

    def resume(self, item: Item) -> int:
        """How many leading stages of ``item`` are recorded already (their outputs can be restored)."""
        return 0

    def saved(self, item: Item, k: int) -> None:
        """Stage ``k`` of ``item`` has run (``item.state`` holds its outputs, ``item.records[k]`` its record)."""

    def between(self, item: Item, k: int) -> bool:
        """After stage ``k``, before the item's next: True to keep ``item.state`` in memory, False when the store
        now keeps it (the executor lets it go and asks ``restore`` for it later)."""
        return True

    def restore(self, item: Item, k: int, state: Any) -> None:
        """Fill ``state`` (fresh from ``start``) with what stages ``0 .. k-1`` left; add their records to
        ``item.records`` when it has none of them (a resumed item)."""
        raise RuntimeError(f"{type(self).__name__} keeps every state in memory; it has none for {item.name}")

    def forget(self, item: Item) -> None:
        """``item`` is finished or failed: its state no longer waits here."""

    def close(self) -> None:
        """The run is over: remove what only this run needed."""


class Hook:
    """Something told how a run goes; every method is optional."""

    def session(self, items: Sequence[Item] | None) -> contextlib.AbstractContextManager[None]:
        """Around the whole run (``items`` is None when they come from an iterator)."""
        return contextlib.nullcontext()

    def span(self, items: Sequence[Item]) -> contextlib.AbstractContextManager[None]:
        """Around one span: an item's stages (item order) or the batch's (stage order)."""
        return contextlib.nullcontext()

    def before(self, item: Item, k: int) -> None:
        """``item`` starts stage ``k``; raising here stops the run."""

    def advanced(self, item: Item, stages: int) -> None:
        """``stages`` more of the item's stages are accounted for (run, resumed, or given up with it)."""

    def failed(self, item: Item, error: BaseException) -> None:
        """``item`` failed with ``error`` (isolated or not: told before the run decides)."""


class Executor:
    """Runs items through ``runner``'s stages; see the module docstring."""

    def __init__(self, runner: StageRunner, start: Callable[[Item, int], Any] | None = None, *,
                 store: Store | None = None, hooks: Sequence[Hook] = (),
                 open: Callable[[Item], None] | None = None,  # noqa: A002 - the item's "open" step
                 finish: Callable[[Item], Any] | None = None,
                 isolate: Callable[[Item, BaseException], bool] | None = None):
        self.runner = runner
        self.stages: tuple[Stage, ...] = runner.stages
        self.start = start if start is not None else lambda item, k: item.source
        self.store = store if store is not None else Store()
        self.hooks = tuple(hooks)
        self._open_item = open
        self._finish_item = finish
        self._isolate = isolate

    # -- the two orders ----------------------------------------------------------------------------
    def by_item(self, items: Iterable[Item]) -> Iterator[Item]:
        """Each item through every stage, then the next; yields each as it finishes or fails."""
        with self._session(items):
            for item in items:
                if self._open(item) and item.done < len(self.stages):
                    try:
                        with self._all("span", [item]):
                            for k in range(item.done, len(self.stages)):
                                self._step(item, k)
                    except BaseException as err:
                        self._fail(item, err)
                if item.ok:
                    self._finish(item)
                yield item

    def by_stage(self, items: Sequence[Item]) -> Iterator[Item]:
        """Every item through each stage in turn; yields each as it finishes or fails."""
        items = list(items)
        with self._session(items):
            for item in items:
                if not self._open(item) or item.done == len(self.stages):
                    if item.ok:
                        self._finish(item)
                    yield item
            with self._all("span", items):
                for k in range(len(self.stages)):
                    for item in items:
                        if not item.ok or item.done != k:
                            continue
                        try:
                            self._step(item, k)
                        except BaseException as err:
                            self._fail(item, err)
                            yield item
                            continue
                        if k == len(self.stages) - 1:
                            self._finish(item)
                            yield item
                        elif not self.store.between(item, k):
                            item.state = None

    def drive(self, items: Iterable[Item], order: str) -> Iterator[Item]:
        """``items`` in ``order``, the one place the choice is made: ``stage`` runs several items ``by_stage``
        (one item runs the same either way, so ``by_item``); any other order (``item``, a pipeline's ``image``)
        runs ``by_item``, reading ``items`` as the run goes (they may come from an iterator)."""
        if order == "stage":
            items = list(items)
            if len(items) > 1:
                return self.by_stage(items)
        return self.by_item(items)

    def run(self, state: Any, name: str = "run") -> list[StageRecord]:
        """``state`` through every stage (an executor built without ``start``); one record per stage."""
        [item] = self.by_item([Item(0, name, state)])
        return item.records

    # -- one item, one stage -----------------------------------------------------------------------
    def _open(self, item: Item) -> bool:
        """Check the item and find where it resumes; False when it failed (an isolated error)."""
        try:
            if self._open_item is not None:
                self._open_item(item)
            item.done = self.store.resume(item)
            item.resumed = tuple(stage.name for stage in self.stages[:item.done])
        except BaseException as err:
            self._fail(item, err)
            return False
        self._advanced(item, item.done)
        return True

    def _step(self, item: Item, k: int) -> None:
        stage = self.stages[k]
        item.at = stage.name
        for hook in self.hooks:
            hook.before(item, k)
        if item.state is None:
            item.state = self._state(item, k)
        item.records.append(self.runner.run_stage(stage, item.state))
        item.done, item.at = k + 1, None
        self.store.saved(item, k)
        self._advanced(item, 1)

    def _state(self, item: Item, k: int) -> Any:
        """The item's state before stage ``k``: fresh, with the store's outputs of earlier stages."""
        state = self.start(item, k)
        if k > 0:
            self.store.restore(item, k, state)
        return state

    def _finish(self, item: Item) -> None:
        if item.state is None:
            item.state = self._state(item, len(self.stages))
        if self._finish_item is not None:
            item.result, item.state = self._finish_item(item), None  # the result owns the state now
        self.store.forget(item)

    def _fail(self, item: Item, err: BaseException) -> None:
        """Tell the hooks; keep going only when ``isolate`` says the error is the item's alone."""
        item.error, item.state = err, None
        self.store.forget(item)
        for hook in self.hooks:
            hook.failed(item, err)
        if not isinstance(err, Exception) or self._isolate is None or not self._isolate(item, err):
            raise err
        self._advanced(item, len(self.stages) - item.done)

    def _advanced(self, item: Item, stages: int) -> None:
        if stages:
            for hook in self.hooks:
                hook.advanced(item, stages)

    # -- contexts ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _session(self, items: Iterable[Item]) -> Iterator[None]:
        """Every hook's session around the run, then the store closed."""
        with contextlib.closing(self.store), self._all("session", items if isinstance(items, Sequence) else None):
            yield

    @contextlib.contextmanager
    def _all(self, context: str, items: Sequence[Item] | None) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(getattr(hook, context)(items))
            yield
