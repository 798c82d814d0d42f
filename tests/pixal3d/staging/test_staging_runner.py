"""StageRunner: declarations checked at build time, each policy's placement, transient outputs, draws and
caches, and the example chain of examples/toy_chain.py (staged == eager, one model held at a time)."""
from __future__ import annotations

import runpy
from collections import Counter
from pathlib import Path

import pytest
import torch

from pixal3d.staging import (
    EventLog,
    Executor,
    Policy,
    PolicyError,
    StageGraphError,
    StageRunner,
    check_stages,
)
from tests.support.substitute_pipeline import build, make_loaders
from tests.support.toy_stages import State, Encode, Decode

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "toy_chain.py"


def runner(stages=None, **kwargs) -> StageRunner:
    return StageRunner(stages or [Encode(), Decode()], make_loaders(kwargs.pop("builds", None)), provides=("x",),
                       state_type=State, **kwargs)


def test_a_stage_reading_a_field_nobody_writes_is_refused_when_the_runner_is_built():
    class Refine(Decode):
        name, inputs = "refine", ("latent_from_nowhere",)
    with pytest.raises(StageGraphError, match=r"'refine' names \['latent_from_nowhere'\].*not fields of State"):
        runner([Encode(), Refine()])

    class Early(Decode):
        name = "early"
    with pytest.raises(StageGraphError, match=r"'early' reads \['feats'\], which no earlier stage writes"):
        runner([Early(), Encode()])  # order matters: feats is written only after


def test_a_stage_without_a_working_set_estimate_is_refused_when_the_runner_is_built():
    class Vague(Decode):
        def working_set(self):
            return super(Decode, self).working_set()
    with pytest.raises(StageGraphError, match="'decode' .*declares no working-set estimate"):
        runner([Encode(), Vague()])


def test_other_declaration_errors_name_the_stage():
    class Twin(Decode):
        name = "encode"
    with pytest.raises(StageGraphError, match="unique"):
        runner([Encode(), Twin()])

    class Greedy(Decode):
        needs = ("decoder", "vae")
    with pytest.raises(StageGraphError, match=r"'decode' needs models without a loader: \['vae'\]"):
        runner([Encode(), Greedy()])
    with pytest.raises(PolicyError, match="resolved first"):
        runner(policy="auto")


def test_a_stage_that_draws_from_a_generator_must_say_so():
    class Noisy(Decode):
        inputs = ("feats", "gen")

        def run(self, state, models):
            state.y = models["decoder"](state.feats) + torch.randn(1, generator=state.gen)
    state = State(x=torch.ones(2, 16), gen=torch.Generator().manual_seed(0))
    run = StageRunner([Encode(), Noisy()], make_loaders(), provides=("x", "gen"), state_type=State)
    run.run_stage("encode", state)
    with pytest.raises(StageGraphError, match=r"'decode' drew from 'gen' without declaring it"):
        run.run_stage("decode", state)

    class Declared(Noisy):
        draws = "gen"
    run = StageRunner([Encode(), Declared()], make_loaders(), provides=("x", "gen"), state_type=State)
    assert [r.stage for r in Executor(run).run(state)] == ["encode", "decode"]  # control: declared, it runs

    class Undeclared(Declared):
        inputs = ("feats",)
    with pytest.raises(StageGraphError, match=r"'decode' draws from 'gen' but does not read it"):
        StageRunner([Encode(), Undeclared()], make_loaders(), provides=("x", "gen"), state_type=State)


def test_a_cache_lives_only_while_consecutive_stages_use_it_and_a_later_reader_is_refused():
    class Memo(Encode):
        caches = ("memo",)

        def run(self, state, models):
            super().run(state, models)
            state.memo = torch.ones(1)

    class KeepsMemo(Decode):
        caches = ("memo",)
    seen = {}

    class Peek(Decode):
        name, inputs, outputs = "peek", ("y",), ()

        def run(self, state, models):
            seen["memo"] = state.memo
    for second, kept in ((Decode(), False), (KeepsMemo(), True)):
        state = State(x=torch.ones(2, 16))
        run = StageRunner([Memo(), second, Peek()], make_loaders(), provides=("x",), state_type=State)
        run.run_stage("encode", state)
        assert (state.memo is not None) == kept  # kept only when the next stage caches it too
        run.run_stage("decode", state)
        run.run_stage("peek", state)
        assert state.memo is None and seen["memo"] is None  # dropped after the last stage that uses it

    class Reader(Peek):
        inputs = ("y", "memo")
    with pytest.raises(StageGraphError, match=r"'peek' reads \['memo'\], which stage 'encode' caches and a stage "
                                              r"in between drops"):
        StageRunner([Memo(), Decode(), Reader()], make_loaders(), provides=("x",), state_type=State)
    StageRunner([Memo(), KeepsMemo(), Reader()], make_loaders(), provides=("x",), state_type=State)  # control


