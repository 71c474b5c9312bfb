"""A verbs reliable-connected queue pair: the NIC does the work, the event loop takes completions.

Each pair has its own completion queue and completion channel; the channel's fd is watched with
`loop.add_reader`, so an idle pair costs nothing. On a wake-up the handler takes the event, acks
it, re-arms the queue and then polls it empty (re-arming first, so a completion that lands while
polling raises the next wake-up instead of being missed). Any error completion moves the pair to
the error state, as the NIC has already done with its queue pair.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import secrets
from typing import TYPE_CHECKING

from ..completion import CompletionQueue
from ..endpoint import QpState, QueuePair
from ..memory import MemoryRegion
from ..work import Completion, Opcode, QueuePairError, Segments, Status
from .device import Device, DeviceError, apply, completion_channel, enum, enum_names, recv_wr, send_wrs
from .handshake import QpInfo
from .plan import WC_STATUS_NAMES, completion_status, qp_info, to_error, to_init, to_rtr, to_rts
from .work_requests import Batch, Chunk, SendQueue, rdma_batch, send_batch

if TYPE_CHECKING:
    from .endpoint import VerbsEndpoint

log = logging.getLogger(__name__)

POLL_BATCH = 64


@functools.cache
def _wc_status_names() -> dict[int, str]:
    return enum_names(WC_STATUS_NAMES)


class VerbsQueuePair(QueuePair):
    """Created in INIT (its `info` goes to the peer); `connect_to` the peer's info makes it usable."""

    def __init__(self, endpoint: VerbsEndpoint, peer: str, cq: CompletionQueue, device: Device, *,
                 send_depth: int, recv_depth: int):
        super().__init__(endpoint, peer, cq)
        self._loop = asyncio.get_running_loop()
        self._device = device
        self._ids = itertools.count(1)  # wr_ids the NIC sees: chunks and receives share one space
        self._sq = SendQueue(send_depth)
        self._recv_depth = recv_depth
        self._recvs: dict[int, int] = {}  # NIC wr_id -> the caller's wr_id of a posted receive
        self._channel = self._vcq = self._qp = None
        self._reading = False
        self.psn = secrets.randbits(24)
        try:
            self._create(send_depth, recv_depth)
            self.info: QpInfo = qp_info(device.port, self._qp.qp_num, self.psn)
        except BaseException:
            self._destroy()
            raise

    def _create(self, send_depth: int, recv_depth: int) -> None:
        from pyverbs.cq import CQ
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPCap, QPInitAttr

        try:
            self._channel, self._channel_fd = completion_channel(self._device.context)
            self._vcq = CQ(self._device.context, send_depth + recv_depth, None, self._channel, 0)
            cap = QPCap(max_send_wr=send_depth, max_recv_wr=recv_depth, max_send_sge=1, max_recv_sge=1)
            # sq_sig_all=0: only the requests we flag signalled produce a completion
            init = QPInitAttr(qp_type=enum("IBV_QPT_RC"), scq=self._vcq, rcq=self._vcq, cap=cap, sq_sig_all=0)
            self._qp = QP(self._device.pd, init)
            apply(self._qp, to_init(self._device.port))
        except PyverbsError as exc:
            raise DeviceError(f"creating a queue pair to {self.peer}: {exc}") from exc

    def connect_to(self, remote: QpInfo) -> None:
        """INIT -> RTR -> RTS towards the peer's queue pair; completions are taken from now on."""
        from pyverbs.pyverbs_error import PyverbsError

        port = self._device.port
        try:
            apply(self._qp, to_rtr(port, remote))
            apply(self._qp, to_rts(port, remote, self.psn))
            self._vcq.req_notify()
        except PyverbsError as exc:
            raise DeviceError(f"connecting the queue pair to {self.peer} (qp {remote.qp_num}): {exc}") from exc
        self._loop.add_reader(self._channel_fd, self._on_completion_event)
        self._reading = True

    def discard(self) -> None:
        """Release a queue pair whose connection was never made."""
        self.state, self.error = QpState.CLOSED, "not connected"
        self._teardown()

    def in_error_state(self) -> bool:
        """Whether the NIC has moved this queue pair to the error state (asked of the device)."""
        if self._qp is None:
            return False
        attr, _ = self._qp.query(enum("IBV_QP_STATE"))
        return attr.qp_state == enum("IBV_QPS_ERR")

    # posting

    def _post_read(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        self._submit(rdma_batch(Opcode.READ, wr_id, local.addr, local.lkey, segments, rkey, depth=self._sq.depth,
                                max_message=self._device.max_message, ids=self._ids))

    def _post_write(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        self._submit(rdma_batch(Opcode.WRITE, wr_id, local.addr, local.lkey, segments, rkey, depth=self._sq.depth,
                                max_message=self._device.max_message, ids=self._ids))

    def _post_send(self, wr_id: int, local: MemoryRegion, offset: int, length: int) -> None:
        self._submit(send_batch(wr_id, local.addr + offset, local.lkey, length, self._ids))

    def _post_recv(self, wr_id: int, local: MemoryRegion, offset: int, length: int) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        if len(self._recvs) >= self._recv_depth:
            raise QueuePairError(f"the receive queue to {self.peer} is full ({self._recv_depth} posted)")
        nic_id = next(self._ids)
        try:
            self._qp.post_recv(recv_wr(nic_id, local.addr + offset, length, local.lkey))
        except PyverbsError as exc:
            raise QueuePairError(f"ibv_post_recv to {self.peer}: {exc}") from exc
        self._recvs[nic_id] = wr_id

    def _submit(self, batch: Batch) -> None:
        self._post_chunks(self._sq.submit(batch))

    def _post_chunks(self, chunks: list[Chunk]) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        for chunk in chunks:
            wrs = send_wrs(chunk)
            try:
                self._qp.post_send(wrs[0])
            except PyverbsError as exc:
                self.fail(f"ibv_post_send to {self.peer}: {exc}")  # completes the batch with an error
                return

    # completions (on the event loop)

    def _on_completion_event(self) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        try:
            self._channel.get_cq_event(self._vcq)
        except PyverbsError:  # woken without an event: the fd is non-blocking
            return
        self._vcq.ack_events(1)
        self._vcq.req_notify()
        self._drain()

    def _drain(self) -> None:
        while self._vcq is not None:
            polled, wcs = self._vcq.poll(POLL_BATCH)
            for wc in wcs:
                if self._qp is None:  # an earlier completion failed the pair; the rest are its flushes
                    return
                self._on_work_completion(wc.wr_id, wc.status, wc.byte_len, wc.vendor_err)
            if polled < POLL_BATCH:
                return

    def _on_work_completion(self, nic_id: int, wc_status: int, byte_len: int, vendor_err: int) -> None:
        name = _wc_status_names().get(wc_status, f"ibv_wc_status {wc_status}")
        caller = self._recvs.pop(nic_id, None)
        if caller is not None:
            opcode, status = Opcode.RECV, completion_status(name, Opcode.RECV)
            self.cq.deliver(Completion(caller, opcode, status, byte_len if status is Status.SUCCESS else 0,
                                       "" if status is Status.SUCCESS else name))
        else:
            chunk = self._sq.in_flight.get(nic_id)
            if chunk is None:
                return  # a flushed request of a chunk that already failed
            opcode = chunk.batch.opcode
            status = completion_status(name, opcode)
            completion, admitted = self._sq.complete(nic_id, status, f"{name} from {self.peer}")
            if completion is not None:
                self.cq.deliver(completion)
            self._post_chunks(admitted)
        if status is not Status.SUCCESS:
            self.fail(f"{opcode.name} to {self.peer} failed: {name} (vendor error {vendor_err:#x})")

    # teardown

    def _teardown(self) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        if self._qp is None:
            return
        if self._reading:
            self._loop.remove_reader(self._channel_fd)
            self._reading = False
        try:
            apply(self._qp, to_error())
        except PyverbsError as exc:
            log.debug("moving the queue pair to %s to the error state: %s", self.peer, exc)
        detail = self.error or ""
        status = Status.FLUSHED if self.state is QpState.CLOSED else Status.TRANSPORT_ERROR
        for completion in self._sq.abort(status, detail):
            self.cq.deliver(completion)
        for wr_id in self._recvs.values():
            self.cq.deliver(Completion(wr_id, Opcode.RECV, Status.FLUSHED, 0, detail))
        self._recvs.clear()
        self._destroy()

    def _destroy(self) -> None:
        for verbs_object in (self._qp, self._vcq, self._channel):
            if verbs_object is not None:
                verbs_object.close()
        self._qp = self._vcq = self._channel = None
