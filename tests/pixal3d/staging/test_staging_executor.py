"""The executor's contract (pixal3d/staging/executor.py) on a two-stage chain that is not Pixal3D: both orders give
every item the records of a run on its own, stage order loads each model once, a store that lets states go gets
them back and a resumed item skips its recorded stages, an isolated error fails its item alone, a hook that
raises stops the run, and items can come from an iterator as the run goes."""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from pixal3d.staging import EventLog, Executor, Hook, Item, StageRunner, Store
from tests.support.substitute_pipeline import make_loaders
from tests.support.toy_stages import Decode, Encode, State


def _runner(builds: Counter | None = None, log: EventLog | None = None) -> StageRunner:
    return StageRunner([Encode(), Decode()], make_loaders(builds), provides=("x",), state_type=State,
                       policy="staged", events=log)


def _start(item: Item, k: int) -> State:
    return State(x=torch.full((2, 16), float(item.index + 1)))


def _items(count: int = 3) -> list[Item]:
    return [Item(i, f"i{i}", None) for i in range(count)]


class _Told(Hook):
    def __init__(self, stop_at: tuple[str, int] | None = None):
        self.heard: list[tuple] = []
        self.stop_at = stop_at

    @contextlib.contextmanager
    def session(self, items):
        self.heard.append(("session", None if items is None else len(items)))
        yield

    @contextlib.contextmanager
    def span(self, items):
        self.heard.append(("span", [i.name for i in items]))
        yield

    def before(self, item, k):
        self.heard.append(("before", item.name, k))
        if (item.name, k) == self.stop_at:
            raise KeyboardInterrupt("stopped by a hook")

    def advanced(self, item, stages):
        self.heard.append(("advanced", item.name, stages))

    def failed(self, item, error):
        self.heard.append(("failed", item.name, type(error).__name__))


def test_both_orders_give_each_item_its_own_records_and_stage_order_loads_each_model_once():
    alone = [Executor(_runner()).run(_start(item, 0)) for item in _items()]
    by_item_builds, by_stage_builds = Counter(), Counter()
    by_item = list(Executor(_runner(by_item_builds), _start).by_item(_items()))
    told = _Told()
    by_stage = list(Executor(_runner(by_stage_builds), _start, hooks=[told]).by_stage(_items()))
    for run in (by_item, by_stage):
        assert [[r.fingerprints for r in item.records] for item in run] == [[r.fingerprints for r in a] for a in alone]
    assert by_stage_builds == {"encoder": 1, "decoder": 1}  # one load per stage for the whole batch
    assert by_item_builds == {"encoder": 3, "decoder": 3}  # control: staged, item by item, loads per item
    assert told.heard[:3] == [("session", 3), ("span", ["i0", "i1", "i2"]), ("before", "i0", 0)]
    assert [h[1:] for h in told.heard if h[0] == "before"] == [(f"i{i}", k) for k in (0, 1) for i in range(3)]


class _Shelf(Store):
    """Keeps every state itself between stages, and has ``recorded`` stages of item i0 already."""

    def __init__(self, recorded: int = 0):
        self.outputs: dict[tuple[int, int], dict] = {}
        self.recorded = recorded
        self.restored: list[tuple[str, int]] = []

    def resume(self, item):
        return self.recorded if item.name == "i0" else 0

    def saved(self, item, k):
        stage = ("feats",) if k == 0 else ("y",)
        self.outputs[item.index, k] = {name: getattr(item.state, name) for name in stage}

    def between(self, item, k):
        return False  # the executor lets every state go

    def restore(self, item, k, state):
        self.restored.append((item.name, k))
        for i in range(k):
            for name, value in self.outputs[item.index, i].items():
                setattr(state, name, value)


def test_a_store_that_keeps_states_gets_them_back_and_a_resumed_item_skips_its_recorded_stages():
    expected = list(Executor(_runner(), _start).by_stage(_items(2)))
    shelf = _Shelf()
    kept = list(Executor(_runner(), _start, store=shelf).by_stage(_items(2)))
    assert [torch.equal(a.state.y, b.state.y) for a, b in zip(kept, expected)] == [True, True]
    assert shelf.restored == [("i0", 1), ("i1", 1)]  # each state came back for its second stage
    resumed = _Shelf(recorded=1)
    resumed.outputs = dict(shelf.outputs)
    log = EventLog()
    [item] = Executor(_runner(log=log), _start, store=resumed).by_item(_items(1))
    assert item.resumed == ("encode",) and [r.stage for r in item.records] == ["decode"]  # encode was not run again
    assert [e.model for e in log.of_kind("load")] == ["decoder"]
    assert torch.equal(item.state.y, expected[0].state.y)


def test_an_isolated_error_fails_its_item_alone_and_any_other_error_stops_the_run():
    class Picky(Decode):
        def run(self, state, models):
            if state.x[0, 0] == 2:  # the second item
                raise ValueError("not this one")
            super().run(state, models)
    runner = StageRunner([Encode(), Picky()], make_loaders(), provides=("x",), state_type=State)
    told = _Told()
    isolated = Executor(runner, _start, hooks=[told], isolate=lambda item, err: isinstance(err, ValueError))
    items = list(isolated.by_stage(_items()))
    assert [(i.name, i.ok, i.failed_at) for i in items] == [("i0", True, None), ("i1", False, "decode"),
                                                            ("i2", True, None)]
    assert ("failed", "i1", "ValueError") in told.heard
    assert told.heard.count(("advanced", "i1", 1)) == 2  # encode ran, then decode was given up with the item
    with pytest.raises(ValueError, match="not this one"):  # control: not isolated, the run stops
        list(Executor(runner, _start).by_stage(_items()))


def test_a_hook_that_raises_stops_the_run_and_items_may_come_from_an_iterator():
    taken = []

    def feed():
        for item in _items():
            taken.append(item.name)
            yield item
    told = _Told(stop_at=("i1", 1))
    run = Executor(_runner(), _start, hooks=[told]).by_item(feed())
    assert next(run).ok and taken == ["i0"]  # read as the run goes
    with pytest.raises(KeyboardInterrupt):
        next(run)
    assert taken == ["i0", "i1"] and told.heard[0] == ("session", None)
    assert told.heard[-1] == ("failed", "i1", "KeyboardInterrupt")


def test_drive_is_the_one_order_rule_stage_order_for_several_items_else_item_by_item():
    """``drive(items, order)``: several items in stage order run ``by_stage`` (one span, each model loaded once);
    one item, or any other order, runs ``by_item`` (a span per item), reading an iterator as the run goes."""
    def spans(order, items):
        told = _Told()
        list(Executor(_runner(), _start, hooks=[told]).drive(items, order))
        return [h[1] for h in told.heard if h[0] == "span"]

    assert spans("stage", _items()) == [["i0", "i1", "i2"]]
    assert spans("image", _items()) == [["i0"], ["i1"], ["i2"]]  # control: the other order
    assert spans("stage", _items(1)) == [["i0"]]
    assert spans("stage", iter(_items(2))) == [["i0", "i1"]]  # stage order reads the items first
    taken = []

    def feed():
        for item in _items():
            taken.append(item.name)
            yield item
    run = Executor(_runner(), _start).drive(feed(), "image")
    assert next(run).ok and taken == ["i0"]  # item order reads them as it goes
