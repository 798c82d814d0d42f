"""The web app in a real browser: start ``python -m pipelines.app`` on the tiny config on a loopback port, drive
headless Chromium (Debian's ``chromium``, through Playwright; nothing is downloaded): Generate with no image and
with a file that is not one (the error line), then upload assets/example.png and press Generate, wait for the 3D
viewer to draw the model, read the per-stage table and the downloads, save a screenshot; then a second visitor
presses Generate while a job runs and sees their place in the queue.

Skips, saying why, only where the browser or the app's packages are missing: ``.ci/run`` installs them
(``apt-get install chromium``, ``pip install -e ".[app]" playwright``)."""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As the machine's own browser checks: headless, no sandbox (root), no GPU, and no background traffic, which this
# closed network refuses; a fresh profile each run.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CLEAR = (242, 242, 242)  # the viewer's clear colour (0.95 grey), see pipelines/app/ui.py

playwright = pytest.importorskip("playwright.sync_api", reason="the browser test needs Playwright: pip install playwright "
                                 "(the Python package only; the browser is Debian's chromium)")
pytest.importorskip("gradio", reason='the web app needs Gradio: pip install -e ".[app]"')
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine: apt-get install chromium")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def app(tiny_cache, tmp_path):
    """The app on the tiny config, serving on a free loopback port; yields its URL."""
    port = _free_port()
    log = open(tmp_path / "app.log", "w")  # noqa: SIM115 - closed below
    env = {**os.environ, "PIXAL3D_CACHE": str(tiny_cache), "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False"}
    server = subprocess.Popen([sys.executable, "-m", "pipelines.app", "--config", str(TINY_CONFIG), "--device", "cpu",
                               "--port", str(port), "--outputs", str(tmp_path / "outputs")],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, f"the app exited: {(tmp_path / 'app.log').read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the app did not answer within 90 s"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_bad_inputs_show_the_error_then_the_example_gives_the_model_the_table_and_the_downloads(app, tmp_path):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 1000})
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.goto(app)
            # 1. the plan is on the page before anything runs
            page.locator("#plan").get_by_text("policy:").wait_for()
            # 2. bad inputs: the library's one-line error in the status line, and the page goes on working
            page.locator("#run").click()
            page.locator("#status").get_by_text("error: no image").wait_for()
            not_an_image = tmp_path / "notes.png"
            not_an_image.write_text("not a picture")
            page.locator("#image input[type=file]").set_input_files(str(not_an_image))
            page.locator("#run").click()
            page.locator("#status").get_by_text("is not an image Pillow can read").wait_for()
            page.locator("#image").get_by_role("button", name="Remove Image").click()
            # 3. upload the example and press Generate
            page.locator("#image input[type=file]").set_input_files(str(EXAMPLE))
            page.locator("#image img").wait_for()
            with page.expect_response(lambda r: r.url.endswith(".glb") and r.ok, timeout=120_000) as fetched:
                page.locator("#run").click()
                page.locator("#status").get_by_text("done in").wait_for(timeout=120_000)
            assert fetched.value.body()[:4] == b"glTF"  # the viewer fetched the job's GLB
            # 4. the viewer draws it: its canvas holds pixels other than the clear colour
            canvas = page.locator("#viewer canvas")
            canvas.scroll_into_view_if_needed()
            drawn = _wait_for_drawing(canvas)
            assert drawn > 0.01, f"the viewer shows only its background ({drawn:.1%} of pixels differ)"
            # 5. the per-stage table and the memory plot
            table = page.locator("#stages").inner_text()
            for stage in ("preprocess", "structure", "shape_1024", "texture", "decode", "export", "total"):
                assert stage in table
            assert "MiB" in table or "GiB" in table
            assert page.locator("#memory img").count() == 1
            links = [a.get_attribute("href") for a in page.locator("#downloads a[href]").all()]
            names = {link.rsplit("/", 1)[-1] for link in links}
            assert {"example.glb", "example.run.json"} <= names, links
            record = next(link for link in links if link.endswith(".run.json"))
            with urllib.request.urlopen(record, timeout=10) as response:  # the download link serves run.json
                assert json.load(response)["stages"][-1]["stage"] == "export"
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot), full_page=True)
            assert Image.open(shot).size[0] >= 1400
            # 6. a second visitor while a job runs: their page shows their place in the queue, and their job
            # runs after the first one (one job at a time on the models)
            other = browser.new_page()
            other.set_default_timeout(30_000)
            other.goto(app)
            other.locator("#plan").get_by_text("policy:").wait_for()
            other.locator("#image input[type=file]").set_input_files(str(EXAMPLE))
            other.locator("#image img").wait_for()
            page.locator("#run").click()
            other.locator("#run").click()
            other.locator("#status").get_by_text("queue: 1/1").wait_for()
            page.locator("#status").get_by_text("done in").wait_for(timeout=120_000)
            other.locator("#status").get_by_text("done in").wait_for(timeout=120_000)
        finally:
            browser.close()


def _wait_for_drawing(canvas, seconds: float = 20.0) -> float:
    """Fraction of the canvas's pixels that differ from the clear colour, once it stops being blank (or at timeout)."""
    deadline = time.monotonic() + seconds
    while True:
        pixels = np.asarray(Image.open(io.BytesIO(canvas.screenshot())).convert("RGB"), dtype=np.int16)
        differ = float((np.abs(pixels - np.array(CLEAR)).max(axis=-1) > 24).mean())
        if differ > 0.01 or time.monotonic() > deadline:
            return differ
        time.sleep(0.5)