def test_an_output_the_state_cannot_store_is_refused_when_storable_is_given():
    check_stages([Encode(), Decode()], provides=("x",), state_type=State, storable={"feats", "y"})
    with pytest.raises(StageGraphError, match=r"'decode' writes \['y'\], which have no codec"):
        check_stages([Encode(), Decode()], provides=("x",), state_type=State, storable={"feats"})


@pytest.mark.parametrize(("policy", "loaded_after"), [("staged", []), ("resident", ["encoder", "decoder"]),
                                                      ("eager", ["encoder", "decoder"])])
def test_each_policy_places_idle_models_as_its_placement_says(policy, loaded_after):
    builds, log = Counter(), EventLog()
    run = runner(policy=policy, events=log, builds=builds)
    if policy == "eager":
        run.registry  # noqa: B018 -- building the registry preloads under eager
        assert sorted(builds) == ["decoder", "encoder"] and log.of_kind("stage") == []
    state = State(x=torch.ones(2, 16))
    records = Executor(run).run(state)
    assert [r.stage for r in records] == ["encode", "decode"]
    assert [r.used for r in records] == [["encoder"], ["decoder"]]
    released = [e.model for e in log.of_kind("release")]
    assert released == (["encoder"] if policy == "staged" else [])
    run.registry.enter("encode")  # a second pass over the stages: staged released the decoder now
    assert sorted(run.registry.loaded()) == sorted(loaded_after)
    run.close()
    assert builds == Counter({"encoder": 1, "decoder": 1})


def test_offload_parks_idle_models_instead_of_releasing_them():
    log = EventLog()
    run = runner(policy=Policy.offload, events=log)
    Executor(run).run(State(x=torch.ones(2, 16)))
    assert [(e.model, e.note) for e in log.of_kind("release")] == [("encoder", "parked in host memory")]
    assert "encoder" in run.registry.loaded()


def test_outputs_are_fingerprinted_and_transient_fields_cleared_after_their_stage():
    state = State(x=torch.ones(2, 16))
    records = Executor(runner()).run(state)
    assert set(records[0].fingerprints) == {"feats", "scratch"}
    assert state.scratch is None and state.feats is not None
    expected = build("decoder")(build("encoder")(torch.ones(2, 16)))
    assert torch.equal(state.y, expected)


def test_unfingerprinted_outputs_are_kept_for_later_stages_but_not_fingerprinted():
    class Quiet(Encode):
        unfingerprinted = ("feats",)

    state = State(x=torch.ones(2, 16))
    records = Executor(runner([Quiet(), Decode()])).run(state)
    assert set(records[0].fingerprints) == {"scratch"} and state.feats is not None  # kept, read by decode
    assert set(records[1].fingerprints) == {"y"}

    class Stray(Encode):
        unfingerprinted = ("y",)  # a field it does not write
    with pytest.raises(StageGraphError, match=r"'encode' declares \['y'\] unfingerprinted but does not write them"):
        runner([Stray(), Decode()])


def test_the_example_chain_gives_eager_fingerprints_staged_holding_only_the_largest_model():
    example = runpy.run_path(str(EXAMPLE), run_name="toy_chain")
    eager, eager_peak = example["run_chain"]("eager")
    staged, staged_peak = example["run_chain"]("staged")
    assert staged == eager and set(eager) == {"features", "latent", "output"}
    width = example["WIDTH"]
    largest = 6 * (width * width + width) * 4
    assert staged_peak == largest
    assert eager_peak == (2 + 6 + 3) * (width * width + width) * 4
    other_seed, _ = example["run_chain"]("staged", seed=1)
    assert other_seed["latent"] != staged["latent"] and other_seed["features"] == staged["features"]  # control
