"""docs/app.png: the web app after a run of the tiny demo, taken in headless Chromium (Debian's ``chromium`` through
Playwright, as tests/pipelines/app/test_app_browser.py drives it): start ``python -m pipelines.app`` on the tiny config on a
loopback port, upload assets/example.png, press Generate, wait for the model in the viewer, save the page.

    python scripts/screenshot_app.py [--out docs/app.png] [--config configs/tiny.yaml]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(url: str, server: subprocess.Popen, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the app exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the app did not answer within {seconds:.0f} s")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "app.png")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml")
    parser.add_argument("--width", type=int, default=1400)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no Chromium on this machine: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False"}
        with open(Path(scratch) / "app.log", "w") as log:
            server = subprocess.Popen([sys.executable, "-m", "pipelines.app", "--config", str(args.config), "--device",
                                       "cpu", "--port", str(port), "--outputs", str(Path(scratch) / "outputs")],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_for(url, server)
                with sync_playwright() as p:
                    browser = p.chromium.launch_persistent_context(
                        str(Path(scratch) / "profile"), executable_path=chromium, headless=True, args=FLAGS,
                        viewport={"width": args.width, "height": 1000})
                    try:
                        page = browser.new_page()
                        page.set_default_timeout(60_000)
                        page.goto(url)
                        page.locator("#plan").get_by_text("policy:").wait_for()
                        page.locator("#image input[type=file]").set_input_files(str(REPO / "assets" / "example.png"))
                        page.locator("#image img").wait_for()
                        page.locator("#run").click()
                        page.locator("#status").get_by_text("done in").wait_for(timeout=300_000)
                        page.locator("#viewer canvas").scroll_into_view_if_needed()
                        time.sleep(3.0)  # the viewer draws the model it has just fetched
                        page.evaluate("window.scrollTo(0, 0)")
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        partial = args.out.with_name(f".{args.out.name}.tmp.png")
                        page.screenshot(path=str(partial), full_page=True)
                        partial.replace(args.out)  # never a half-written screenshot
                    finally:
                        browser.close()
            finally:
                server.terminate()
                try:
                    server.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    server.kill()
    print(args.out)


if __name__ == "__main__":
    main()
