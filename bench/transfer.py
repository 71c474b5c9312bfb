"""KV-block transfer between two processes on loopback: KVDirect pull with and without coalescing,
the message-passing baseline, and the ceilings, in one run (KVDirect Fig. 15).

A prefill process owns one pool per block size (4, 8, 16 and 32 KB blocks, in the engine's
[B, KV, L, H, D] layout) and serves it through KVDirectServer and the baseline's message server,
on each backend. This process pulls 1,024 and 2,048 blocks scattered as a serving pool leaves them
(transfer_pattern.py) into pools of its own and checks every byte. GB/s is the blocks' bytes over
the time from the first post to the COMPLETE's ACK (pull) or the notify's ACK (baseline). Ceilings
measured in the same run: a large memcpy in one process, and one TCP stream between the processes,
with 1 MiB buffers on both sides (cache-hot, what iperf3 measures: `socket_gbps`, the issue's
ceiling) and with pool-sized buffers (`socket_pool_gbps`: the same bytes a pool transfer must read
and land). "Pool-sized" moves a whole 256 MB pool, block i to i.
The peers (Mooncake Transfer Engine over TCP, NIXL) run the same block pattern when installed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import statistics
import struct
import threading
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch
from rich.progress import Progress

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.puller import BlockReads, KVDirectPuller
from kvmesh.libs.rdma.kvdirect.server import KVDirectServer
from kvmesh.libs.rdma.shm.shared import shared_buffer

from . import transfer_message
from .report import BenchResult, Row
from .transfer_pattern import scattered_blocks

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT = Path("bench-results/transfer_bandwidth.png")
TOKEN = "bench-transfer"
BACKENDS = ("tcp", "shm")
SMALL, POOL = 0, 1  # the socket ceilings' buffers
CALL_BYTES = 1 << 20  # the socket ceilings' bytes per send or receive call
POOL_BLOCKS = 8192  # per block size: room for 4x the largest transfer (transfer_pattern.POOL_FACTOR)
BATCHED_BLOCKS = 32  # the baseline's buffer in its batched form
# Each peer is compared with our backend of the same kind: Mooncake's TCP and NIXL over UCX tcp
# with tcp, NIXL over UCX shared memory with shm.
PEER_BACKEND = {"mooncake_tcp": "tcp", "nixl": "shm", "nixl_tcp": "tcp"}
MODES = ("pull", "pull_nocoalesce", "message", "message_batched")
MODE_NAMES = {"pull": "(a) KVDirect pull, coalesced", "pull_nocoalesce": "(b) KVDirect pull, no coalescing",
              "message": "(c) message passing, per block (Fig. 3)",
              "message_batched": f"(c') message passing, {BATCHED_BLOCKS}-block buffer (Fig. 7a)"}


def run(quick: bool) -> BenchResult:
    torch.set_num_threads(1)
    sizes = (4096, 32768) if quick else (4096, 8192, 16384, 32768)
    counts = (1024,) if quick else (1024, 2048)
    repeats = 3 if quick else 5
    key_count = counts[-1]
    owner, pipe, addresses = _start_owner(sizes)
    try:
        with Progress(transient=True) as progress:
            task = progress.add_task("transfer", total=len(BACKENDS) * len(sizes) * len(counts) * len(MODES) + 4)
            pool_bytes = POOL_BLOCKS * sizes[-1]
            ceilings = {"memcpy_gbps": _memcpy_gbps(), "socket_gbps": _socket_gbps(addresses["socket"], SMALL, 512 << 20),
                        "socket_pool_gbps": _socket_gbps(addresses["socket"], POOL, pool_bytes)}
            progress.advance(task, 2)
            measured, pool_sized = asyncio.run(_measure_all(addresses, sizes, counts, repeats, progress, task))
            peers = _measure_peers(sizes, key_count, repeats, progress)
    finally:
        pipe.close()  # the prefill process ends when its end of the pipe does
        owner.join(10)
        owner.terminate()

    rows = _rows(measured, pool_sized, peers, ceilings, sizes, counts)
    at = lambda backend, mode, size=4096: measured[(backend, mode, size, key_count)][0]  # noqa: E731
    ratios = {"pull_vs_message_4k": at("tcp", "pull") / at("tcp", "message"),
              "pull_vs_message_4k_shm": at("shm", "pull") / at("shm", "message"),
              "pull_vs_message_batched_4k": at("tcp", "pull") / at("tcp", "message_batched"),
              "pull_vs_nocoalesce_4k": at("tcp", "pull") / at("tcp", "pull_nocoalesce"),
              "pull_vs_nocoalesce_4k_shm": at("shm", "pull") / at("shm", "pull_nocoalesce"),
              "tcp_frac_of_ceiling": pool_sized["tcp"] / ceilings["socket_gbps"],
              "tcp_frac_of_pool_stream": pool_sized["tcp"] / ceilings["socket_pool_gbps"],
              "shm_frac_of_ceiling": pool_sized["shm"] / ceilings["memcpy_gbps"]}
    # The target is held against the batched baseline, what a user would write; per block is a row.
    targets = {"pull_vs_message_batched_4k": 5.0, "tcp_frac_of_ceiling": 0.7, "shm_frac_of_ceiling": 0.7}
    # The peers' figures end when their reads complete; ours that carry a target include the COMPLETE/ACK
    # round trip, since the user waits for the whole hand-off. At the reads' end (`pull_landed_vs_`) is
    # information. A peer that is not installed misses its targets (NaN): config.peers_skipped says why.
    landed = lambda backend, size: measured[(backend, "pull", size, key_count)][2]  # noqa: E731
    for peer, ours in PEER_BACKEND.items():
        targets[f"pull_vs_{peer}_4k"] = targets[f"pull_vs_{peer}_min"] = 1.0
        if all((peer, s) in peers for s in sizes):
            whole = [at(ours, "pull", s) / peers[(peer, s)] for s in sizes]
            ratios[f"pull_vs_{peer}_4k"], ratios[f"pull_vs_{peer}_min"] = whole[0], min(whole)
            ratios[f"pull_landed_vs_{peer}_min"] = min(landed(ours, s) / peers[(peer, s)] for s in sizes)
    _plot(measured, pool_sized, peers, ceilings, sizes, key_count)
    return BenchResult(
        bench="transfer", quick=quick, ratios=ratios, targets=targets,
        ceilings=ceilings,
        config={"block_sizes": list(sizes), "block_counts": list(counts), "repeats": repeats, "statistic": "median",
                "pattern": "transfer_pattern.scattered_blocks (FIFO free list after churn)", "backends": list(BACKENDS),
                "pool_sized_bytes": POOL_BLOCKS * sizes[-1], "peers_skipped": _peer_reasons()},
        rows=rows, plots=[str(PLOT)],
        headline=f"4 KB blocks, {key_count} of them, tcp: KVDirect pull {at('tcp', 'pull'):.2f} GB/s = "
                 f"{ratios['pull_vs_message_batched_4k']:.1f}x batched message passing (target 5x), "
                 f"{ratios['pull_vs_message_4k']:.1f}x per block; pool-sized pull at "
                 f"{ratios['tcp_frac_of_ceiling']:.0%} of one TCP stream, shm at {ratios['shm_frac_of_ceiling']:.0%} of memcpy")


# the prefill process

def _block_shape(block_bytes: int) -> tuple[int, ...]:
    """[KV, L, H, D] of a bf16 block of `block_bytes` bytes, 16 tokens per block."""
    heads_x_dim = block_bytes // (2 * 16 * 2)
    heads = max(1, heads_x_dim // 128)
    return (2, 16, heads, heads_x_dim // heads)


def _fill(pool: np.ndarray, block_bytes: int) -> None:
    """Every 8-byte word names its block size and position, so any misplaced byte shows."""
    words = pool.view(np.uint64)
    words[:] = np.arange(words.size, dtype=np.uint64) + (np.uint64(block_bytes) << np.uint64(40))


def _expected(block_bytes: int, blocks: np.ndarray) -> np.ndarray:
    per_block = block_bytes // 8
    offsets = blocks[:, None].astype(np.uint64) * np.uint64(per_block) + np.arange(per_block, dtype=np.uint64)
    return offsets + (np.uint64(block_bytes) << np.uint64(40))


def _owner_main(conn, sizes: tuple[int, ...]) -> None:
    torch.set_num_threads(1)
    asyncio.run(_owner(conn, sizes))


async def _owner(conn, sizes: tuple[int, ...]) -> None:
    addresses: dict[str, object] = {"socket": _start_socket_source(POOL_BLOCKS * max(sizes))}
    for backend in BACKENDS:
        pools = {size: _pool(backend, POOL_BLOCKS * size) for size in sizes}
        for size, pool in pools.items():
            _fill(pool, size)
        server = KVDirectServer(open_endpoint(backend, TOKEN), on_complete=lambda request_id: True, timeout=30.0)
        for size, pool in pools.items():
            server.expose(f"b{size}", torch.from_numpy(pool).view(torch.bfloat16).view(POOL_BLOCKS, *_block_shape(size)))
        message_endpoint = open_endpoint(backend, TOKEN)
        addresses[backend] = {"kvdirect": await server.start(), "message": await message_endpoint.start()}
        asyncio.ensure_future(transfer_message.serve(
            message_endpoint, {f"b{s}": p.reshape(POOL_BLOCKS, s) for s, p in pools.items()},
            BATCHED_BLOCKS * max(sizes)))
    conn.send(addresses)
    try:
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    except EOFError:  # the parent is done
        pass


def _pool(backend: str, nbytes: int) -> np.ndarray:
    """A pool as an engine allocates it for this data plane: private memory (torch.empty) for tcp,
    a shared file mapping for shm, which maps its peer's pool."""
    return shared_buffer(nbytes) if backend == "shm" else np.zeros(nbytes, np.uint8)


