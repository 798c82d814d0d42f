"""Issue 36, item 6.3: a numeric option out of range is refused at start by every front end, one line and exit 2,
from one table of ranges (``pipelines.job.OPTIONS``). ``pixal3d-serve --threads 0`` used to start a worker that died
and restarted every ~6 s while ``/health`` never said ready; ``--job-timeout=-5`` failed every job."""
from __future__ import annotations

import pytest

from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG


def _serve(tmp_path, *argv):
    from pipelines.serve.main import main

    return main(["--config", str(TINY_CONFIG), "--data", str(tmp_path / "data"), "--port", "0", *argv])


def _app(tmp_path, *argv):
    from pipelines.app.main import main

    return main(["--config", str(TINY_CONFIG), *argv])


def _cli(tmp_path, *argv):
    from pipelines.cli import main

    return main([str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(tmp_path / "o.glb"), *argv])


@pytest.mark.parametrize("front_end, argv, words", [
    (_serve, ["--threads", "0"], "--threads 0 is not an integer >= 1"),
    (_serve, ["--threads", "-1"], "--threads -1 is not an integer >= 1"),
    (_serve, ["--job-timeout=-5"], "--job-timeout -5.0 is not a number >= 0"),
    (_serve, ["--job-timeout", "nan"], "--job-timeout nan is not a number >= 0"),
    (_serve, ["--group-size", "0"], "--group-size 0 is not an integer >= 1"),
    (_serve, ["--queue-size", "-3"], "--queue-size -3 is not an integer >= 1"),
    (_serve, ["--max-pixels", "0"], "--max-pixels 0 is not an integer >= 1"),
    (_serve, ["--port", "70000"], "--port 70000 is not an integer in [0, 65535]"),
    (_app, ["--queue-size", "0"], "--queue-size 0 is not an integer >= 1"),
    (_app, ["--port", "0"], "--port 0 is not an integer in [1, 65535]"),
    (_cli, ["--parallel-timeout", "0"], "--parallel-timeout 0.0 is not a number > 0"),
    (_cli, ["--parallel", "pipefusion", "--warmup", "-1"], "--warmup -1 is not an integer >= 0"),
    (_cli, ["--parallel", "cfg", "--data-groups", "0"], "--data-groups 0 is not an integer >= 1"),
    (_cli, ["--texture-size", "8"], "--texture-size: texture_size must be in [16, 16384]"),
    (_cli, ["--seed", "-1"], "--seed: seed -1 is not an integer in [0, 2**64 - 1]"),
])
def test_a_numeric_option_out_of_range_is_one_line_and_exit_2_before_anything_starts(front_end, argv, words, tmp_path,
                                                                                     capsys):
    assert front_end(tmp_path, *argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # no data folder, no output: refused before anything was made


def test_control_the_same_options_in_range_pass_the_checks(tmp_path):
    from pipelines.serve.main import check_args, parse_args

    args = parse_args(["--threads", "1", "--job-timeout", "0", "--group-size", "1", "--port", "0", "--devices", "cpu"])
    assert check_args(args)[0] == ["cpu"]
