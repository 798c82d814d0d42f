"""Point-to-point links and the request's broadcasts, over ``torch.distributed``.

Every directed link (``Topology.links``) has its own two-rank process group, so each NCCL
communicator carries one direction only: a ring of two ranks is where xDiT deadlocks with send and
receive on one communicator (xDiT issue #310); gloo does not care. Every message's shape is known in
advance from the schedule (no shape handshake). An ``Inbox`` keeps the next receive posted while the
current message is used (gloo moves a message only once its receive is posted, so this overlaps the
transfer with compute); an ``Outbox`` keeps at most ``SEND_DEPTH`` sends in flight. A request posts
exactly the receives its schedule implies and checks at the end that each was taken.

Gloo carries CPU tensors only: CPU and MPS tensors travel through host memory (``to("cpu")``).
"""
from __future__ import annotations

import collections
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..devices import kind
from .failure import FailureBoard, wait_work

SEND_DEPTH = 2


@dataclass
class Wire:
    """How tensors travel: the backend's device, the failure board and timeout every wait uses, and where this
    rank's data group sits in the job (its ranks are ``base + rank``; ``group`` carries its broadcasts)."""

    device: torch.device     # where the backend wants tensors (cpu for gloo, cuda:i for nccl)
    board: FailureBoard
    timeout_s: float
    base: int = 0            # torchrun's rank of the group's rank 0
    group: Any = None        # the group's process group (None: the whole job)

    @property
    def rank(self) -> int:
        """This rank within its data group (the failure board's)."""
        return self.board.rank

    @property
    def threaded(self) -> bool:
        return kind(self.device).threaded_waits

    def wait(self, work: Any, what: str, peer: int) -> None:
        wait_work(work, board=self.board, timeout_s=self.timeout_s, what=what, peer=peer, threaded=self.threaded)


@dataclass
class Outbox:
    """Sends to one peer over one link's group."""

    wire: Wire
    peer: int
    group: Any
    name: str
    bytes_sent: int = 0
    messages: int = 0
    waited_s: float = 0.0    # time spent waiting for sends to complete (the send queue was full, or the drain)
    _pending: collections.deque = field(default_factory=collections.deque)

    def send(self, tensor: torch.Tensor) -> None:
        payload = tensor.detach().to(self.wire.device).contiguous()
        self._pending.append((dist.isend(payload, self.wire.base + self.peer, group=self.group), payload))
        self.bytes_sent += payload.numel() * payload.element_size()
        self.messages += 1
        while len(self._pending) > SEND_DEPTH:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, _ = self._pending.popleft()
        start = time.perf_counter()
        self.wire.wait(work, f"sending {self.name} to rank {self.peer}", self.peer)
        self.waited_s += time.perf_counter() - start

    def drain(self) -> None:
        while self._pending:
            self._wait_oldest()


