"""ATen's dispatch table, as shipped with the installed torch: which ops have an MPS kernel.

Source: ``torchgen/packaged/ATen/native/native_functions.yaml``, the file every ATen kernel
registration is generated from (``RegisterMPS.cpp`` on a macOS build included). One entry per op
overload; its ``dispatch:`` section maps comma-separated dispatch keys to kernels. How an op is
classified for a dense (strided) tensor on ``mps``:

====================  ==========================================================================
``Kernel``            rule
====================  ==========================================================================
``MPS``               the key ``MPS`` is listed (``SparseMPS``, ``NestedTensorMPS``... serve other
                      layouts and do not count); a ``structured_delegate`` op also has the keys of
                      the ``out=`` overload its dense kernels are generated from
``COMPOSITE_EXPLICIT``  ``CompositeExplicitAutograd[NonFunctional]``: one backend-agnostic kernel
                      that calls other ops (ops an entry ``autogen``-erates are of this kind)
``COMPOSITE_IMPLICIT``  ``CompositeImplicitAutograd``, or no ``dispatch:`` section at all (the
                      default): the op decomposes into other ops above the backend
``NONE``              only other backends (``CPU, CUDA: ...``): a Mac run raises ``NotImplementedError``
                      (or copies to the CPU and back under ``PYTORCH_ENABLE_MPS_FALLBACK=1``)
``UNKNOWN``           not an ATen op of this table (a custom or ``prims`` op)
====================  ==========================================================================

Whether a composite op runs on ``mps`` depends on the ops it calls; ``pixal3d.audit.standin``
records those calls and they are classified in turn. The table does not say which dtypes an MPS
kernel accepts (float64 never, on any op: see ``pixal3d.audit.mps``), and a few MPS kernels are
registered from C++ outside this file; such an op reads as ``NONE`` here (a conservative error).
"""
from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

logger = logging.getLogger(__name__)

COMPOSITE_EXPLICIT_KEYS = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
COMPOSITE_IMPLICIT_KEYS = ("CompositeImplicitAutograd", "CompositeImplicitAutogradNestedTensor")


class Kernel(enum.Enum):
    """What ``mps`` runs for one op overload (see the module docstring for the rules)."""

    MPS = "MPS kernel"
    COMPOSITE_EXPLICIT = "composite (explicit)"
    COMPOSITE_IMPLICIT = "composite (implicit)"
    NONE = "no MPS kernel"
    UNKNOWN = "not in ATen's table"

    @property
    def runs_on_mps(self) -> bool:
        """True when the op itself can run on mps (a composite's callees are judged separately)."""
        return self in (Kernel.MPS, Kernel.COMPOSITE_EXPLICIT, Kernel.COMPOSITE_IMPLICIT)


@dataclass(frozen=True)
class OpEntry:
    """One ``func:`` entry: its overload name (``add.Tensor``, ``zeros``), dispatch keys, delegate."""

    name: str
    keys: frozenset[str]  # its own dispatch: section only
    structured_delegate: str | None = None
    has_dispatch: bool = True


def native_functions_path() -> Path:
    """``native_functions.yaml`` of the installed torchgen (shipped in the torch wheel)."""
    import torchgen

    path = Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: this torch install ships no ATen dispatch table; reinstall torch "
            f"from a wheel (torchgen/packaged is part of it) or pass the path of native_functions.yaml")
    return path


def parse_entries(raw: Iterable[Mapping]) -> dict[str, OpEntry]:
    """Overload name → ``OpEntry`` for the parsed YAML list (``autogen`` ops included)."""
    entries: dict[str, OpEntry] = {}
    for item in raw:
        name = str(item["func"]).split("(", 1)[0].strip()
        dispatch = item.get("dispatch")
        keys = frozenset(k.strip() for spec in (dispatch or {}) for k in str(spec).split(","))
        entries[name] = OpEntry(name, keys, item.get("structured_delegate"), dispatch is not None)
        for generated in str(item.get("autogen") or "").split(","):
            if generated.strip():
                entries.setdefault(generated.strip(), OpEntry(generated.strip(), frozenset(COMPOSITE_EXPLICIT_KEYS[:1])))
    return entries


class DispatchTable:
    """Op overload → ``Kernel`` on mps. ``op`` is ``"aten::add.Tensor"``, ``"add.Tensor"`` or ``"zeros"``."""

    def __init__(self, entries: Mapping[str, OpEntry], source: str = "<entries>"):
        self.entries = dict(entries)
        self.source = source

    @classmethod
    def from_yaml(cls, path: str | Path | None = None) -> DispatchTable:
        path = Path(path) if path is not None else native_functions_path()
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        return cls(parse_entries(raw), str(path))

    def keys(self, op: str) -> frozenset[str] | None:
        """The dispatch keys that serve ``op`` (a structured op's come from its ``out=`` delegate)."""
        entry = self.entries.get(_overload_name(op))
        if entry is None:
            return None
        if entry.structured_delegate is not None:  # dense kernels generated from the out= op's
            delegate = self.entries.get(entry.structured_delegate)
            return entry.keys | (delegate.keys if delegate is not None else frozenset())
        return entry.keys

    def kernel(self, op: str) -> Kernel:
        """How mps runs ``op``; see the module docstring."""
        entry = self.entries.get(_overload_name(op))
        if entry is None or op.split("::", 1)[0] not in ("aten", op):
            return Kernel.UNKNOWN
        keys = self.keys(op)
        if "MPS" in keys:
            return Kernel.MPS
        if keys & set(COMPOSITE_EXPLICIT_KEYS):
            return Kernel.COMPOSITE_EXPLICIT
        if keys & set(COMPOSITE_IMPLICIT_KEYS) or (not entry.has_dispatch and entry.structured_delegate is None):
            return Kernel.COMPOSITE_IMPLICIT
        return Kernel.NONE


def _overload_name(op: str) -> str:
    """``aten::add.Tensor`` → ``add.Tensor``; ``aten::zeros`` / ``zeros.default`` → ``zeros``."""
    name = op.split("::", 1)[1] if "::" in op else op
    return name.removesuffix(".default")


@functools.lru_cache(maxsize=1)
def installed_table() -> DispatchTable:
    """The installed torch's table (parsed once per process, about a second)."""
    table = DispatchTable.from_yaml()
    logger.debug("read %d op overloads from %s", len(table.entries), table.source)
    return table