def _start_socket_source(pool_bytes: int) -> str:
    """A raw TCP sender for the socket ceilings: per request, N bytes from a 1 MiB buffer (the
    cache-hot stream iperf3 measures) or from a pool-sized buffer (the bytes a pool transfer reads)."""
    listener = socket.create_server(("127.0.0.1", 0))
    sources = {SMALL: memoryview(bytearray(1 << 20)), POOL: memoryview(np.ones(pool_bytes, np.uint8))}

    def serve() -> None:
        while True:
            sock, _ = listener.accept()
            with sock:
                while header := sock.recv(9, socket.MSG_WAITALL):
                    left, kind = struct.unpack("<QB", header)
                    source, sent = sources[kind], 0
                    while sent < left:  # 1 MiB calls, from successive offsets of the source
                        at = sent % source.nbytes
                        sent += sock.send(source[at:at + min(left - sent, CALL_BYTES, source.nbytes - at)])

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


def _start_owner(sizes: tuple[int, ...]):
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    owner = context.Process(target=_owner_main, args=(child, sizes), daemon=True)
    owner.start()
    if not parent.poll(120):
        owner.terminate()
        raise RuntimeError("the prefill process did not come up")
    return owner, parent, parent.recv()


# ceilings

def _memcpy_gbps(nbytes: int = 256 << 20) -> float:
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault the pages in first
    return nbytes / min(_timed(lambda: np.copyto(dst, src)) for _ in range(5)) / 1e9


