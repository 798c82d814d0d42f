"""Kernel pins and per-platform goldens (pixal3d.kernels, scripts/write_golden.py, tests/support/cascade_fixtures.py):
the key names the pins, the pins reach torch, each golden is what its key says, goldens of two kernel
families differ (so a run can never pass against another family's golden), and the writer writes,
records and refuses as documented."""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import pytest
import torch

from pixal3d import kernels
from tests.support import goldens
from tests.support.cascade_fixtures import (  # noqa: F401
    GOLDEN_DIR,
    REPO,
    golden_or_skip,
    golden_path,
    tiny_cache,
)

AVX2PIN, COMPAT = kernels.FAMILIES["avx2pin"], kernels.FAMILIES["compat"]


def test_the_key_names_the_architecture_and_the_pinned_family(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    assert kernels.key(AVX2PIN) == "x86_64-avx2pin"
    shouted = {k: v.upper() for k, v in COMPAT.items()}
    assert kernels.key({**shouted, "ATEN_CPU_CAPABILITY": "default"}) == "x86_64-compat"  # MKL's, oneDNN's: any case
    assert kernels.family(shouted) not in kernels.FAMILIES  # torch ignores ATEN_CPU_CAPABILITY=DEFAULT
    monkeypatch.setattr(kernels, "hardware", lambda: "AVX512")
    assert kernels.key({}) == "x86_64-avx512-unpinned"  # unpinned kernels follow the hardware: it joins the key
    partial = kernels.key({"MKL_CBWR": "AVX2"})
    assert partial.startswith("x86_64-avx512-custom-") and partial != kernels.key({"MKL_CBWR": "AVX512"})


def test_recommended_pins_are_an_avx2_family_on_x86_strict_on_intel_and_none_on_arm(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    strict = kernels.FAMILIES["avx2strict"]
    for vendor, hardware, wanted in (("AMD", "AVX2", AVX2PIN), ("AMD", "AVX512", AVX2PIN), ("Intel", "AVX2", strict),
                                     ("Intel", "AVX512", strict), ("Intel", "DEFAULT", {}), ("", "AVX2", AVX2PIN)):
        monkeypatch.setattr(kernels, "hardware", lambda hardware=hardware: hardware)
        monkeypatch.setattr(kernels, "vendor", lambda vendor=vendor: vendor)
        assert kernels.recommended_pins() == wanted, (vendor, hardware)
    assert kernels.key(strict) == "x86_64-avx2strict" and kernels.family({**strict, "MKL_CBWR": "avx2,strict"}) == \
        "avx2strict"
    monkeypatch.setattr(kernels.platform, "machine", lambda: "arm64")
    monkeypatch.setattr(kernels, "hardware", lambda: "apple")
    assert kernels.recommended_pins() == {} and kernels.key({}) == "arm64-apple-unpinned"


def test_pins_set_by_hand_are_kept_and_none_are_added_to_them(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "hardware", lambda: "AVX2")
    monkeypatch.setattr(kernels, "vendor", lambda: "AMD")
    env = {"MKL_CBWR": "COMPATIBLE"}
    assert kernels.apply_recommended_pins(env) == {"MKL_CBWR": "COMPATIBLE"} and env == {"MKL_CBWR": "COMPATIBLE"}
    env = {}
    assert kernels.apply_recommended_pins(env) == AVX2PIN
    env = {"PIXAL3D_KERNEL_PINS": "none"}  # the CPU's own kernels, asked for
    assert kernels.apply_recommended_pins(env) == {} and kernels.key(env) == "x86_64-avx2-unpinned"


def test_the_sessions_pins_reached_torch():
    """conftest set the pins before torch was imported: torch's kernel level is the pinned one."""
    level = kernels.pins().get("ATEN_CPU_CAPABILITY")
    if level is None:
        pytest.skip(f"no ATen pin in this session (kernels {kernels.key()})")
    assert torch.backends.cpu.get_cpu_capability() == level.upper()


def test_each_golden_holds_its_own_key_and_pins_and_two_families_differ():
    found = {path.name: json.loads(path.read_text()) for path in sorted(GOLDEN_DIR.glob("*.json"))}
    assert found, "no golden at all"
    for name, golden in found.items():
        kinds = goldens.kinds(golden)
        cascades = [c for c in goldens.CASCADES
                    if name in (f"{c}_{golden['key']}.json", f"{c}_{golden['key']}.{goldens.slug(kinds[0])}.json")]
        assert len(cascades) == 1, name  # one cascade's golden, named by its key (and a variant by its kind)
        assert golden["key"].endswith(kernels.family(golden["pins"]))
        assert kinds and golden["threads"] == 2 and golden["stages"]
        # one golden per kind and cascade
        assert goldens.verified_for(golden["key"], kinds[0], GOLDEN_DIR, cascades[0])[0].name == name
    pinned = found.get("tiny_x86_64-avx2pin.json"), found.get("tiny_x86_64-compat.json")
    if None in pinned:
        pytest.skip("the two x86-64 goldens are not both here")
    avx2, compat = (g["stages"] for g in pinned)
    assert avx2["preprocess"] == compat["preprocess"]  # no kernel of the families in it
    assert avx2["camera"] != compat["camera"]  # MoGe-2's convolutions and matrix products are the family's
    assert avx2["structure"]["ss_latent"] != compat["structure"]["ss_latent"]  # other kernels, other bits


def test_no_golden_for_the_kernels_is_a_skip_that_names_the_writer(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX512")  # a family nobody wrote a golden for
    with pytest.raises(pytest.skip.Exception, match=r"no golden for kernels .*custom.*scripts/write_golden\.py"):
        golden_or_skip()


def test_the_multiview_goldens_of_two_families_differ_past_the_views():
    """The multi-view cascade's goldens under avx2strict and compat: the views read alike (no kernel of the
    families in them), the conditions and latents do not (so a run never passes against the other's)."""
    pinned = [GOLDEN_DIR / f"tiny_mv_x86_64-{family}.json" for family in ("avx2strict", "compat")]
    if not all(path.exists() for path in pinned):
        pytest.skip("the two x86-64 multi-view goldens are not both here")
    strict, compat = (json.loads(path.read_text())["stages"] for path in pinned)
    assert strict["views"] == compat["views"]
    assert strict["structure"]["cond.proj"] != compat["structure"]["cond.proj"]
    assert strict["structure"]["ss_latent"] != compat["structure"]["ss_latent"]


def test_the_cascades_goldens_are_apart_and_a_missing_one_is_a_skip_naming_its_cascade(monkeypatch, tmp_path):
    """Each cascade has its own files (``<cascade>_<key>.json``, then its kinds' variants): one cascade's golden
    is neither found nor counted for the other; a missing multi-view golden's skip names ``--cascade tiny_mv``."""
    key, kind = "x86_64-example", "Example Kind"
    assert goldens.path_for_new(key, kind, tmp_path, "tiny_mv") == tmp_path / f"tiny_mv_{key}.json"
    (tmp_path / f"tiny_{key}.json").write_text(json.dumps({"verified_on": [{"kind": kind}]}))
    assert goldens.paths(key, tmp_path, "tiny_mv") == [] and goldens.verified_for(key, kind, tmp_path, "tiny_mv") is None
    assert goldens.path_for_new(key, kind, tmp_path, "tiny_mv") == tmp_path / f"tiny_mv_{key}.json"
    (tmp_path / f"tiny_mv_{key}.json").write_text(json.dumps({"verified_on": [{"kind": kind}]}))
    assert goldens.paths(key, tmp_path) == [tmp_path / f"tiny_{key}.json"]
    assert goldens.verified_for(key, kind, tmp_path, "tiny_mv")[0] == tmp_path / f"tiny_mv_{key}.json"
    assert goldens.path_for_new(key, "Other", tmp_path, "tiny_mv") == tmp_path / f"tiny_mv_{key}.other.json"
    monkeypatch.setenv("MKL_CBWR", "AVX512")  # a family nobody wrote a golden for
    with pytest.raises(pytest.skip.Exception, match=r"no golden for kernels .*scripts/write_golden\.py --cascade tiny_mv`"):
        golden_or_skip("tiny_mv")


def test_pins_are_spelled_as_their_libraries_read_them_and_an_unknown_aten_level_is_refused():
    env = {"ATEN_CPU_CAPABILITY": "AVX2", "MKL_CBWR": "avx2", "ONEDNN_MAX_CPU_ISA": "avx2"}
    assert kernels.normalise_pins(env) == {**env, "ATEN_CPU_CAPABILITY": "avx2"} and kernels.family(env) == "avx2pin"
    env = {"ATEN_CPU_CAPABILITY": "AVX2"}  # set by hand, then the suite's or the writer's call: spelled for torch
    assert kernels.apply_recommended_pins(env) == {"ATEN_CPU_CAPABILITY": "avx2"}
    with pytest.raises(ValueError, match=r"ATEN_CPU_CAPABILITY=avx3 is not a level torch knows \(default, avx2"):
        kernels.normalise_pins({"ATEN_CPU_CAPABILITY": "avx3"})


def _native_level() -> str:
    """The ATen level this CPU runs unpinned, asked of a fresh interpreter (this session's torch is pinned)."""
    env = {k: v for k, v in os.environ.items() if k not in kernels.PIN_VARS}
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_run_json_records_the_level_torch_runs_when_it_ignored_the_pin():
    """An upper-case ATen pin that reached torch unspelled (set after pixal3d.kernels could fix it): torch ran
    its own level, and describe() files the bits under neither pinned family."""
    native = _native_level()
    shouted = "AVX2" if native != "AVX2" else "DEFAULT"  # a level other than the one torch will run
    env = {**{k: v for k, v in os.environ.items() if k not in kernels.PIN_VARS}, "ATEN_CPU_CAPABILITY": shouted}
    code = "import json, torch; from pixal3d import kernels; print(json.dumps(kernels.describe()))"
    described = json.loads(subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                                          text=True, check=True).stdout)
    assert described["cpu_capability"] == native and described["family"].startswith("unhonoured-")
    assert described["family"].removeprefix("unhonoured-") not in kernels.FAMILIES
    assert described["key"] != kernels.key({"ATEN_CPU_CAPABILITY": shouted.lower()})


def test_write_golden_spells_an_upper_case_pin_for_torch(tmp_path, tiny_cache):
    """ATEN_CPU_CAPABILITY=AVX2 set by hand (torch alone would ignore it): the writer runs the AVX2 kernels and
    says so, and files them under avx2pin."""
    if kernels.arch() != "x86_64" or kernels.hardware() == "DEFAULT":
        pytest.skip(f"no AVX2 kernels on this CPU ({kernels.cpu_kind()})")
    env = {**os.environ, **{k: v.upper() for k, v in AVX2PIN.items()}}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "write_golden.py"), "--check", "--golden-dir",
                           str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, check=False)
    assert "kernels: x86_64-avx2pin" in proc.stdout and "torch uses AVX2" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1 and "run without --check to write" in proc.stdout  # an empty folder: no golden


