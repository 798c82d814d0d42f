"""Which CPU kernels made a run's numbers, and the pins that make them the same on every x86-64 CPU with AVX2.

Bits from CPU kernels differ between kinds of CPU: ATen picks its vectorised kernels by the CPU's
capability (AVX2, AVX-512, …), MKL its GEMM code path by the processor, oneDNN its JIT code by the ISA.
Three environment variables pin each of them, and they act only when set *before torch is imported*:

- ``ATEN_CPU_CAPABILITY``: ATen's kernel level (``default``, ``avx2``, ``avx512``);
- ``MKL_CBWR``: MKL's conditional numerical reproducibility branch (``AVX2``, ``COMPATIBLE``, …);
- ``ONEDNN_MAX_CPU_ISA``: the highest ISA oneDNN's JIT may use (``AVX2``, ``SSE41``, …).

A *kernel family* names a set of pins (``avx2pin``, ``avx2strict``, ``compat``); ``key()`` names the platform and family a
run's fingerprints belong to (``x86_64-avx2pin``), so a golden is looked up by it. Runs with no pins, or
with other values, depend on the hardware as well, and their key says so (``x86_64-avx512-unpinned``).

The pins do not make every CPU give the same bits: an Intel AVX-512 CPU with AMX gives other bits than an
AMD AVX2 CPU under the same ``avx2pin`` family (measured: from the camera on; the likely cause is MKL, which
picks its code paths by vendor too). So a golden records the *kinds* of CPU it holds on (``cpu_kind()``: vendor, capability
and AMX, e.g. ``AMD AVX2``), and is compared only on those.

torch reads ``ATEN_CPU_CAPABILITY`` in lower case only (``AVX2`` is ignored, with a warning, and the CPU's own
level runs), while MKL and oneDNN read theirs in any case: ``normalise_pins`` spells them the way each
library honours them, and ``family`` counts an ATen pin only in the spelling torch honours.

This module imports torch only inside ``describe``, so a test session or a script can choose the pins
before torch is loaded.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

PIN_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")

FAMILIES: dict[str, dict[str, str]] = {
    # AVX2 kernels on any x86-64 CPU that has AVX2 (AVX-512 machines included): the tests' default there.
    "avx2pin": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    # the same with MKL's strict mode: the tests' default on Intel CPUs, where MKL's AVX2 branch without it makes a
    # GEMM's rows depend on the matrix's size and on MKL's dynamic threading (recommended_pins says why)
    "avx2strict": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    # the lowest level each library offers: any x86-64 CPU; CI's second kernel level.
    "compat": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def arch() -> str:
    """The machine architecture, spelled one way (``x86_64``, ``arm64``)."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "aarch64": "arm64"}.get(machine, machine)