def _socket_gbps(address: str, kind: int, nbytes: int) -> float:
    """One TCP stream between the two processes, best of 3, in calls of at most 1 MiB (the size
    that streams fastest here): sender and receiver both use 1 MiB buffers (SMALL), or pool-sized
    ones (POOL), in which case neither side's bytes sit in cache."""
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)))
    buffer = memoryview(bytearray(1 << 20) if kind == SMALL else np.zeros(nbytes, np.uint8))

    def stream() -> None:
        sock.sendall(struct.pack("<QB", nbytes, kind))
        got = 0
        while got < nbytes:
            at = got % buffer.nbytes
            got += sock.recv_into(buffer[at:], min(nbytes - got, CALL_BYTES, buffer.nbytes - at))

    stream()
    best = min(_timed(stream) for _ in range(3))
    sock.close()
    return nbytes / best / 1e9


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# our transfers

async def _measure_all(addresses, sizes, counts, repeats, progress, task):
    measured: dict[tuple[str, str, int, int], tuple[float, int]] = {}
    pool_sized: dict[str, float] = {}
    for backend in BACKENDS:
        local = {size: _pool(backend, POOL_BLOCKS * size) for size in sizes}
        pullers = {}
        for mode, coalescing in (("pull", True), ("pull_nocoalesce", False)):
            pullers[mode] = KVDirectPuller(open_endpoint(backend, TOKEN), coalescing=coalescing, timeout=30.0)
            await pullers[mode].endpoint.start()
            for size in sizes:
                pullers[mode].expose(f"b{size}", torch.from_numpy(local[size]).view(torch.bfloat16)
                                     .view(POOL_BLOCKS, *_block_shape(size)))
        client = transfer_message.MessageClient(open_endpoint(backend, TOKEN), BATCHED_BLOCKS * max(sizes))
        await client.endpoint.start()
        await client.connect(addresses[backend]["message"])
        address = addresses[backend]["kvdirect"]
        for size in sizes:
            for count in counts:
                src, dst, _ = scattered_blocks(count, seed=count)
                for mode in MODES:
                    async def once(tag: str, mode=mode, size=size, src=src, dst=dst) -> tuple[int, float | None]:
                        """Reads posted (or message rounds), and for a pull the seconds until its reads landed."""
                        if mode.startswith("pull"):
                            report = await pullers[mode].pull(address, tag, [BlockReads(f"b{size}", f"b{size}", src, dst)])
                            return report.reads_posted, report.reads_seconds
                        per_message = 1 if mode == "message" else BATCHED_BLOCKS
                        await client.transfer(tag, f"b{size}", src, local[size].reshape(POOL_BLOCKS, size), dst, per_message)
                        return len(src) // per_message, None
                    local[size][:] = 0
                    reads, _ = await once(f"{mode}-check")  # the warm-up: connections and mappings
                    _check(local[size], size, src, dst, f"{backend} {mode}")
                    seconds, landed = [], []
                    for i in range(repeats):  # as the peers are measured: blocks reset, read, checked
                        local[size].reshape(POOL_BLOCKS, size)[dst] = 0
                        started = time.perf_counter()
                        _, reads_seconds = await once(f"{mode}-{i}")
                        seconds.append(time.perf_counter() - started)
                        landed.append(reads_seconds)
                        _check(local[size], size, src, dst, f"{backend} {mode}")
                    gbps = lambda times: count * size / statistics.median(times) / 1e9  # noqa: E731
                    measured[(backend, mode, size, count)] = (gbps(seconds), reads, gbps(landed) if landed[0] else None)
                    progress.advance(task)
        everything = np.arange(POOL_BLOCKS)
        whole = lambda tag: pullers["pull"].pull(address, tag, [BlockReads(f"b{sizes[-1]}", f"b{sizes[-1]}", everything, everything)])  # noqa: E731
        await whole("warm")
        _check(local[sizes[-1]], sizes[-1], everything, everything, f"{backend} pool-sized")
        seconds = [await _timed_async(whole, f"pool-{i}") for i in range(repeats)]
        pool_sized[backend] = POOL_BLOCKS * sizes[-1] / statistics.median(seconds) / 1e9
        progress.advance(task)
        for puller in pullers.values():
            await puller.close()
        await client.endpoint.close()
    return measured, pool_sized


