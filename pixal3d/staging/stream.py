"""Stream a model's blocks to the device a few at a time: the ``stream`` policy's mechanism.

A model names the ``nn.ModuleList``s whose children are its *units* (the flow transformers' blocks, say).
``stream_model`` replaces each with a ``StreamedList`` over the same children (parameter names do not
change) whose tensors stay on ``meta``; each unit keeps where its bytes come from: a range of the checkpoint file
(``FileSlice``, read straight into the device's buffer, never mapped into the process), the memory-mapped file,
or a copy in host memory. When the model asks for a unit — ``for block in
self.blocks`` or ``self.blocks[i]`` — the device's ``WeightStream`` materialises it, lets the unit before it
go, and starts copying the one expected next, so that copy overlaps the current unit's compute:

- CPU: a reader thread reads the next unit from the file into fresh process memory (``copy=True``: what a
  device copy costs, for measurements), or only reads its mapped pages in (``copy=False``: the unit's tensors
  are views of the mapped file, the zero-copy path of a plain CPU run);
- MPS (unified memory): a reader thread reads the next unit's pages in; the copy to the device runs on the
  main thread when the unit is used (MPS kernels are not launched from other threads);
- CUDA: a reader thread reads the next unit into pinned host memory (unless its source is pinned already)
  and queues its host-to-device copy on a side stream; the compute stream waits for that copy's event.

"Expected next" is learned: the unit that followed last time (the first time, the next one in the model).
At most two units are on the device at once (the one in use and the one being copied); the rest of the model
(embeddings, norms, heads) stays resident. The bytes are those of a whole load, cast to the same dtypes, so
a streamed model computes the same bits.

On the CPU the process's heap is the device's memory, and glibc's ``malloc`` keeps the pages of freed activations
(its heap fragments across the blocks' ~25-100 MB allocations: measured at real width, 4096 tokens, ~25 MB more
kept per block, 0.65 GiB over a 30-block forward, beyond what the plan counts). So a CPU
stream gives the freed pages back (``malloc_trim``) each time it lets a unit go, as a device allocator's freed
block is reused by the next: the process then holds what is live, two blocks and one block's work.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes: each tensor of a unit's flat buffer starts on a multiple of this
PAGE = 4096
IN_FLIGHT = 2  # units on the device at once: the one in use and the one being copied


@dataclass(frozen=True)
class StreamLayout:
    """What streaming a model holds, for the plan (from its safetensors header, nothing loaded): the bytes that
    stay resident and each unit's bytes."""

    resident_bytes: int
    unit_bytes: tuple[int, ...]

    @property
    def streamed_bytes(self) -> int:
        """Bytes one pass over every unit copies to the device."""
        return sum(self.unit_bytes)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, int], unit: str) -> StreamLayout:
        """``tensors``: name -> bytes; ``unit``: a regular expression whose match at the start of a name is its
        unit (``blocks\\.\\d+\\.``: the flow transformers' blocks); names it does not match stay resident."""
        pattern, units, resident = re.compile(unit), {}, 0
        for name, nbytes in tensors.items():
            match = pattern.match(name)
            if match is None:
                resident += nbytes
            else:
                units[match.group(0)] = units.get(match.group(0), 0) + nbytes
        return cls(resident, tuple(units.values()))


def in_flight_bytes(layouts: Iterable[StreamLayout]) -> int:
    """The most bytes of units on the device at once for models sharing one stream: the ``IN_FLIGHT`` largest."""
    sizes = sorted((size for layout in layouts for size in layout.unit_bytes), reverse=True)
    return sum(sizes[:IN_FLIGHT])


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


REFETCH = "delete it and re-fetch it with pixal3d-fetch"
"""What to do about a weights file that is cut short or corrupt (every such message ends with it)."""


class WeightsCutShort(RuntimeError):
    """A checkpoint ended before a tensor a stream was reading (the file was truncated after it was checked)."""


