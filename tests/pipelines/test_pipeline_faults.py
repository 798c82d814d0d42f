"""The library entry point under faults (issue 16): an opaque image without a remover is refused before
any model loads; a trace on a full disk does not stop the run."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from PIL import Image

from pipelines import Pixal3D
from pipelines.plan import check_inputs
from pixal3d.models.preprocess import ImageError
from tests.support.cascade_fixtures import EXAMPLE, tiny, tiny_cache  # noqa: F401


def test_run_refuses_an_opaque_image_before_any_model_loads_when_no_remover_is_configured(tiny):
    events = []
    with (Pixal3D.from_config(tiny, policy="staged", device="cpu", until="structure") as pipe,
          pytest.raises(ImageError, match="no alpha channel.*weights.rembg")):
        pipe.run(Image.open(EXAMPLE).convert("RGB"), events=events.append)
    assert [e for e in events if e.kind in ("load", "reload")] == []


def test_check_inputs_reads_no_weights_and_names_the_file(tmp_path, tiny):
    opaque = tmp_path / "cup.jpg"
    Image.open(EXAMPLE).convert("RGB").save(opaque)
    check_inputs(tiny, [EXAMPLE])
    with pytest.raises(ImageError, match="cup.jpg"):
        check_inputs(tiny, [EXAMPLE, opaque])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device that is always full)")
def test_a_trace_on_a_full_disk_warns_once_and_the_run_goes_on(tiny, caplog):
    with Pixal3D.from_config(tiny, policy="staged", device="cpu", until="camera") as pipe, \
            caplog.at_level(logging.WARNING):
        result = pipe.run(EXAMPLE, trace="/dev/full")
    assert [r.stage for r in result.stages] == ["preprocess", "camera"]
    warnings = [r.getMessage() for r in caplog.records if "/dev/full" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0]