class Inbox:
    """Receives the ``expected`` messages ``[(shape, dtype), ...]`` from one peer, in order."""

    def __init__(self, wire: Wire, peer: int, group: Any, name: str,
                 expected: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self.wire, self.peer, self.group, self.name = wire, peer, group, name
        self.expected, self.device = expected, device
        self.taken = 0
        self.waited_s = 0.0  # time ``take`` spent waiting for messages not in yet (the pipeline's bubbles, seen here)
        self._posted = self._post(0)

    def _post(self, index: int) -> tuple[Any, torch.Tensor] | None:
        if index >= len(self.expected):
            return None
        shape, dtype = self.expected[index]
        buffer = torch.empty(shape, dtype=dtype, device=self.wire.device)
        return dist.irecv(buffer, self.wire.base + self.peer, group=self.group), buffer

    def take(self) -> torch.Tensor:
        """The next message (blocks until it is in)."""
        if self._posted is None:
            raise RuntimeError(f"{self.name} from rank {self.peer}: all {len(self.expected)} expected messages "
                               f"already taken (schedule mismatch)")
        work, buffer = self._posted
        start = time.perf_counter()
        self.wire.wait(work, f"receiving {self.name} #{self.taken} from rank {self.peer}", self.peer)
        self.waited_s += time.perf_counter() - start
        self.taken += 1
        self._posted = self._post(self.taken)
        return buffer.to(self.device)

    def finish(self) -> None:
        if self.taken != len(self.expected):
            raise RuntimeError(f"{self.name} from rank {self.peer}: took {self.taken} of {len(self.expected)} "
                               f"expected messages (schedule mismatch)")


# -- broadcasts of a request's inputs and result ----------------------------------------------------
def pack(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A picklable skeleton of ``obj`` (tensors, SparseTensors, dicts, tuples, None) with tensors appended to
    ``tensors``; a coords tensor shared by several SparseTensors travels once."""
    from ..nn.sparse_tensor import SparseTensor

    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("tensor", len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, SparseTensor):
        seen = next((i for i, t in enumerate(tensors) if t is obj.coords), None)
        coords = pack(obj.coords, tensors) if seen is None else ("tensor", seen, tuple(obj.coords.shape),
                                                                  obj.coords.dtype)
        return ("sparse", pack(obj.feats, tensors), coords)
    if isinstance(obj, dict):
        return ("dict", {k: pack(v, tensors) for k, v in obj.items()})
    if isinstance(obj, tuple):
        return ("tuple", [pack(v, tensors) for v in obj])
    raise TypeError(f"cannot send a {type(obj).__name__} to the other ranks")


def unpack(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild what ``pack`` described from the received ``tensors``."""
    from ..nn.sparse_tensor import SparseTensor

    if skeleton is None:
        return None
    kind = skeleton[0]
    if kind == "tensor":
        return tensors[skeleton[1]]
    if kind == "sparse":
        return SparseTensor(unpack(skeleton[1], tensors), unpack(skeleton[2], tensors))
    if kind == "tuple":
        return tuple(unpack(v, tensors) for v in skeleton[1])
    return {k: unpack(v, tensors) for k, v in skeleton[1].items()}


def tensor_specs(skeleton: Any, out: dict[int, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    """Index → (shape, dtype) of every tensor in ``skeleton``."""
    if skeleton is None:
        return out
    kind = skeleton[0]
    if kind == "tensor":
        out[skeleton[1]] = (skeleton[2], skeleton[3])
    elif kind == "sparse":
        tensor_specs(skeleton[1], out)
        tensor_specs(skeleton[2], out)
    else:
        for v in (skeleton[1].values() if kind == "dict" else skeleton[1]):
            tensor_specs(v, out)
    return out


def broadcast_object(obj: Any, src: int, wire: Wire, what: str) -> Any:
    """``obj`` (given on rank ``src``) on every rank: pickled, sent as two tensor broadcasts (so the
    wait watches the failure board like every other wait)."""
    data = None
    if wire.rank == src:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
    size = broadcast_tensor(size, (1,), torch.int64, src, wire, torch.device("cpu"), f"size of {what}")
    data = broadcast_tensor(data, (int(size.item()),), torch.uint8, src, wire, torch.device("cpu"), what)
    return pickle.loads(data.cpu().numpy().tobytes())


def broadcast_tensor(tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, src: int, wire: Wire,
                     device: torch.device, what: str) -> torch.Tensor:
    """``tensor`` (given on ``src``, a rank of this data group) on every rank of the group, on ``device``."""
    if wire.rank == src:
        buffer = tensor.detach().to(wire.device).contiguous()
    else:
        buffer = torch.empty(shape, dtype=dtype, device=wire.device)
    wire.wait(dist.broadcast(buffer, src=wire.base + src, group=wire.group, async_op=True),
              f"broadcast of {what} from rank {src}", src)
    return buffer.to(device) if wire.rank != src else tensor