@pytest.mark.parametrize("cascade", goldens.CASCADES)
def test_a_golden_not_verified_on_this_kind_of_cpu_is_a_skip(monkeypatch, cascade):
    if golden_path(cascade=cascade) is None:
        pytest.skip(f"no {cascade} golden of kernels {kernels.key()} verified on {kernels.cpu_kind()}")
    monkeypatch.setattr(kernels, "cpu_kind", lambda: "arm64-but-x86")
    with pytest.raises(pytest.skip.Exception, match=rf"verified on arm64-but-x86 CPUs \({cascade}_{kernels.key()}"):
        golden_or_skip(cascade)


def test_the_kind_of_cpu_names_the_vendor_and_capability(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "_cpu_field", lambda name: {"vendor_id": "AuthenticAMD"}.get(name, ""))
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2", "fma"})
    assert kernels.cpu_kind() == "AMD AVX2"
    monkeypatch.setattr(kernels, "_cpu_field", lambda name: {"vendor_id": "GenuineIntel"}.get(name, ""))
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                        "avx512dq", "amx_tile"})
    assert kernels.cpu_kind() == "Intel AVX512 AMX" and goldens.slug(kernels.cpu_kind()) == "intel-avx512-amx"


def test_write_golden_writes_records_a_new_kind_of_cpu_and_refuses_a_different_run(tiny_cache, tmp_path,
                                                                                  monkeypatch, capsys):
    """The documented command: writes a missing golden; the same run on another kind of CPU is recorded as
    verified; a golden that differs from the run is left alone (exit 1) unless --force; a kind whose run
    differs from every golden of the key gets its own variant, compared there from then on."""
    main = runpy.run_path(str(REPO / "scripts" / "write_golden.py"))["main"]
    folder = ["--golden-dir", str(tmp_path)]
    assert main(folder) == 0
    path = tmp_path / f"tiny_{kernels.key()}.json"
    written = json.loads(path.read_text())
    assert written["stages"]["structure"]["ss_latent"] and written["verified_on"][0]["kind"] == kernels.cpu_kind()
    assert written["pins"] == kernels.pins() and written["versions"]["torch"] == torch.__version__

    here = kernels.cpu_kind()
    other = f"Other {here}"  # another kind than this one, whatever this one is
    monkeypatch.setattr(kernels, "cpu_kind", lambda: other)
    assert main(folder) == 0 and f"recorded {other} as verified" in capsys.readouterr().out
    recorded = json.loads(path.read_text())
    assert goldens.kinds(recorded) == [here, other] and recorded["stages"] == written["stages"]

    recorded["stages"]["shape_512"]["lr_latent.feats"] = "0" * 64  # a golden that no longer holds
    path.write_text(json.dumps(recorded))
    before = path.read_text()
    assert main(folder) == 1
    assert "first differing stage 'shape_512': ['lr_latent.feats']" in capsys.readouterr().out
    assert path.read_text() == before
    assert main([*folder, "--check"]) == 1 and path.read_text() == before

    third = f"Third {here}"  # a kind no golden lists, whose bits differ from every golden of the key
    monkeypatch.setattr(kernels, "cpu_kind", lambda: third)
    assert main([*folder, "--check"]) == 1 and not (tmp_path / f"tiny_{kernels.key()}.{goldens.slug(third)}.json"
                                                     ).exists()
    assert main(folder) == 0 and "gives other bits than every golden" in capsys.readouterr().out
    variant = tmp_path / f"tiny_{kernels.key()}.{goldens.slug(third)}.json"
    assert goldens.kinds(json.loads(variant.read_text())) == [third] and path.read_text() == before
    assert goldens.verified_for(kernels.key(), third, tmp_path)[0] == variant
    assert main(folder) == 0 and "this run agrees" in capsys.readouterr().out  # compared with its own from now on


