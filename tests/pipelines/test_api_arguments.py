"""Issue 30, item 10: the Python API checks its arguments at the door. ``from_config(None)`` used to fail inside the
plan with ``AttributeError: 'NoneType' object has no attribute 'weights'`` and a closed PIL image with PIL's
own ``ValueError`` deep in preprocessing; each is now a ``TypeError`` or ``ValueError`` naming the argument,
raised before anything is planned, read or run."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pipelines import Pixal3D
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401


@pytest.mark.parametrize("kwargs, error, words", [
    ({"config": None}, TypeError, "config must be a CascadeConfig or the path"),
    ({"config": 42}, TypeError, "config must be"),
    ({"config": TINY_CONFIG, "policy": 3}, TypeError, "policy must be"),
    ({"config": TINY_CONFIG, "policy": "lazy"}, ValueError, "unknown policy 'lazy'"),
    ({"config": TINY_CONFIG, "device": 0}, TypeError, "device must be"),
    ({"config": TINY_CONFIG, "until": 3}, TypeError, "until must be"),
    ({"config": TINY_CONFIG, "replace": ["camera"]}, TypeError, "replace must map"),
    ({"config": TINY_CONFIG, "memory_budget": 8.5}, TypeError, "memory_budget must be a size"),
    ({"config": TINY_CONFIG, "memory_budget": "8 gigs"}, ValueError, "memory budget '8 gigs' is not a size"),
])
def test_from_config_names_a_bad_argument_before_anything_is_read(kwargs, error, words, monkeypatch):
    import pipelines.plan

    monkeypatch.setattr(pipelines.plan, "planned_pipeline_json",
                        lambda *a, **k: pytest.fail("the plan read something"))
    config = kwargs.pop("config")
    with pytest.raises(error, match=words):
        Pixal3D.from_config(config, **kwargs)


@pytest.fixture(scope="module")
def pipe(tiny_cache):
    with Pixal3D.from_config(TINY_CONFIG, device="cpu", until="preprocess") as pipe:
        yield pipe


def _closed_image(loaded: bool = False) -> Image.Image:
    image = Image.open(EXAMPLE)
    if loaded:
        image.load()
    image.close()
    return image


@pytest.mark.parametrize("image, error, words", [
    (None, TypeError, "image must be a path, a PIL image or a uint8 numpy array, not NoneType"),
    (b"\x89PNG", TypeError, "not bytes"),
    (np.zeros((8, 8, 4), np.float32), ValueError, "image is a float32 array; pass uint8"),
])
def test_run_names_an_image_of_the_wrong_kind(pipe, image, error, words):
    with pytest.raises(error, match=words):
        pipe.run(image)


@pytest.mark.parametrize("loaded", [False, True], ids=["closed-before-load", "closed-after-load"])
def test_run_refuses_a_closed_pil_image_naming_it(pipe, loaded):
    with pytest.raises(ValueError, match="image is a closed PIL image"):
        pipe.run(_closed_image(loaded))
    assert pipe.run(Image.open(EXAMPLE)).state.image is not None  # control: an open (lazily read) image runs


@pytest.mark.parametrize("call, error, words", [
    (lambda p: p.run_batch(EXAMPLE), TypeError, "images must be a list of images"),
    (lambda p: p.run_batch(str(EXAMPLE)), TypeError, "for one image call run"),
    (lambda p: p.run_batch([EXAMPLE, None]), TypeError, r"images\[1\] must be a path"),
    (lambda p: p.run_batch([EXAMPLE, _closed_image()]), ValueError, r"images\[1\] is a closed PIL image"),
    (lambda p: p.run_batch([EXAMPLE], names="a"), TypeError, "names must be a list of strings"),
    (lambda p: p.run_batch([EXAMPLE], work_dir=3), TypeError, "work_dir must be a path"),
    (lambda p: p.run_batch([EXAMPLE], state_budget=-1), ValueError, "state_budget -1 is negative"),
    (lambda p: p.run_batch([EXAMPLE], state_budget="1G"), TypeError, "state_budget must be a number of bytes"),
    (lambda p: p.run([EXAMPLE][0], callback="print"), TypeError, "callback must be a function"),
    (lambda p: p.run(EXAMPLE, progress="yes"), TypeError, "progress must be True or False"),
    (lambda p: p.run(EXAMPLE, name=3), TypeError, "name must be a string"),
])
def test_run_and_run_batch_name_a_bad_argument_at_the_call(pipe, call, error, words):
    with pytest.raises(error, match=words):
        call(pipe)