def pins(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kernel-pinning variables set in ``env`` (default: this process's environment)."""
    env = os.environ if env is None else env
    return {name: env[name] for name in PIN_VARS if env.get(name)}


# ATEN_CPU_CAPABILITY values torch knows (aten/src/ATen/native/DispatchStub.cpp), in the only case it reads
ATEN_LEVELS = ("default", "avx2", "avx512", "sve256", "zvector", "vsx")


def _spelled(name: str, value: str) -> str:
    """``value`` as the library behind ``name`` compares it: ATen's in lower case (it reads no other), MKL's and
    oneDNN's folded to upper case (they read any)."""
    return value if name == "ATEN_CPU_CAPABILITY" else value.upper()


def family(env: Mapping[str, str] | None = None) -> str:
    """``avx2pin`` or ``compat`` when ``env`` pins exactly that family as the libraries read it (MKL's and
    oneDNN's values in any case; ATen's only in lower case, since torch ignores ``AVX2``), ``unpinned`` when it
    pins nothing, else ``custom-<hash of the pins>``."""
    found = pins(env)
    if not found:
        return "unpinned"
    folded = {k: _spelled(k, v) for k, v in found.items()}
    for name, values in FAMILIES.items():
        if folded == {k: _spelled(k, v) for k, v in values.items()}:
            return name
    digest = hashlib.sha256(repr(sorted(folded.items())).encode()).hexdigest()[:8]
    return f"custom-{digest}"


def normalise_pins(env: dict[str, str] | None = None) -> dict[str, str]:
    """Spell the pins in ``env`` (default ``os.environ``) the way their libraries honour them: torch reads
    ``ATEN_CPU_CAPABILITY`` only in lower case, so ``AVX2`` becomes ``avx2`` (MKL's and oneDNN's values are
    left as given). A level torch does not know raises ``ValueError`` naming the ones it does: torch would
    ignore it and run the CPU's own kernels under a key that says otherwise. Must run before torch is
    imported (``RuntimeError`` if torch is loaded and a value would change)."""
    env = os.environ if env is None else env
    level = env.get("ATEN_CPU_CAPABILITY")
    if level:
        if level.lower() not in ATEN_LEVELS:
            raise ValueError(f"ATEN_CPU_CAPABILITY={level} is not a level torch knows ({', '.join(ATEN_LEVELS)}); "
                             f"torch would ignore it and run this CPU's own kernels")
        if level != level.lower():
            if env is os.environ and "torch" in sys.modules:
                raise RuntimeError(f"ATEN_CPU_CAPABILITY={level} must be spelled {level.lower()} before torch is "
                                   "imported; torch has ignored it")
            env["ATEN_CPU_CAPABILITY"] = level.lower()
    return pins(env)


# Each architecture's ATen levels, lowest first, and the CPU capabilities (``hardware()``) that run each.
_RUNS_ON = {"x86_64": {"default": ("DEFAULT", "AVX2", "AVX512"), "avx2": ("AVX2", "AVX512"), "avx512": ("AVX512",)},
            "arm64": {"default": ("apple", "sve", "neon"), "sve256": ("sve",)}}


def unsupported_pin(env: Mapping[str, str] | None = None) -> str | None:
    """A line refusing ``ATEN_CPU_CAPABILITY`` when this CPU cannot run the level it pins, else None. torch takes
    the level without asking the CPU: ``avx512`` on an AVX2 CPU runs AVX-512 instructions at the first kernel and
    the process dies of SIGILL (exit -4), with no word why. Reads the CPU's flags, not torch: call it before torch
    is imported (``pixal3d`` does, on import)."""
    env = os.environ if env is None else env
    level = (env.get("ATEN_CPU_CAPABILITY") or "").lower()
    if not level or level not in ATEN_LEVELS:
        return None  # unset, or a level torch does not know (normalise_pins names those)
    machine, have = arch(), hardware()
    levels = _RUNS_ON.get(machine)
    if levels is None:
        return None  # an architecture this check does not know: torch's own behaviour
    runnable = [name for name, runs_on in levels.items() if have in runs_on]
    if level in runnable:
        return None
    why = (f"it is a level of another architecture than this {machine} CPU's" if level not in levels else
           f"this CPU ({have}) lacks the instructions: torch would stop with SIGILL at its first kernel")
    return (f"ATEN_CPU_CAPABILITY={level} cannot run here ({why}); unset it, or pin one of "
            f"{', '.join(runnable)}")


def honoured(env: Mapping[str, str] | None = None) -> bool:
    """Whether the running torch uses the ATen level ``env`` pins (True when it pins none): the level torch
    runs, ``torch.backends.cpu.get_cpu_capability()``, is what made the bits, whatever the environment says."""
    import torch

    level = pins(env).get("ATEN_CPU_CAPABILITY")
    return level is None or torch.backends.cpu.get_cpu_capability() == level.upper()


def hardware() -> str:
    """The CPU's own capability, whatever the pins say: ``AVX512``, ``AVX2`` or ``DEFAULT`` on x86-64
    (read from the CPU flags); on arm64 ``apple`` (Apple Silicon), ``sve`` or ``neon``."""
    if arch() == "arm64":
        return "apple" if sys.platform == "darwin" else ("sve" if "sve" in _cpu_flags() else "neon")
    if arch() != "x86_64":
        return arch()
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512"
    if {"avx2", "fma"} <= flags:
        return "AVX2"
    return "DEFAULT"


def vendor() -> str:
    """The CPU's maker as MKL tells them apart (``Intel``, ``AMD``), from the vendor string; on arm64 and on
    unknown makers the empty string (the capability alone names the kind there)."""
    if arch() != "x86_64":
        return ""
    name = _cpu_field("vendor_id")
    if not name and sys.platform == "darwin":
        import subprocess

        name = subprocess.run(["sysctl", "-n", "machdep.cpu.vendor"], capture_output=True, text=True,
                              check=False).stdout.strip()
    return {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(name, name)


def cpu_kind() -> str:
    """The kind of CPU a golden is verified on: vendor, capability and AMX where present (``AMD AVX2``,
    ``Intel AVX512 AMX``); on arm64 the capability alone (``apple``). Pinned runs agree within a kind; between
    kinds they may not (module docstring), so a golden is compared only on the kinds it lists."""
    amx = " AMX" if arch() == "x86_64" and "amx_tile" in _cpu_flags() else ""
    return " ".join(part for part in (vendor(), hardware()) if part) + amx


def key(env: Mapping[str, str] | None = None) -> str:
    """The platform-and-kernels key of a run's fingerprints: ``<arch>-<family>`` for a pinned family;
    the hardware joins the key when the kernels follow it (unpinned, custom)."""
    name = family(env)
    if name in FAMILIES:
        return f"{arch()}-{name}"
    return f"{arch()}-{hardware().lower()}-{name}"


def recommended_pins() -> dict[str, str]:
    """The pins the tests and the golden writer use on this machine: on an x86-64 CPU with AVX2, ``avx2strict``
    on Intel and ``avx2pin`` on other makers; none elsewhere (arm64 has one kernel level, so nothing to pin).

    Why two: on an Intel CPU (measured on a Xeon with AVX-512 and AMX, 2 threads) MKL's AVX2 branch without its
    strict mode gives a GEMM's rows other bits when the matrix has other rows, and other bits again when MKL's
    dynamic threading is on (it is, until ``torch.set_num_threads`` turns it off). The project's exactness
    claims — a decode in tiles equals the untiled one, a query-chunked attention the one-shot one, a process
    that never set its thread count the test session — then fail there, while they hold on that CPU unpinned
    and under ``AVX2,STRICT``. On the AMD AVX2 CPUs the goldens were made on they hold under ``avx2pin``,
    which stays their family (its goldens were verified there; strict mode was not)."""
    if arch() == "x86_64" and hardware() in ("AVX2", "AVX512"):
        return dict(FAMILIES["avx2strict" if vendor() == "Intel" else "avx2pin"])
    return {}


def apply_recommended_pins(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set ``recommended_pins()`` in ``env`` (default ``os.environ``) unless it already sets any pin (a
    choice made by hand is kept) or says ``PIXAL3D_KERNEL_PINS=none`` (the CPU's own kernels). Returns the
    pins in effect. Must run before torch is imported: raises ``RuntimeError`` if torch is loaded and the
    pins would change."""
    env = os.environ if env is None else env
    if not pins(env) and env.get("PIXAL3D_KERNEL_PINS") != "none":
        wanted = recommended_pins()
        if wanted and env is os.environ and "torch" in sys.modules:
            raise RuntimeError("kernel pins must be set before torch is imported; import pixal3d.kernels first")
        env.update(wanted)
    return normalise_pins(env)


def describe() -> dict[str, Any]:
    """What run.json records of the kernels: architecture, the CPU's capability and the one torch uses, the
    pins in effect, their family and key (``unhonoured-…`` where torch ignored the ATen pin: the key says
    what ran), the kind of CPU, intra-op threads, the CPU's model."""
    import torch

    named = family() if honoured() else f"unhonoured-{family()}"
    return {"arch": arch(), "hardware": hardware(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "pins": pins(), "family": named, "key": key() if honoured() else f"{arch()}-{hardware().lower()}-{named}",
            "kind": cpu_kind(), "threads": torch.get_num_threads(), "cpu": _cpu_name()}


def _cpu_flags() -> set[str]:
    """The CPU's feature flags, lower case, without importing torch where the system says them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith(("flags", "Features")):  # x86, arm
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if sys.platform == "darwin":  # an Intel Mac: sysctl lists the leaf-1 and leaf-7 features
        import subprocess

        words = subprocess.run(["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                               capture_output=True, text=True, check=False).stdout.lower().split()
        return set(words)
    if "torch" in sys.modules:  # elsewhere (Windows): torch's cpuinfo, once torch is loaded anyway
        import torch

        return ({"avx2", "fma"} if torch.cpu._is_avx2_supported() else set()) | (
            {"avx512f", "avx512bw", "avx512vl", "avx512dq"} if torch.cpu._is_avx512_supported() else set())
    return set()


def _cpu_field(name: str) -> str:
    """One field of /proc/cpuinfo's first processor (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_name() -> str:
    return _cpu_field("model name") or platform.processor() or arch()