@pytest.mark.usefixtures("tiny_cache")
def test_write_golden_cascade_tiny_mv_writes_the_views_run_apart_from_the_single_view_golden(tmp_path, capsys):
    """``--cascade tiny_mv`` writes ``tiny_mv_<key>.json`` (the views stage first, the command to rewrite it in
    'about'), then agrees with it; the single-view cascade finds no golden of its own in that folder."""
    script = runpy.run_path(str(REPO / "scripts" / "write_golden.py"))
    assert tuple(script["RUNS"]) == goldens.CASCADES  # the writer runs each cascade the tests read goldens of
    main = script["main"]
    folder = ["--golden-dir", str(tmp_path), "--cascade", "tiny_mv"]
    assert main(folder) == 0
    written = json.loads((tmp_path / f"tiny_mv_{kernels.key()}.json").read_text())
    assert list(written["stages"])[:2] == ["views", "structure"] and "--cascade tiny_mv" in written["about"]
    assert [path.name for path in tmp_path.iterdir()] == [f"tiny_mv_{kernels.key()}.json"]
    assert main([*folder, "--check"]) == 0 and "this run agrees" in capsys.readouterr().out
    assert main(["--golden-dir", str(tmp_path), "--check"]) == 1
    assert f"run without --check to write {tmp_path / f'tiny_{kernels.key()}.json'}" in capsys.readouterr().out


