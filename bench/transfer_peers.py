"""The same KV-block transfer through other libraries: Mooncake's Transfer Engine and NIXL.

What is measured: one process (the owner, standing in for the prefill engine) registers a pool of
`pool_blocks` blocks of `block_bytes` bytes; a second process (the reader, standing in for the
decode engine) registers its own pool and reads the owner's block `src[i]` into its block `dst[i]`
for every i, with the scattered ids of `transfer_pattern.scattered_blocks`. The figure is the
bytes moved over the wall time of one transfer, median of `repeats` after one warm-up; after every
transfer the reader checks every byte of its destination blocks, and at the end that no other
block of its pool was written.

How fair it is, i.e. what each library is given:
- Both pools are registered once, before any timing, as a serving engine does at start-up.
- Each library gets one entry per block (no coalescing of adjacent ids on our side) and the whole
  transfer submitted through its batch API; the timer runs from submitting the request to its
  completion. Turning block ids into addresses / indices is outside the timer, for every peer.
- Mooncake (TCP transport, P2PHANDSHAKE metadata, no etcd): `batch_transfer_sync_read` in
  batches of at most `MOONCAKE_BATCH` entries, one after another. Its TCP transport queues at most
  1,024 transfers per peer by default (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER) and fails the
  overflow ("queue-full"), so more in flight at once is not something it allows out of the box.
  Mooncake does not merge adjacent entries (its vLLM connector merges runs before calling it).
- NIXL (UCX backend): the two pools are prepared once as per-block descriptor lists
  (`prep_xfer_dlist`, the block-pool path NIXL offers for KV caches), then each transfer is one
  `make_prepped_xfer("READ", ...)` by block index, posted and polled to completion. NIXL merges
  descriptors that are adjacent on both sides (2,048 blocks of this pattern become ~440 reads);
  that is the library's own doing and counts for it.
  "nixl" pins UCX to shared memory (UCX_TLS=sm,self: a zero-copy cma get, process_vm_readv),
  "nixl_tcp" to TCP on loopback (UCX_TLS=tcp,self, UCX_NET_DEVICES=lo: gets emulated over TCP).
- Both sides of every peer run in fresh "spawn" processes, so each library's environment variables
  and threads are its own and nothing stays loaded in the caller. On a 2-core machine the
  libraries' progress threads and the reader's polling share the cores, as the data plane's do.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import statistics
import time
import traceback
from contextlib import suppress
from functools import cache
from multiprocessing.connection import Connection
from types import ModuleType

import numpy as np

from kvmesh.bench.transfer_pattern import scattered_blocks

PEERS: tuple[str, ...] = ("mooncake_tcp", "nixl", "nixl_tcp")

# The environment each peer's processes get before its library is loaded.
PEER_ENV: dict[str, dict[str, str]] = {
    "mooncake_tcp": {"MC_LOG_LEVEL": "ERROR"},  # Mooncake logs every connection at INFO
    "nixl": {"UCX_TLS": "sm,self", "NIXL_LOG_LEVEL": "WARN"},
    "nixl_tcp": {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"},
}

MOONCAKE_BATCH = 1024  # entries per Mooncake batch: its TCP transport's default queue per peer
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")  # the meta package, or one variant
# UCX's default "peer" error handling needs transports that detect a dead peer, which its
# shared-memory ones do not: with it, UCX refuses to use shared memory at all.
UCX_PARAMS = {"ucx_error_handling_mode": "none"}
FILLER = 0x5A  # what the reader's pool holds where nothing was transferred
CHILD_TIMEOUT_S = 120.0  # the longest any step waits on a child process

BLOCK_SIZES = (4096, 8192, 16384, 32768)
BLOCK_COUNTS = (1024, 2048)


# ---- which peers can run -------------------------------------------------------------------------


def _import_mooncake() -> ModuleType:
    return importlib.import_module("mooncake.engine")


def _import_nixl() -> ModuleType:
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {error}")
    raise ImportError("; ".join(errors))


_IMPORTERS = {"mooncake_tcp": _import_mooncake, "nixl": _import_nixl, "nixl_tcp": _import_nixl}


@cache
def _import_error(peer: str) -> str | None:
    try:
        _IMPORTERS[peer]()
    except ImportError as error:  # a missing package, or a system library it needs (libibverbs.so.1)
        return f"{type(error).__name__}: {error}"
    return None


def available() -> dict[str, str | None]:
    """Peer -> None if its library imports here, else why not (the import error). Whether UCX can
    then select the transport a NIXL peer pins is known only when `measure` runs it."""
    return {peer: _import_error(peer) for peer in PEERS}


# ---- pool contents -------------------------------------------------------------------------------

_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd, so word index -> word is a bijection mod 2**64


def _words(word_ids: np.ndarray, seed: int) -> np.ndarray:
    """The source pool's 8-byte words at these indices: distinct for every word of every block."""
    return (word_ids.astype(np.uint64) * _MIX) ^ np.uint64(seed)


