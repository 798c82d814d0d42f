"""Kernel pins and per-platform goldens (pixal3d.kernels, scripts/write_golden.py, tests/cascade_fixtures.py):
the key names the pins, the pins reach torch, each golden is what its key says, goldens of two kernel
families differ (so a run can never pass against another family's golden), and the writer writes,
records and refuses as documented."""
from __future__ import annotations

import json
import runpy

import pytest
import torch

from pixal3d import kernels
from tests.cascade_fixtures import REPO, GOLDEN_DIR, golden_or_skip, golden_path, tiny_cache  # noqa: F401

AVX2PIN, COMPAT = kernels.FAMILIES["avx2pin"], kernels.FAMILIES["compat"]


def test_the_key_names_the_architecture_and_the_pinned_family(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    assert kernels.key(AVX2PIN) == "x86_64-avx2pin"
    assert kernels.key({k: v.upper() for k, v in COMPAT.items()}) == "x86_64-compat"  # values case-blind
    monkeypatch.setattr(kernels, "hardware", lambda: "AVX512")
    assert kernels.key({}) == "x86_64-avx512-unpinned"  # unpinned kernels follow the hardware: it joins the key
    partial = kernels.key({"MKL_CBWR": "AVX2"})
    assert partial.startswith("x86_64-avx512-custom-") and partial != kernels.key({"MKL_CBWR": "AVX512"})


def test_recommended_pins_are_the_avx2_family_on_x86_and_none_on_arm(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    for hardware, wanted in (("AVX2", AVX2PIN), ("AVX512", AVX2PIN), ("DEFAULT", {})):
        monkeypatch.setattr(kernels, "hardware", lambda hardware=hardware: hardware)
        assert kernels.recommended_pins() == wanted, hardware
    monkeypatch.setattr(kernels.platform, "machine", lambda: "arm64")
    monkeypatch.setattr(kernels, "hardware", lambda: "apple")
    assert kernels.recommended_pins() == {} and kernels.key({}) == "arm64-apple-unpinned"


def test_pins_set_by_hand_are_kept_and_none_are_added_to_them(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "hardware", lambda: "AVX2")
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
    goldens = {path.name: json.loads(path.read_text()) for path in sorted(GOLDEN_DIR.glob("tiny_*.json"))}
    assert goldens, "no golden at all"
    for name, golden in goldens.items():
        assert name == f"tiny_{golden['key']}.json" and golden["key"].endswith(kernels.family(golden["pins"]))
        assert golden["verified_on"] and golden["threads"] == 2 and golden["stages"]
    pinned = goldens.get("tiny_x86_64-avx2pin.json"), goldens.get("tiny_x86_64-compat.json")
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


def test_a_golden_not_verified_on_this_kind_of_cpu_is_a_skip(monkeypatch):
    monkeypatch.setattr(kernels, "hardware", lambda: "arm64-but-x86")
    if not golden_path().exists():
        pytest.skip(f"no golden for kernels {kernels.key()}")
    with pytest.raises(pytest.skip.Exception, match=r"verified on .* CPUs only and this one is arm64-but-x86"):
        golden_or_skip()


def test_write_golden_writes_records_a_new_kind_of_cpu_and_refuses_a_different_run(tiny_cache, tmp_path,
                                                                                  monkeypatch, capsys):
    """The documented command: writes a missing golden; the same run on another kind of CPU is recorded as
    verified; a golden that differs from the run is left alone (exit 1) unless --force."""
    main = runpy.run_path(str(REPO / "scripts" / "write_golden.py"))["main"]
    folder = ["--golden-dir", str(tmp_path)]
    assert main(folder) == 0
    path = tmp_path / f"tiny_{kernels.key()}.json"
    written = json.loads(path.read_text())
    assert written["stages"]["structure"]["ss_latent"] and written["verified_on"][0]["hardware"] == kernels.hardware()
    assert written["pins"] == kernels.pins() and written["versions"]["torch"] == torch.__version__

    monkeypatch.setattr(kernels, "hardware", lambda: "AVX512")
    if kernels.family() not in kernels.FAMILIES:  # unpinned kernels follow the CPU: another CPU, another golden
        assert main(folder) == 0 and (tmp_path / f"tiny_{kernels.key()}.json").exists()
        return
    assert main(folder) == 0 and "recorded AVX512 as verified" in capsys.readouterr().out
    recorded = json.loads(path.read_text())
    assert [v["hardware"] for v in recorded["verified_on"]] == [written["verified_on"][0]["hardware"], "AVX512"]
    assert recorded["stages"] == written["stages"]

    recorded["stages"]["shape_512"]["lr_latent.feats"] = "0" * 64  # a golden that no longer holds
    path.write_text(json.dumps(recorded))
    before = path.read_text()
    assert main(folder) == 1
    assert "first differing stage 'shape_512': ['lr_latent.feats']" in capsys.readouterr().out
    assert path.read_text() == before
    assert main([*folder, "--check"]) == 1 and path.read_text() == before