@pytest.mark.parametrize("flags, level, refused", [
    ({"avx2", "fma"}, "avx512", True),          # the SIGILL of issue 44 item 10: AVX-512 kernels on an AVX2 CPU
    ({"avx2", "fma"}, "avx2", False),
    ({"avx2", "fma"}, "AVX512", True),          # any spelling
    (set(), "avx2", True),                       # a CPU without AVX2
    (set(), "default", False),
    ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}, "avx512", False),
    ({"avx2", "fma"}, "sve256", True),          # another architecture's level
])
def test_a_pin_this_cpu_cannot_run_is_refused_in_one_line_naming_what_it_can(monkeypatch, flags, level, refused):
    monkeypatch.setattr(kernels, "arch", lambda: "x86_64")
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: flags)
    line = kernels.unsupported_pin({"ATEN_CPU_CAPABILITY": level})
    assert (line is not None) == refused, line
    if refused:
        assert "\n" not in line and f"ATEN_CPU_CAPABILITY={level.lower()}" in line and "pin one of default" in line
    assert kernels.unsupported_pin({}) is None


def test_the_command_refuses_a_pin_this_cpu_lacks_before_torch_loads(tmp_path):
    """Real on every machine: a level this CPU lacks (on an AVX2 CPU ``avx512`` itself, which used to end in
    SIGILL) is one line and exit 2 from the command; control: a level it has runs on."""
    lacking = "avx512" if kernels.hardware() == "AVX2" else ("sve256" if kernels.arch() == "x86_64" else "avx2")
    have = "default"
    for level, code in ((lacking, 2), (have, 0)):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": level, "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "scripts/image_to_mesh.py", "--help"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == code, (level, proc.returncode, proc.stderr)
        if code:
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and f"ATEN_CPU_CAPABILITY={level} cannot run here" in lines[0], proc.stderr