@dataclass(frozen=True)
class FileSlice:
    """A tensor's bytes at ``offset`` in the file at ``path`` (a safetensors checkpoint), little-endian as stored.
    Read with ``read_into``: through the page cache into the caller's buffer, never mapped into the process."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def read_into(self, out: torch.Tensor) -> None:
        """Fill ``out`` (a contiguous CPU tensor of this dtype and shape) with the file's bytes."""
        if out.dtype != self.dtype or tuple(out.shape) != self.shape or not out.is_contiguous():
            raise ValueError(f"{self.path}@{self.offset}: cannot read {self.dtype} {self.shape} into {out.dtype} "
                             f"{tuple(out.shape)}")
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(buffer):
                count = os.preadv(fd, [buffer[done:]], self.offset + done)
                if count <= 0:
                    raise WeightsCutShort(f"weights file {self.path} ends before byte {self.offset + len(buffer)}: "
                                          f"it was cut short while this run read it; {REFETCH}")
                done += count
        finally:
            os.close(fd)

    def read(self) -> torch.Tensor:
        """The tensor, in fresh memory."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out


def file_slices(path: str | os.PathLike, header: Mapping[str, Mapping[str, object]],
                header_bytes: int) -> dict[str, FileSlice]:
    """Each tensor of a safetensors file as a ``FileSlice`` (``header``: its tensors' ``dtype``, ``shape``,
    ``data_offsets``; ``header_bytes``: the JSON header's length)."""
    start = 8 + header_bytes
    out = {}
    for name, info in header.items():
        dtype = SAFETENSORS_DTYPES.get(str(info["dtype"]))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which cannot be streamed")
        out[name] = FileSlice(str(path), start + int(info["data_offsets"][0]), dtype, tuple(info["shape"]))
    return out


@dataclass(frozen=True)
class TensorSource:
    """One tensor of a unit: where it sits in the module (``owner._parameters`` or ``_buffers`` under ``key``),
    its bytes on the host (``source``) and the dtype the model holds it in."""

    owner: nn.Module
    key: str
    source: torch.Tensor | FileSlice
    dtype: torch.dtype
    parameter: bool

    @property
    def nbytes(self) -> int:
        return self.source.numel() * torch.empty((), dtype=self.dtype).element_size()


class Unit:
    """One streamed block: its tensors' sources and, while it is on the device, the flat buffer they view."""

    def __init__(self, name: str, module: nn.Module, tensors: Sequence[TensorSource]):
        self.name = name
        self.module = module
        self.tensors = tuple(tensors)
        self.offsets, total = [], 0
        for t in self.tensors:
            self.offsets.append(total)
            total += -(-t.nbytes // ALIGN) * ALIGN
        self.nbytes = total
        self.next: Unit | None = None  # the unit after this one in its model (the first guess of what comes next)
        self.resident = False

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {self.nbytes} bytes, resident={self.resident})"

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The unit's tensors as views of ``flat`` (a uint8 buffer of ``nbytes``)."""
        return [flat[o:o + t.nbytes].view(t.dtype).view(t.source.shape) for o, t in zip(self.offsets, self.tensors)]

    def assign(self, tensors: Sequence[torch.Tensor]) -> None:
        """Put ``tensors`` (on the device, in the unit's order) in the unit's modules."""
        for t, value in zip(self.tensors, tensors, strict=True):
            if t.parameter:
                t.owner._parameters[t.key] = nn.Parameter(value, requires_grad=False)
            else:
                t.owner._buffers[t.key] = value
        self.resident = True

    def clear(self) -> None:
        """Back to ``meta``: the device memory goes when nothing else holds it."""
        for t in self.tensors:
            meta = torch.empty(t.source.shape, dtype=t.dtype, device="meta")
            if t.parameter:
                t.owner._parameters[t.key] = nn.Parameter(meta, requires_grad=False)
            else:
                t.owner._buffers[t.key] = meta
        self.resident = False


@dataclass
class StreamStats:
    """What a stream did: units materialised, bytes copied to the device, seconds the compute waited for a copy,
    units whose copy had not been started ahead (a wrong guess, or the first unit)."""

    units: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0
    unprefetched: int = 0

    def to_dict(self) -> dict[str, float]:
        return {"units": self.units, "bytes": self.bytes, "wait_seconds": round(self.wait_seconds, 3),
                "unprefetched": self.unprefetched}


@dataclass
class _Fetched:
    tensors: list[torch.Tensor]
    flat: torch.Tensor | None = None
    event: object | None = None  # a torch.cuda.Event the compute stream waits for
    keep: list[torch.Tensor] = field(default_factory=list)  # pinned staging, alive until the copy is waited for


class WeightStream:
    """The units of one device in flight: the one in use and the one expected next (see the module doc).

    ``copy``: on the CPU, copy each unit into fresh memory (as onto a device) instead of viewing the mapped
    file; other devices always copy. ``stats`` counts what was streamed.
    """

    def __init__(self, device: torch.device | str, *, copy: bool = True):
        self.device = torch.device(device)
        self.copy = copy or self.device.type != "cpu"
        self.stats = StreamStats()
        self._last: Unit | None = None  # the unit used last (kept after it is let go: to learn what follows it)
        self._resident: dict[int, Unit] = {}
        self._pending: dict[int, tuple[Unit, concurrent.futures.Future]] = {}
        self._successor: dict[int, Unit] = {}
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._side = None
        if self.device.type == "cuda":
            self._side = torch.cuda.Stream(device=self.device)

    @property
    def reads_files(self) -> bool:
        """Whether units are best read from the file straight into their buffers (``FileSlice`` sources: CPU copies,
        CUDA's pinned staging) rather than viewed through a memory map (MPS, the CPU's zero-copy path)."""
        return self.copy and self.device.type in ("cpu", "cuda")

    # -- what a StreamedList calls ---------------------------------------------------------------
    def use(self, unit: Unit) -> None:
        """Make ``unit`` resident (waiting for its copy if one is under way) after letting every other resident unit
        go, then start copying the unit expected after it: never more than ``IN_FLIGHT`` units on the device."""
        if self._last is not None and self._last is not unit:
            self._successor[id(self._last)] = unit
        for other in [u for u in self._resident.values() if u is not unit]:
            self._evict(other)
        if not unit.resident:
            pending = self._pending.pop(id(unit), None)
            start = time.perf_counter()
            if pending is None:  # a wrong guess (or none): drop it before copying this one
                self._cancel_pending()
                self.stats.unprefetched += 1
                fetched = self._fetch(unit)
            else:
                fetched = pending[1].result()
            self._install(unit, fetched)
            self.stats.wait_seconds += time.perf_counter() - start
            self.stats.units += 1
            self.stats.bytes += unit.nbytes
        self._resident[id(unit)] = unit
        self._last = unit
        self._prefetch_after(unit)

    def done(self, unit: Unit) -> None:
        """``unit`` was the last one a pass asked for (a forward's last block): let it go now, and start the copy
        of what followed it last time (the next forward's first block)."""
        if unit.resident:
            self._evict(unit)
        self._prefetch_after(unit)

    def _prefetch_after(self, unit: Unit) -> None:
        following = self._successor.get(id(unit), unit.next)
        if following is not None and following is not unit:
            self._prefetch(following)

    def drop(self, units: Sequence[Unit]) -> None:
        """Forget these units (their model is released): evict them and drop copies under way."""
        ids = {id(u) for u in units}
        if any(k in ids for k in self._pending):
            self._cancel_pending()
        for unit in units:
            if unit.resident:
                self._evict(unit)
            self._successor.pop(id(unit), None)
        if self._last is not None and id(self._last) in ids:
            self._last = None
        for key in [k for k, v in self._successor.items() if id(v) in ids]:
            del self._successor[key]

    def close(self) -> None:
        """Stop the reader thread (pending copies are dropped)."""
        self._cancel_pending()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    # -- copies --------------------------------------------------------------------------------------
    def _cancel_pending(self) -> None:
        """Drop every copy under way; one that has started is waited for, so its memory is gone on return."""
        for _, future in self._pending.values():
            if not future.cancel():
                concurrent.futures.wait([future])
        self._pending.clear()

    def _prefetch(self, unit: Unit) -> None:
        if unit.resident or id(unit) in self._pending:
            return
        self._cancel_pending()  # one copy ahead at most: an older guess is dropped
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-stream")
        self._pending[id(unit)] = (unit, self._reader.submit(self._fetch, unit))

    def _fetch(self, unit: Unit) -> _Fetched:
        """The unit's tensors on the device (CPU, CUDA) or its pages read in (MPS, and CPU without ``copy``)."""
        kind = self.device.type
        if kind == "cuda":
            return self._fetch_cuda(unit)
        if kind == "cpu" and self.copy:
            flat = torch.empty(unit.nbytes, dtype=torch.uint8)
            views = unit.views(flat)
            for view, t in zip(views, unit.tensors):
                _copy_into(view, t.source)
            return _Fetched(views, flat)
        for t in unit.tensors:  # read the pages in (the file is mapped): the copy or the view then costs no I/O
            _touch(t.source)
        return _Fetched([])

    def _fetch_cuda(self, unit: Unit) -> _Fetched:
        keep = []
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            flat = torch.empty(unit.nbytes, dtype=torch.uint8, device=self.device)
            views = unit.views(flat)
            for view, t in zip(views, unit.tensors):
                host = t.source
                if isinstance(host, FileSlice) or not host.is_pinned():  # staged in pinned memory: the copy is async
                    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
                    _copy_into(pinned, host)
                    host = pinned
                    keep.append(host)
                if host.dtype == view.dtype:
                    view.copy_(host, non_blocking=True)
                else:  # the file's dtype over the link, the cast on the device (a cross-dtype copy_ would cast
                    staged = torch.empty(host.shape, dtype=host.dtype, device=self.device)  # on the host, blocking)
                    staged.copy_(host, non_blocking=True)
                    view.copy_(staged)
            event = torch.cuda.Event()
            event.record(self._side)
        return _Fetched(views, flat, event, keep)

    def _install(self, unit: Unit, fetched: _Fetched) -> None:
        kind = self.device.type
        if kind == "cuda":
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(fetched.event)
            fetched.flat.record_stream(compute)  # made on the side stream: not reused before compute is done
            unit.assign(fetched.tensors)
        elif kind == "cpu" and not self.copy:
            unit.assign([t.source if t.source.dtype == t.dtype else t.source.to(t.dtype) for t in unit.tensors])
        elif fetched.flat is not None:
            unit.assign(fetched.tensors)
        else:  # mps: one buffer on the device, filled from the pages just read
            flat = torch.empty(unit.nbytes, dtype=torch.uint8, device=self.device)
            views = unit.views(flat)
            for view, t in zip(views, unit.tensors):
                view.copy_(t.source)
            unit.assign(views)

    def _evict(self, unit: Unit) -> None:
        unit.clear()
        self._resident.pop(id(unit), None)
        if self.device.type == "cpu":
            release_freed_heap()


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None


_MALLOC_TRIM = _malloc_trim()


def release_freed_heap() -> bool:
    """Give the pages of freed heap memory back to the OS (glibc's ``malloc_trim(0)``), so the process holds what is
    live, not what its activations once took (see the module doc). False where the C library has no such call."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def _copy_into(out: torch.Tensor, source: torch.Tensor | FileSlice) -> None:
    """``out`` (contiguous, on the CPU) = ``source`` cast to ``out``'s dtype: a file range read straight in."""
    if isinstance(source, FileSlice):
        if source.dtype == out.dtype:
            source.read_into(out)
            return
        source = source.read()
    out.copy_(source)


def _touch(tensor: torch.Tensor) -> None:
    """Read one byte of every page of ``tensor`` (a mapped file's pages come in from the disk)."""
    if tensor.numel():
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        flat[::PAGE].sum()


class StreamedList(nn.ModuleList):
    """A ``ModuleList`` whose children are streamed units: iterating it or indexing it materialises the unit
    asked for through the device's ``WeightStream`` (see the module doc). ``children()`` and ``modules()`` do not:
    they show the structure (tensors on ``meta`` unless in use)."""

    def __init__(self, modules: Sequence[nn.Module], units: Sequence[Unit], stream: WeightStream):
        super().__init__(modules)
        self.units = tuple(units)  # plain attributes: neither submodules nor state
        self.stream = stream

    def __getitem__(self, index: int | slice) -> nn.Module | list[nn.Module]:
        if isinstance(index, slice):
            return _StreamedSlice(self, range(len(self))[index])
        unit = self.units[index]
        self.stream.use(unit)
        return unit.module

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(_StreamedSlice(self, range(len(self))))

    def release_units(self) -> None:
        """The model is released: drop this list's units from the stream."""
        self.stream.drop(self.units)


class _StreamedSlice:
    """Some units of a ``StreamedList`` in order (``stage[:-1]``): each materialised as iteration reaches it, the
    last let go when the iteration ends."""

    def __init__(self, owner: StreamedList, indices: range):
        self.owner, self.indices = owner, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> nn.Module:
        return self.owner[self.indices[index]]

    def __iter__(self) -> Iterator[nn.Module]:
        last = None
        for i in self.indices:
            last = self.owner.units[i]
            yield self.owner[i]
        if last is not None:
            self.owner.stream.done(last)


def stream_model(model: nn.Module, lists: Sequence[str], sources: Mapping[str, torch.Tensor],
                 stream: WeightStream) -> nn.Module:
    """Stream the children of the ``ModuleList``s at ``lists`` (module paths) of ``model``: their tensors must be
    on ``meta``; ``sources`` maps each of their state-dict keys to its host tensor (any dtype: cast to the
    model's on the way to the device). Returns ``model`` (its lists replaced by ``StreamedList``s)."""
    units: list[Unit] = []
    for path in lists:
        container = model.get_submodule(path)
        if not isinstance(container, nn.ModuleList):
            raise TypeError(f"{type(model).__name__}.{path} is a {type(container).__name__}, not a ModuleList: only "
                            f"a list's children can be streamed")
        mine = []
        for index, child in enumerate(container.children()):
            tensors = []
            for sub_name, sub in child.named_modules():
                for table, parameter in ((sub._parameters, True), (sub._buffers, False)):
                    for key, tensor in table.items():
                        if tensor is None:
                            continue
                        name = ".".join(p for p in (path, str(index), sub_name, key) if p)
                        if name not in sources:
                            raise KeyError(f"no source for {name}: every tensor of a streamed unit needs one")
                        if not tensor.is_meta:
                            raise ValueError(f"{name} is already loaded; build the model on meta to stream it")
                        if tuple(sources[name].shape) != tuple(tensor.shape):
                            raise ValueError(f"{name}: source {tuple(sources[name].shape)} vs model "
                                             f"{tuple(tensor.shape)}")
                        tensors.append(TensorSource(sub, key, sources[name], tensor.dtype, parameter))
            mine.append(Unit(f"{path}.{index}", child, tensors))
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, StreamedList(list(container.children()), mine, stream))
        units += mine
    for before, after in zip(units, units[1:] + units[:1]):  # cyclic: a forward's last block, then the first
        before.next = after
    return model


def streamed_units(model: nn.Module) -> list[Unit]:
    """Every streamed unit of ``model`` (empty for a model that is not streamed)."""
    return [u for m in model.modules() if isinstance(m, StreamedList) for u in m.units]


def release_streams(model: nn.Module) -> None:
    """Drop ``model``'s units from their stream (its release: nothing of it stays on the device)."""
    for module in model.modules():
        if isinstance(module, StreamedList):
            module.release_units()


def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes per second of a host-to-device copy on ``device``, the best of ``repeats`` copies of ``nbytes``
    (pinned host memory on CUDA, plain memory elsewhere): what one streamed unit's copy runs at."""
    device = torch.device(device)
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(host, non_blocking=pin)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)