async def _timed_async(fn, tag: str) -> float:
    started = time.perf_counter()
    await fn(tag)
    return time.perf_counter() - started


def _check(local: np.ndarray, size: int, src: np.ndarray, dst: np.ndarray, what: str) -> None:
    got = local.view(np.uint64).reshape(POOL_BLOCKS, size // 8)[dst]
    if not np.array_equal(got, _expected(size, src)):
        raise AssertionError(f"{what}: pulled bytes differ from the source blocks")


# peers

def _peer_module():
    try:
        from . import transfer_peers
    except ImportError:
        return None
    return transfer_peers


def _peer_reasons() -> dict[str, str]:
    module = _peer_module()
    if module is None:
        return {"all": "bench/transfer_peers.py missing"}
    return {peer: reason for peer, reason in module.available().items() if reason is not None}


def _measure_peers(sizes, count, repeats, progress) -> dict[tuple[str, int], float]:
    module = _peer_module()
    if module is None:
        return {}
    usable = [peer for peer, reason in module.available().items() if reason is None]
    task = progress.add_task("peers", total=len(usable) * len(sizes))
    measured = {}
    for peer in usable:
        for size in sizes:
            measured[(peer, size)] = module.measure(peer, size, count, repeats)
            progress.advance(task)
    return measured


# report

def _rows(measured, pool_sized, peers, ceilings, sizes, counts) -> list[Row]:
    rows = []
    for count in counts:
        for size in sizes:
            label = f"{count} x {size // 1024} KB"
            src, dst, _ = scattered_blocks(count, seed=count)
            runs = 1 + int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1)))
            for backend in BACKENDS:
                for mode in MODES:
                    gbps, reads, landed = measured[(backend, mode, size, count)]
                    cells = {"GB/s": gbps} | ({"reads landed GB/s": landed} if landed else {})
                    rows.append(Row(compared=label, path=f"{backend}: {MODE_NAMES[mode]}",
                                    cells=cells | {"reads or rounds": reads, "runs in pattern": runs}))
            for (peer, peer_size), gbps in peers.items():
                if peer_size == size and count == counts[-1]:
                    rows.append(Row(compared=label, path=f"peer: {peer}", cells={"GB/s": gbps}))
    for backend, ceiling in (("tcp", "socket_gbps"), ("shm", "memcpy_gbps")):
        rows.append(Row(compared=f"pool-sized ({POOL_BLOCKS} x {sizes[-1] // 1024} KB)", path=f"{backend}: (a) KVDirect pull",
                        cells={"GB/s": pool_sized[backend], "share of ceiling": pool_sized[backend] / ceilings[ceiling]}))
    rows.append(Row(compared="ceiling", path="one TCP stream, 1 MiB sendall/recv_into", cells={"GB/s": ceilings["socket_gbps"]}))
    rows.append(Row(compared="ceiling", path="one TCP stream, pool-sized buffers both sides",
                    cells={"GB/s": ceilings["socket_pool_gbps"]}))
    rows.append(Row(compared="ceiling", path="memcpy 256 MB", cells={"GB/s": ceilings["memcpy_gbps"]}))
    return rows


