"""A client of ``pixal3d-serve``: submit an image (with a mesh to texture), follow the job, download the GLB.

    pixal3d-serve --config configs/tiny.yaml --data serve-data &          # the offline demo's server
    python examples/serve_client.py assets/example.png -o outputs/served.glb --settings '{"seed": 7}'
    python examples/serve_client.py assets/example.png --mesh assets/example_mesh.ply -o outputs/textured.glb

``--url`` (default http://127.0.0.1:8000) names the server; a server that needs a token reads it from
``PIXAL3D_SERVE_TOKEN`` here too. Ctrl-C cancels the job (``DELETE /jobs/{id}``). Needs httpx (``pip install httpx``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx


def main() -> int:
    parser = argparse.ArgumentParser(description="Submit an image to pixal3d-serve and download the GLB.")
    parser.add_argument("image", type=Path)
    parser.add_argument("-o", "--output", type=Path, default=None, help="the GLB (default: outputs/<image>.glb)")
    parser.add_argument("--mesh", type=Path, default=None,
                        help="texture this mesh (GLB, OBJ, PLY) from the image; settings may add mesh_pose")
    parser.add_argument("--settings", default="{}", help='JSON, e.g. {"seed": 7, "texture_size": 1024}')
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    token = os.environ.get("PIXAL3D_SERVE_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    output = args.output or Path("outputs") / f"{args.image.stem}.glb"
    with httpx.Client(base_url=args.url, headers=headers, timeout=60) as client:
        # 1. submit: 202 and the job's id, or a 4xx with the reason on one line
        files = {"image": (args.image.name, args.image.read_bytes())}
        if args.mesh is not None:
            files["mesh"] = (args.mesh.name, args.mesh.read_bytes())
        response = client.post("/jobs", files=files, data={"settings": args.settings})
        if response.status_code != 202:
            print(f"refused ({response.status_code}): {response.json()['error']}", file=sys.stderr)
            return 1
        job = response.json()["id"]
        print(f"job {job} queued")
        # 2. follow it until it ends; Ctrl-C cancels it
        shown = None
        try:
            while (view := client.get(f"/jobs/{job}").json())["status"] in ("queued", "running"):
                line = (f"queued, position {view['position']}" if view["status"] == "queued" else
                        f"running {view.get('stage', 'starting')}" + (f" step {view['step']}/{view['steps']}"
                                                                      if view.get("steps") else ""))
                if line != shown:
                    print(line)
                    shown = line
                time.sleep(0.5)
        except KeyboardInterrupt:
            print(f"cancelling: {client.delete(f'/jobs/{job}').json()['status']}")
            return 130
        if view["status"] != "done":
            print(f"job {view['status']}: {view.get('error')}", file=sys.stderr)
            return 1
        # 3. the results
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(client.get(f"/jobs/{job}/result.glb").content)
        record = client.get(f"/jobs/{job}/run.json").json()
        output.with_suffix(".run.json").write_text(json.dumps(record, indent=2))
        for stage in view["stages"]:
            print(f"  {stage['stage']:<11} {stage['seconds']:7.2f} s" + ("  (resumed)" if stage["resumed"] else ""))
        print(f"{output} ({view['seconds']:.1f} s, policy {view['policy']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
