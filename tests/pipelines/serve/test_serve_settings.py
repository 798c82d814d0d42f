"""The job server's settings field: the hosted endpoint's name for the face budget is accepted as an alias."""
from __future__ import annotations

import pytest

from pipelines.job import Job, SettingsError
from pixal3d.config import load_config
from tests.support.cascade_fixtures import TINY_CONFIG


@pytest.fixture(scope="module")
def config():
    return load_config(TINY_CONFIG)


def parse_settings(text, config):
    """The settings of ``POST /jobs`` as the server reads them."""
    return Job.from_request(text, config)


def test_decimation_target_is_the_face_budget_under_the_hosted_endpoints_name(config):
    hosted = parse_settings('{"seed": 7, "texture_size": 512, "decimation_target": 3000}', config)
    ours = parse_settings('{"seed": 7, "texture_size": 512, "face_budget": 3000}', config)
    assert hosted == ours and hosted.face_budget == 3000
    assert parse_settings('{"decimation_target": 4000}', config).face_budget == 4000  # control: the value is used


def test_the_alias_and_its_setting_together_or_an_unknown_key_are_refused_naming_them(config):
    with pytest.raises(SettingsError, match="both decimation_target and face_budget"):
        parse_settings('{"decimation_target": 3000, "face_budget": 3000}', config)
    with pytest.raises(SettingsError, match=r"unknown settings \['steps'\].*decimation_target"):
        parse_settings('{"steps": 3}', config)
