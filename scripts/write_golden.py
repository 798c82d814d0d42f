"""Write, check or extend the golden fingerprints of the tiny cascade for this machine's kernels.

    python scripts/write_golden.py                 # this machine's pins (tests/conftest.py's): write or check
    python scripts/write_golden.py --pins compat   # another kernel family (CI's second level)
    python scripts/write_golden.py --check         # compare only, write nothing
    python scripts/write_golden.py --cascade tiny_mv   # the multi-view tiny cascade's (assets/views_example)
    python scripts/write_golden.py --cascade tiny_mesh # --mesh: the tiny cascade texturing assets/example_mesh.ply

The golden of a platform is ``tests/golden/tiny_<key>.json`` (``pixal3d.kernels.key()``: the architecture
and the pinned kernel family, e.g. ``x86_64-avx2pin``). It holds the per-stage fingerprints of an eager run
of configs/tiny.yaml on assets/example.png (seed 42, CPU, 2 threads, up to the decode: what the tests
compare) and ``verified_on``: the kinds of CPU (``pixal3d.kernels.cpu_kind()``: vendor, capability, AMX)
whose runs gave exactly these bits. The tests compare against it only on those kinds and skip elsewhere,
naming this command. ``--cascade tiny_mv`` does the same for the multi-view tiny cascade (configs/tiny_mv.yaml
on the four views of assets/views_example), in files of its own: ``tests/golden/tiny_mv_<key>.json`` and its
kinds' variants.

With no golden for the key, it is written. With one verified on this kind of CPU, the run is compared:
different, nothing is written and the first differing stage is printed (exit 1), unless ``--force``
rewrites it (for a change of the cascade's numbers: say why in the commit). On a kind not yet listed, the run
is compared with every golden of the key: equal to one, this kind is added to its ``verified_on`` (the pins
made two kinds agree); equal to none, the pins do not make this kind give those bits, and its own variant
``tiny_<key>.<kind>.json`` is written (tests/support/goldens.py). A pin torch does not honour (``ATEN_CPU_CAPABILITY``
in upper case, or a level it does not know) is refused: the golden would be filed under kernels that did not run.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from pixal3d import kernels  # imports no torch: the pins are set below, before torch

GOLDEN_DIR = REPO / "tests" / "golden"
THREADS = 2  # tests/conftest.py's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pins", choices=[*kernels.FAMILIES, "env"], default="env",
                        help="kernel family to pin (default: the environment's pins, else this machine's "
                             "recommended ones unless PIXAL3D_KERNEL_PINS=none, as the tests do)")
    parser.add_argument("--check", action="store_true", help="compare with the golden, write nothing")
    parser.add_argument("--force", action="store_true", help="rewrite a golden that differs")
    parser.add_argument("--cascade", choices=goldens_cascades(), default="tiny",
                        help="tiny (configs/tiny.yaml on assets/example.png) or tiny_mv (configs/tiny_mv.yaml on "
                             "assets/views_example); default tiny")
    parser.add_argument("--golden-dir", type=Path, default=GOLDEN_DIR, help=f"default {GOLDEN_DIR.relative_to(REPO)}")
    args = parser.parse_args(argv)
    try:
        if args.pins == "env":
            kernels.apply_recommended_pins()
        else:
            for name in kernels.PIN_VARS:
                os.environ.pop(name, None)
            os.environ.update(kernels.FAMILIES[args.pins])
    except ValueError as err:
        print(f"write_golden: {err}")
        return 2
    os.environ["OMP_NUM_THREADS"] = str(THREADS)

    import torch

    from pixal3d.staging.fingerprint import first_difference
    from tests.support import goldens

    if not kernels.honoured():
        print(f"write_golden: torch ignored ATEN_CPU_CAPABILITY={kernels.pins()['ATEN_CPU_CAPABILITY']} and runs "
              f"{torch.backends.cpu.get_cpu_capability()}: nothing written")
        return 2
    torch.set_num_threads(THREADS)
    prints, extra = _run_tiny(args.cascade)
    described = kernels.describe()
    key, kind = described["key"], described["kind"]
    here = {"kind": kind, "hardware": described["hardware"], "cpu": described["cpu"]}
    print(f"kernels: {key} (pins {described['pins'] or 'none'}; CPU {described['cpu']}, {kind}; torch uses "
          f"{described['cpu_capability']})")
    mine = goldens.verified_for(key, kind, args.golden_dir, args.cascade)
    if mine is not None:  # the golden of this kind: a regression check
        path, golden = mine
        differing = first_difference(prints, golden["stages"])
        if not differing:
            print(f"{_shown(path)}: this run agrees (verified on {', '.join(goldens.kinds(golden))})")
            return 0
        print(f"{_shown(path)}: this run differs: {differing}")
        if args.check or not args.force:
            print("nothing written (--force rewrites it: only for a change of the cascade's numbers)")
            return 1
        _write(path, {**golden, **extra, "verified_on": [here], "stages": prints})
        print(f"rewrote {_shown(path)} (verified on {kind} only now)")
        return 0
    others = [(path, goldens.load(path)) for path in goldens.paths(key, args.golden_dir, args.cascade)]
    for path, golden in others:  # a kind not listed yet: do the pins make it agree with one?
        if not first_difference(prints, golden["stages"]):
            if args.check:
                print(f"{_shown(path)}: this run agrees; run without --check to record {kind}")
            else:
                golden["verified_on"].append(here)
                _write(path, golden)
                print(f"{_shown(path)}: this run agrees; recorded {kind} as verified")
            return 0
    for path, golden in others:
        print(f"{_shown(path)} (verified on {', '.join(goldens.kinds(golden))}): this run differs: "
              f"{first_difference(prints, golden['stages'])}")
    path = goldens.path_for_new(key, kind, args.golden_dir, args.cascade)
    if args.check:
        print(f"no golden of {key} verified on {kind}; run without --check to write {_shown(path)}")
        return 1
    _write(path, {
        "about": f"per-stage sha256 fingerprints of an eager run of {RUNS[args.cascade][2]}, seed 42, CPU, 2 threads, "
                 f"up to the decode, with the kernels named by 'key' and 'pins'; written by python "
                 f"scripts/write_golden.py{'' if args.cascade == 'tiny' else ' --cascade ' + args.cascade}, compared "
                 f"by the tests only on the kinds of CPU in 'verified_on'",
        "key": key, "pins": described["pins"], "threads": THREADS,
        "verified_on": [here], **extra, "stages": prints})
    print(f"wrote {_shown(path)}" + (f": {kind} gives other bits than every golden of {key} under these pins"
                                     if others else ""))
    return 0


RUNS = {"tiny": ("tiny.yaml", {"image": REPO / "assets" / "example.png"}, "configs/tiny.yaml on assets/example.png"),
        "tiny_mv": ("tiny_mv.yaml", {"views": REPO / "assets" / "views_example"},
                    "configs/tiny_mv.yaml on the views of assets/views_example"),
        "tiny_mesh": ("tiny.yaml", {"image": REPO / "assets" / "example.png",
                                    "mesh": REPO / "assets" / "example_mesh.ply"},
                      "configs/tiny.yaml on assets/example.png texturing assets/example_mesh.ply (--mesh)")}
"""Each cascade's golden run: its config, its input, and the words for them."""


