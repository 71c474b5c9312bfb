"""Cross-memory attach: one-sided reads and writes of another process's private memory on this host,
by `process_vm_readv`/`process_vm_writev` (Linux 3.2+), the kernel copying straight between the two
address spaces, a scatter list per call. It is what the shm backend does for memory that is not in a
shared file (vLLM's KV cache, which its allocator places in private memory), as UCX's CMA transport
does. The kernel allows it between processes of one user unless Yama's ptrace_scope forbids it
(`unavailable_reason` says so).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path

import numpy as np

IOV_MAX = 1024  # iovecs per call (Linux's UIO_MAXIOV)
PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")


class CmaError(OSError):
    pass


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@functools.cache
def _calls():
    libc = ctypes.CDLL(None, use_errno=True)
    signature = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                 ctypes.c_ulong]
    for name in ("process_vm_readv", "process_vm_writev"):
        getattr(libc, name).restype = ctypes.c_ssize_t
        getattr(libc, name).argtypes = signature
    return libc.process_vm_readv, libc.process_vm_writev


def pid_namespace() -> str:
    """Two processes' pids mean the same process only within one pid namespace."""
    return os.readlink("/proc/self/ns/pid")


def unavailable_reason() -> str | None:
    """None when this host lets a process read a peer of its own user, else why not."""
    try:
        scope = int(PTRACE_SCOPE.read_text())
    except (OSError, ValueError):
        return None   # no Yama: the same user suffices
    if scope >= 2:
        return f"Yama's ptrace_scope is {scope}: only a privileged process may read another's memory"
    return None


def allow_peers() -> None:
    """Let any process of this user read this one's memory under Yama's ptrace_scope 1 (which
    otherwise allows only ancestors); a no-op where there is no Yama."""
    if not PTRACE_SCOPE.exists():
        return
    pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(-1).value
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, ctypes.c_ulong(pr_set_ptracer_any), 0, 0, 0)


def read(pid: int, local: memoryview, local_offsets: np.ndarray, remote_addrs: np.ndarray,
         lengths: np.ndarray) -> None:
    """local[local_offsets[i] : +lengths[i]] = process `pid`'s bytes at remote_addrs[i], for every i."""
    _transfer(_calls()[0], pid, local, local_offsets, remote_addrs, lengths)


def write(pid: int, local: memoryview, local_offsets: np.ndarray, remote_addrs: np.ndarray,
          lengths: np.ndarray) -> None:
    """Process `pid`'s bytes at remote_addrs[i] = local[local_offsets[i] : +lengths[i]], for every i."""
    _transfer(_calls()[1], pid, local, local_offsets, remote_addrs, lengths)


def _transfer(call, pid: int, local: memoryview, local_offsets: np.ndarray, remote_addrs: np.ndarray,
              lengths: np.ndarray) -> None:
    base = np.frombuffer(local, dtype=np.uint8).ctypes.data
    for start in range(0, len(lengths), IOV_MAX):
        part = slice(start, start + IOV_MAX)
        n = len(lengths[part])
        mine, theirs = (_Iovec * n)(), (_Iovec * n)()
        for i, (offset, addr, length) in enumerate(zip(local_offsets[part].tolist(), remote_addrs[part].tolist(),
                                                       lengths[part].tolist())):
            mine[i].iov_base, mine[i].iov_len = base + offset, length
            theirs[i].iov_base, theirs[i].iov_len = addr, length
        want = int(lengths[part].sum())
        done = call(pid, mine, n, theirs, n, 0)
        if done < 0:
            code = ctypes.get_errno()
            raise CmaError(code, f"{call.__name__} of process {pid}: {os.strerror(code)}"
                           + (" (another user's process, or ptrace not allowed)" if code == errno.EPERM else ""))
        if done != want:   # the kernel stops at the first remote page it cannot reach
            raise CmaError(errno.EFAULT, f"{call.__name__} of process {pid} moved {done} of {want} bytes")