def _plot(measured, pool_sized, peers, ceilings, sizes, count) -> None:
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(BACKENDS), figsize=(6 * len(BACKENDS), 4.2), sharey=False)
    kb = [s // 1024 for s in sizes]
    for ax, backend in zip(axes, BACKENDS):
        for mode in MODES:
            ax.plot(kb, [measured[(backend, mode, s, count)][0] for s in sizes], marker="o", label=MODE_NAMES[mode])
        ax.plot(kb, [measured[(backend, "pull", s, count)][2] for s in sizes], marker="o", linestyle="--",
                label="(a) reads landed, before COMPLETE (what the peers measure)")
        for peer in sorted({p for p, _ in peers if PEER_BACKEND.get(p) == backend}):
            ax.plot(kb, [peers.get((peer, s), np.nan) for s in sizes], marker="s", linestyle=":", label=f"peer: {peer}")
        ceiling = "socket_gbps" if backend == "tcp" else "memcpy_gbps"
        ax.axhline(ceilings[ceiling], color="grey", linestyle="--", label=f"ceiling: {ceiling[:-5]}")
        ax.axhline(pool_sized[backend], color="black", linestyle="-.", label="(a) pool-sized")
        ax.set_xscale("log", base=2)
        ax.set_xticks(kb, [str(k) for k in kb])
        ax.set_xlabel("block size (KB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{backend}: {count} scattered blocks, two processes")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)
