"""Registered memory: a buffer a transport may read and write, and what a peer needs to address it.

Any C-contiguous CPU buffer registers: a torch tensor, a numpy array, an mmap, a bytearray. The
region keeps the buffer alive and exposes it as a flat byte view, so the software transports move
bytes straight between sockets (or a peer's mapping) and the registered memory, with no staging.
A CUDA tensor has no CPU view; only a backend that can register device memory (verbs with
GPUDirect) accepts one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from .work import RegistrationError


class RemoteRegion(msgspec.Struct, frozen=True, array_like=True):
    """What a peer needs to address a region: its virtual address, its length and the remote key."""

    addr: int
    length: int
    rkey: int

    def holds(self, addr: int, length: int) -> bool:
        return length >= 0 and self.addr <= addr and addr + length <= self.addr + self.length


@dataclass(frozen=True, eq=False)
class Located:
    """Where a buffer's bytes are: address, length, device, a byte view (None on a device) and its owner."""

    addr: int
    length: int
    device: str
    view: memoryview | None
    owner: Any


@dataclass(eq=False)
class MemoryRegion:
    """A registered local buffer; `lkey`/`rkey` are the keys the endpoint gave it."""

    buffer: Located
    lkey: int
    rkey: int

    @property
    def addr(self) -> int:
        return self.buffer.addr

    @property
    def length(self) -> int:
        return self.buffer.length

    @property
    def view(self) -> memoryview:
        if self.buffer.view is None:
            raise RegistrationError(f"region rkey={self.rkey} is {self.buffer.device} memory, with no CPU view")
        return self.buffer.view

    def remote(self) -> RemoteRegion:
        return RemoteRegion(addr=self.addr, length=self.length, rkey=self.rkey)


def locate(buffer: Any) -> Located:
    """The bytes behind a tensor, array, mmap or bytes-like object, checked to be contiguous and writable."""
    torch = _torch_if_tensor(buffer)
    if torch is not None:
        if not buffer.is_contiguous():
            raise RegistrationError("register: the tensor must be contiguous")
        length = buffer.numel() * buffer.element_size()
        if buffer.device.type != "cpu":
            return Located(buffer.data_ptr(), length, str(buffer.device), None, buffer)
        # A uint8 view shares the storage (bf16 has no numpy dtype, bytes do).
        array = buffer.view(torch.uint8).reshape(-1).numpy() if length else np.empty(0, np.uint8)
        return _from_array(array, owner=buffer)
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise RegistrationError("register: the array must be C-contiguous")
        return _from_array(buffer.reshape(-1).view(np.uint8), owner=buffer)
    try:
        array = np.frombuffer(buffer, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise RegistrationError(f"register: {type(buffer).__name__} is not a buffer ({exc})") from exc
    return _from_array(array, owner=buffer)


def _from_array(array: np.ndarray, owner: Any) -> Located:
    if not array.flags.writeable:
        raise RegistrationError("register: the buffer is read-only; a region must be writable")
    if array.nbytes == 0:
        raise RegistrationError("register: the buffer is empty")
    return Located(array.ctypes.data, array.nbytes, "cpu", memoryview(array), (owner, array))


def _torch_if_tensor(obj: Any):
    """The torch module when obj is a tensor; torch is imported only if the caller already has it."""
    import sys

    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(obj, torch.Tensor) else None
