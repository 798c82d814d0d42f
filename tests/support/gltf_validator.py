"""The Khronos glTF validator (the npm package ``gltf-validator``, compiled from the reference Dart validator) run
on a GLB's bytes through node, for the tests.

Where it is: ``$PIXAL3D_GLTF_VALIDATOR`` (a folder holding ``node_modules/gltf-validator``), else
``.cache/gltf-validator`` in the checkout (``.ci/run`` installs it there:
``npm install --prefix .cache/gltf-validator gltf-validator@2.0.0-dev.3.10``). Without node or the package, the
tests that need it skip saying how to install it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

VERSION = "2.0.0-dev.3.10"
INSTALL = f"npm install --prefix .cache/gltf-validator gltf-validator@{VERSION}"
_SCRIPT = """
const validator = require(process.argv[1]);
const chunks = [];
process.stdin.on('data', c => chunks.push(c));
process.stdin.on('end', () => {
  validator.validateBytes(new Uint8Array(Buffer.concat(chunks)), {maxIssues: 200})
    .then(r => process.stdout.write(JSON.stringify(r.issues)))
    .catch(e => { process.stderr.write(String(e)); process.exit(2); });
});
"""


def validator_package() -> Path | None:
    """The validator's package folder, or None."""
    root = Path(os.environ.get("PIXAL3D_GLTF_VALIDATOR", Path(__file__).resolve().parents[2] / ".cache/gltf-validator"))
    package = root / "node_modules" / "gltf-validator"
    return package if (package / "package.json").is_file() else None


def validate(data: bytes) -> dict:
    """The validator's ``issues`` report (numErrors, numWarnings, messages) for a GLB; skips without it."""
    node = shutil.which("node")
    package = validator_package()
    if node is None or package is None:
        pytest.skip(f"the Khronos glTF validator is not installed (node {'found' if node else 'missing'}); "
                    f"install it with: {INSTALL}")
    done = subprocess.run([node, "-e", _SCRIPT, str(package)], input=data, capture_output=True, timeout=120,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"gltf-validator failed: {done.stderr.decode()[-2000:]}")
    return json.loads(done.stdout)


def errors(report: dict) -> list[str]:
    """The report's messages of severity 0 (errors) and 1 (warnings), as text."""
    return [f"{m['code']} {m.get('pointer', '')} {m['message']}" for m in report["messages"] if m["severity"] <= 1]
