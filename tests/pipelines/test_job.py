"""The job value (``pipelines/job.py``, issue 38): the three front ends' adapters give one job for one request, with
one home for defaults (the seed is the config's when none is given: the job server used 42), wire names and
aliases, and ranges; the memory budget is parsed once, when the job is made."""
from __future__ import annotations

import dataclasses

import pytest

from pipelines.cli_args import parse_args
from pipelines.job import (
    SETTINGS,
    Budget,
    Job,
    SettingsError,
    UsageError,
    check_options,
    plan_key,
)
from pixal3d.config import SettingError, load_config
from tests.support.cascade_fixtures import TINY_CONFIG


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    """The tiny config with seed 7 (the shipped configs' 42 would hide a hard-coded 42)."""
    path = tmp_path_factory.mktemp("seven") / "seven.yaml"
    path.write_text(f"base: {TINY_CONFIG}\nseed: 7\n")
    return path


def _three(config_path, *, flags=(), request=None, form=None):
    """The job each front end makes: the command's flags, the server's JSON, the app's form."""
    config = load_config(config_path)
    cli = Job.from_args(parse_args(["x.png", "--config", str(config_path), *flags]))
    return cli, Job.from_request(request, config), Job.from_form(form or {}, config)


def test_without_a_seed_every_front_end_takes_the_configs(seven):
    jobs = _three(seven)
    assert [job.seed for job in jobs] == [7, 7, 7]
    assert all(job.settings() == jobs[0].settings() for job in jobs)
    given = _three(seven, flags=["--seed", "3"], request='{"seed": 3}', form={"seed": 3.0})  # control: given wins
    assert [job.seed for job in given] == [3, 3, 3]


def test_the_same_settings_give_the_same_job_under_each_front_ends_names(seven):
    cli, served, form = _three(
        seven, flags=["--seed", "5", "--fov", "40", "--memory-policy", "staged", "--memory-budget", "2G",
                      "--texture-size", "128", "--face-budget", "2000"],
        request={"seed": 5, "fov": 40, "memory_policy": "staged", "memory_budget": "2G", "texture_size": 128,
                 "decimation_target": 2000},  # the hosted endpoint's name for the face budget
        form={"seed": 5.0, "fov": 40.0, "memory_policy": "staged", "memory_budget": " 2G ", "texture_size": "128",
              "face_budget": 2000.0})
    assert cli.settings() == served.settings() == form.settings()
    assert {"seed": 5, "fov": 40.0, "memory_policy": "staged", "texture_size": 128, "face_budget": 2000,
            "memory_budget": "2G"}.items() <= cli.settings().items()
    assert cli.config == served.config == form.config
    assert cli.config.export.texture_size == 128 and cli.config.export.decimation_target == 2000
    assert cli.plan_key() == served.plan_key() == plan_key({**served.settings(), "seed": 99})
    assert cli.plan_key() != dataclasses.replace(cli, memory_policy="resident").plan_key()  # control


def test_the_budget_is_parsed_once_when_the_job_is_made(seven, monkeypatch):
    from pixal3d import memory_budget

    calls = []
    real = memory_budget.parse_budget
    monkeypatch.setattr("pipelines.job.parse_budget", lambda text: calls.append(text) or real(text))
    job = Job.from_request({"memory_budget": "1.5G"}, load_config(seven))
    assert calls == ["1.5G"] and job.memory_budget == Budget("1.5G", 3 * 2**29) and job.budget == 3 * 2**29
    assert job.settings()["memory_budget"] == "1.5G"  # shown as given
    assert Job.from_form({"memory_budget": "auto"}, load_config(seven)).budget == "auto" and calls == ["1.5G"]