def source_pool(pool_blocks: int, block_bytes: int, seed: int) -> np.ndarray:
    """The owner's pool, (pool_blocks, block_bytes) uint8."""
    words = _words(np.arange(pool_blocks * block_bytes // 8), seed)
    return words.view(np.uint8).reshape(pool_blocks, block_bytes)


def source_blocks(ids: np.ndarray, block_bytes: int, seed: int) -> np.ndarray:
    """Rows `ids` of `source_pool(...)`, without building the whole pool."""
    per_block = block_bytes // 8
    word_ids = ids[:, None] * per_block + np.arange(per_block)
    return _words(word_ids, seed).view(np.uint8).reshape(len(ids), block_bytes)


def _check_blocks(pool: np.ndarray, dst: np.ndarray, expected: np.ndarray) -> None:
    wrong = np.flatnonzero((pool[dst] != expected).any(axis=1))
    if len(wrong):
        raise AssertionError(f"{len(wrong)} of {len(dst)} destination blocks differ, first: dst[{wrong[0]}]")


def _check_untouched(pool: np.ndarray, dst: np.ndarray) -> None:
    others = np.ones(len(pool), dtype=bool)
    others[dst] = False
    if (pool[others] != FILLER).any():
        raise AssertionError("a transfer wrote outside its destination blocks")


# ---- Mooncake Transfer Engine over TCP -----------------------------------------------------------


def _mooncake_engine(pool: np.ndarray):
    engine = _import_mooncake().TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake: initialize failed")
    if engine.register_memory(pool.ctypes.data, pool.nbytes) != 0:
        raise RuntimeError("mooncake: register_memory failed")
    return engine


class MooncakeOwner:
    def __init__(self, pool: np.ndarray):
        self.engine = _mooncake_engine(pool)
        # With P2PHANDSHAKE the session is named by host and the engine's own RPC port.
        self.contact = (f"127.0.0.1:{self.engine.get_rpc_port()}", pool.ctypes.data)


class MooncakeReader:
    def __init__(self, pool: np.ndarray, contact):
        self.engine = _mooncake_engine(pool)
        self.session, self.remote_base = contact
        self.local_base, self.block_bytes = pool.ctypes.data, pool.shape[1]

    def prepare(self, src: np.ndarray, dst: np.ndarray) -> list[tuple[list[int], list[int], list[int]]]:
        local = (self.local_base + dst * self.block_bytes).tolist()
        remote = (self.remote_base + src * self.block_bytes).tolist()
        lengths = [self.block_bytes] * len(src)
        return [
            (local[i : i + MOONCAKE_BATCH], remote[i : i + MOONCAKE_BATCH], lengths[i : i + MOONCAKE_BATCH])
            for i in range(0, len(src), MOONCAKE_BATCH)
        ]

    def read(self, batches) -> None:
        for batch in batches:
            if self.engine.batch_transfer_sync_read(self.session, *batch) != 0:
                raise RuntimeError("mooncake: batch_transfer_sync_read failed (its log says why at WARNING)")


# ---- NIXL over UCX -------------------------------------------------------------------------------


def _nixl_agent(name: str, pool: np.ndarray):
    api = _import_nixl()
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    agent.create_backend("UCX", UCX_PARAMS)
    agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    return agent


def _block_descs(base: int, pool_blocks: int, block_bytes: int) -> np.ndarray:
    """One (address, length, device) row per block of a pool, as NIXL's descriptor lists take."""
    descs = np.zeros((pool_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(pool_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    return descs


class NixlOwner:
    def __init__(self, pool: np.ndarray):
        self.agent = _nixl_agent("kvmesh-owner", pool)
        self.contact = (self.agent.get_agent_metadata(), pool.ctypes.data)


class NixlReader:
    def __init__(self, pool: np.ndarray, contact):
        metadata, remote_base = contact
        self.agent = _nixl_agent("kvmesh-reader", pool)
        self.remote = self.agent.add_remote_agent(metadata)
        pool_blocks, block_bytes = pool.shape
        self.local_side = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_descs(pool.ctypes.data, pool_blocks, block_bytes), "DRAM"
        )
        self.remote_side = self.agent.prep_xfer_dlist(
            self.remote, _block_descs(remote_base, pool_blocks, block_bytes), "DRAM"
        )

    def prepare(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return dst.astype(np.int32), src.astype(np.int32)

    def read(self, indices: tuple[np.ndarray, np.ndarray]) -> None:
        local, remote = indices
        handle = self.agent.make_prepped_xfer("READ", self.local_side, local, self.remote_side, remote)
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"nixl: transfer ended in state {state}")
        finally:
            self.agent.release_xfer_handle(handle)


_SIDES = {
    "mooncake_tcp": (MooncakeOwner, MooncakeReader),
    "nixl": (NixlOwner, NixlReader),
    "nixl_tcp": (NixlOwner, NixlReader),
}


# ---- the two processes ---------------------------------------------------------------------------


def _run_child(conn: Connection, peer: str, role, *args) -> None:
    """Entry point of both children: run the role, or report its traceback to the parent."""
    try:
        os.environ.update(PEER_ENV[peer])  # before the library is first imported in this process
        role(conn, peer, *args)
    except Exception:
        with suppress(OSError):  # the parent may be gone already
            conn.send(("error", traceback.format_exc()))


def _owner(conn: Connection, peer: str, block_bytes: int, pool_blocks: int, seed: int) -> None:
    pool = source_pool(pool_blocks, block_bytes, seed)
    owner = _SIDES[peer][0](pool)
    conn.send(("ok", owner.contact))
    with suppress(EOFError):
        conn.recv()  # keep the pool registered until the parent closes the pipe


def _reader(conn: Connection, peer: str, block_bytes: int, pool_blocks: int, seed: int,
            src: np.ndarray, dst: np.ndarray, repeats: int) -> None:
    contact = conn.recv()
    pool = np.full((pool_blocks, block_bytes), FILLER, dtype=np.uint8)
    expected = source_blocks(src, block_bytes, seed)
    reader = _SIDES[peer][1](pool, contact)
    request = reader.prepare(src, dst)
    seconds = []
    for _ in range(1 + repeats):  # the first is the warm-up: connections are set up on first use
        pool[dst] = FILLER
        start = time.perf_counter()
        reader.read(request)
        seconds.append(time.perf_counter() - start)
        _check_blocks(pool, dst, expected)
    _check_untouched(pool, dst)
    conn.send(("ok", seconds[1:]))


class _Child:
    """A spawned child with a pipe to it; every wait on it is bounded, and it is always reaped."""

    def __init__(self, ctx, peer: str, role, *args):
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_run_child, args=(child_conn, peer, role, *args), daemon=True)
        self.process.start()
        child_conn.close()
        self.name = f"{peer} {role.__name__.strip('_')}"

    def receive(self):
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not self.conn.poll(0.1):
            if not self.process.is_alive() and not self.conn.poll(0):
                raise RuntimeError(f"{self.name} exited with code {self.process.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} sent nothing in {CHILD_TIMEOUT_S:.0f} s")
        status, payload = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.name} failed:\n{payload}")
        return payload

    def close(self) -> None:
        self.conn.close()  # the owner, waiting on the pipe, gets EOFError and exits
        self.process.join(5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def measure(peer: str, block_bytes: int, num_blocks: int, repeats: int = 3, seed: int = 0) -> float:
    """GB/s of reading `num_blocks` scattered blocks of `block_bytes` from a pool in one process
    into a pool in another: the median of `repeats` timed transfers after a warm-up. Raises if any
    transferred byte differs, or if a child fails or stalls for CHILD_TIMEOUT_S."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}, expected one of {PEERS}")
    if (reason := available()[peer]) is not None:
        raise RuntimeError(f"{peer} is not available: {reason}")
    if block_bytes % 8 or num_blocks < 1 or repeats < 1:
        raise ValueError("need block_bytes a multiple of 8, num_blocks >= 1 and repeats >= 1")
    src, dst, pool_blocks = scattered_blocks(num_blocks, seed)
    ctx = mp.get_context("spawn")
    owner = _Child(ctx, peer, _owner, block_bytes, pool_blocks, seed)
    try:
        reader = _Child(ctx, peer, _reader, block_bytes, pool_blocks, seed, src, dst, repeats)
        try:
            reader.conn.send(owner.receive())
            seconds = reader.receive()
        finally:
            reader.close()
    finally:
        owner.close()
    return num_blocks * block_bytes / statistics.median(seconds) / 1e9


def main() -> None:
    reasons = available()
    for peer, reason in reasons.items():
        if reason is not None:
            print(f"{peer}: skipped ({reason})")
    print(f"{'peer':<14}{'blocks':>8}" + "".join(f"{size // 1024:>7} KB" for size in BLOCK_SIZES))
    for peer in (peer for peer, reason in reasons.items() if reason is None):
        for num_blocks in BLOCK_COUNTS:
            cells = "".join(f"{measure(peer, size, num_blocks):>10.2f}" for size in BLOCK_SIZES)
            print(f"{peer:<14}{num_blocks:>8}{cells}", flush=True)
    print("GB/s (1e9 bytes/s), median of 3 after a warm-up")


if __name__ == "__main__":
    main()