def goldens_cascades() -> tuple[str, ...]:
    """The cascades this script runs (``tests/support/goldens.py``'s ``CASCADES``: their files' prefixes)."""
    return tuple(RUNS)


def _run_tiny(cascade: str = "tiny") -> tuple[dict[str, dict[str, str]], dict]:
    """The eager tiny run the tests compare (tests/support/cascade_fixtures.py: tiny_reference; tests/support/views_fixtures.py:
    mv_reference)."""
    import transformers

    from pipelines import Pixal3D
    from pipelines.result import versions

    transformers.logging.disable_progress_bar()  # this script prints its own lines

    config, given, _ = RUNS[cascade]
    kind, until = ("mesh", "mesh_decode") if "mesh" in given else (None, "decode")
    with Pixal3D.from_config(REPO / "configs" / config, policy="eager", device="cpu", until=until,
                             input_kind=kind) as pipe:
        result = pipe.run(**given)
    state = result.state
    tokens = ({"hr": len(state.shape_latent.coords), "voxels": len(state.mesh_voxels)} if kind else
              {"lr": len(state.coords_lr), "hr": len(state.coords_hr)})
    return result.fingerprints(), {"versions": versions(), "choices": result.choices, "tokens": tokens}


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _write(path: Path, data: dict) -> None:
    from pixal3d.files import json_bytes, write_bytes_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, json_bytes(data))


if __name__ == "__main__":
    raise SystemExit(main())