@pytest.mark.parametrize("name, value, words", [
    ("seed", -1, "seed -1 is not an integer in [0, 2**64 - 1]"),
    ("fov", 180, "is not in (0, 180) degrees"),
    ("memory_policy", "fast", "memory policy 'fast' is not one of"),
    ("memory_budget", "8Gb", "lower-case b"),
    ("texture_size", 8, "texture_size must be in [16, 16384]"),
    ("face_budget", 3, "decimation_target must be a face count >= 4"),
])
def test_a_value_out_of_range_is_refused_by_every_front_end_naming_it(seven, name, value, words):
    setting = next(s for s in SETTINGS if s.name == name)
    config = load_config(seven)
    argv = ["x.png", "--config", str(seven), setting.flag, str(value)]
    if setting.choices is not None:  # the command's parser refuses it (argparse's usage line, exit 2)
        with pytest.raises(SystemExit, match="2"):
            parse_args(argv)
    else:
        with pytest.raises(SettingError) as cli:
            Job.from_args(parse_args(argv))
        assert cli.value.setting == name and words in str(cli.value)  # the command prefixes it with its flag
    with pytest.raises(SettingsError) as served:
        Job.from_request({name: value}, config)
    assert str(served.value).startswith("settings: ") and words in str(served.value)
    with pytest.raises(SettingsError) as form:
        Job.from_form({name: value}, config)
    assert words in str(form.value) and "\n" not in str(form.value)


def test_a_request_of_the_wrong_shape_is_refused_naming_the_key(seven):
    config = load_config(seven)
    for text, words in [("{not json", "not JSON"), ('["seed"]', "JSON object"), ('{"steps": 3}', "unknown settings"),
                        ('{"seed": true}', "settings.seed must be int"), ('{"fov": "wide"}', "settings.fov must be"),
                        ('{"decimation_target": 5, "face_budget": 5}', "both decimation_target and face_budget")]:
        with pytest.raises(SettingsError, match=words.replace("[", r"\[")):
            Job.from_request(text, config)
    assert Job.from_request('{"seed": null, "fov": null}', config).seed == 7  # null: the default


def test_the_commands_options_are_the_table_and_numeric_options_are_checked_at_once():
    args = parse_args(["x.png", "--texture-size", "512", "--face-budget", "9", "--memory-policy", "eager"])
    assert (args.texture_size, args.face_budget, args.memory_policy) == (512, 9, "eager")
    assert {s.flag for s in SETTINGS} <= {"--seed", "--fov", "--num-views", "--memory-policy", "--memory-budget",
                                          "--texture-size", "--face-budget", "--texture-format", "--preset",
                                          "--compression", "--shape-only", "--mesh-pose"}
    for flag, value, words in [("--threads", 0, "--threads 0 is not an integer >= 1"),
                               ("--job-timeout", -5.0, "--job-timeout -5.0 is not a number >= 0"),
                               ("--parallel-timeout", 0.0, "--parallel-timeout 0.0 is not a number > 0"),
                               ("--warmup", -1, "--warmup -1 is not an integer >= 0"),
                               ("--job-timeout", float("nan"), "--job-timeout nan is not a number >= 0")]:
        with pytest.raises(UsageError, match=words.replace("(", r"\(")):
            check_options({flag: value})
    check_options({"--threads": 1, "--job-timeout": 0.0, "--warmup": 0, "--pp": None})  # control: in range


def test_a_setting_for_the_other_kind_of_input_is_refused_and_left_out_of_the_settings():
    images, views = load_config(TINY_CONFIG), load_config("tiny_mv")
    assert "num_views" not in Job.build(images, {}).settings() and "fov" in Job.build(images, {}).settings()
    job = Job.from_request('{"num_views": 2}', views)
    assert job.num_views == 2 and "fov" not in job.settings() and job.settings()["num_views"] == 2
    fov = ("settings.fov: a field of view does not apply to posed views: their cameras come from their "
           "transforms.json; drop it")
    zero = "settings: number of views 0 is not an integer >= 1; e.g. 4, or empty for all"
    for config, request, words in [(views, '{"fov": 30}', fov),
                                   (images, '{"num_views": 2}', "settings.num_views: a number of views applies to a"),
                                   (views, '{"num_views": 0}', zero)]:
        with pytest.raises(SettingsError) as refused:
            Job.from_request(request, config)
        assert str(refused.value).startswith(words) and "automatic" not in str(refused.value)
    assert Job.from_request('{"fov": null}', views).fov is None  # control: null is unset, not given
