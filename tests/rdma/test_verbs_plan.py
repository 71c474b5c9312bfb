"""The verbs backend's device-free parts, with exact values: the queue-pair state machine, the
CONNECT messages, work-request building and send-queue accounting, the completion-status mapping.
The last tests check the pyverbs objects built from those plans and run only where pyverbs imports
(no device needed)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import sys
import threading
import time

import numpy as np
import pytest

from kvmesh.libs.rdma.verbs import handshake
from kvmesh.libs.rdma.verbs.endpoint import VerbsEndpoint
from kvmesh.libs.rdma.verbs.handshake import Hello, HandshakeError, QpInfo, Ready, Refuse, Welcome
from kvmesh.libs.rdma.verbs.plan import (LocalPort, Route, completion_status, gid_bytes, gid_text, mtu_bytes, mtu_name,
                                         qp_info, to_error, to_init, to_rtr, to_rts)
from kvmesh.libs.rdma.verbs.work_requests import SendQueue, WorkRequest, extents, rdma_batch, send_batch
from kvmesh.libs.rdma.work import Completion, Opcode, Segments, Status

ROCE_GID = bytes.fromhex("fe80000000000000020c29fffe3a5b01")
PEER_GID = bytes.fromhex("00000000000000000000ffffc0a80a02")  # ::ffff:192.168.10.2, a RoCE v2 GID
ROCE = LocalPort(port_num=1, lid=0, gid=ROCE_GID, gid_index=3, mtu=4096, ethernet=True, rd_atomic=16)
IB = LocalPort(port_num=2, lid=7, gid=ROCE_GID, gid_index=0, mtu=2048, ethernet=False, rd_atomic=4)
PEER = QpInfo(qp_num=0x11A, psn=0xABCDE, lid=0, gid=PEER_GID, mtu=1024, rd_atomic=128)


# the queue-pair state machine


def test_reset_to_init_grants_local_write_and_remote_read_write():
    init = to_init(ROCE)
    assert init.state == "IBV_QPS_INIT"
    assert init.attrs == {"pkey_index": 0, "port_num": 1,
                          "qp_access_flags": ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ",
                                              "IBV_ACCESS_REMOTE_WRITE")}
    assert init.mask == ("IBV_QP_STATE", "IBV_QP_PKEY_INDEX", "IBV_QP_PORT", "IBV_QP_ACCESS_FLAGS")


def test_init_to_rtr_on_roce_routes_by_gid_with_the_smaller_mtu():
    rtr = to_rtr(ROCE, PEER)
    assert rtr.state == "IBV_QPS_RTR"
    assert rtr.attrs == {
        "path_mtu": "IBV_MTU_1024", "dest_qp_num": 0x11A, "rq_psn": 0xABCDE, "max_dest_rd_atomic": 16,
        "min_rnr_timer": 12,
        "ah_attr": Route(port_num=1, dlid=0, is_global=True, dgid="0000:0000:0000:0000:0000:ffff:c0a8:0a02",
                         sgid_index=3, hop_limit=64, sl=0, traffic_class=0, flow_label=0)}
    assert rtr.mask == ("IBV_QP_STATE", "IBV_QP_AV", "IBV_QP_PATH_MTU", "IBV_QP_DEST_QPN", "IBV_QP_RQ_PSN",
                        "IBV_QP_MAX_DEST_RD_ATOMIC", "IBV_QP_MIN_RNR_TIMER")


def test_init_to_rtr_on_infiniband_routes_by_lid():
    peer = QpInfo(qp_num=9, psn=1, lid=12, gid=PEER_GID, mtu=4096, rd_atomic=16)
    rtr = to_rtr(IB, peer)
    assert rtr.attrs["ah_attr"] == Route(port_num=2, dlid=12, is_global=False)
    assert rtr.attrs["path_mtu"] == "IBV_MTU_2048"
    assert rtr.attrs["max_dest_rd_atomic"] == 4  # our device's limit


def test_a_peer_without_a_lid_is_routed_by_gid_even_on_infiniband():
    assert to_rtr(IB, PEER).attrs["ah_attr"].is_global


def test_rtr_to_rts_sets_our_psn_and_the_retry_policy():
    rts = to_rts(ROCE, PEER, psn=0x123456)
    assert rts.state == "IBV_QPS_RTS"
    assert rts.attrs == {"sq_psn": 0x123456, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7, "max_rd_atomic": 16}
    assert rts.mask == ("IBV_QP_STATE", "IBV_QP_TIMEOUT", "IBV_QP_RETRY_CNT", "IBV_QP_RNR_RETRY", "IBV_QP_SQ_PSN",
                        "IBV_QP_MAX_QP_RD_ATOMIC")


def test_read_depth_is_the_smaller_of_both_sides_at_most_sixteen():
    few = QpInfo(qp_num=1, psn=1, lid=0, gid=PEER_GID, mtu=1024, rd_atomic=2)
    assert to_rts(ROCE, few, psn=0).attrs["max_rd_atomic"] == 2
    assert to_rts(ROCE, PEER, psn=0).attrs["max_rd_atomic"] == 16


def test_teardown_moves_to_error_with_only_the_state():
    error = to_error()
    assert (error.state, error.attrs, error.mask) == ("IBV_QPS_ERR", {}, ("IBV_QP_STATE",))


def test_qp_info_tells_the_peer_our_port():
    assert qp_info(ROCE, qp_num=77, psn=5) == QpInfo(qp_num=77, psn=5, lid=0, gid=ROCE_GID, mtu=4096, rd_atomic=16)


def test_mtu_and_gid_conversions():
    assert [mtu_bytes(v) for v in range(1, 6)] == [256, 512, 1024, 2048, 4096]
    assert mtu_name(2048) == "IBV_MTU_2048"
    with pytest.raises(ValueError):
        mtu_name(1500)
    text = gid_text(ROCE_GID)
    assert text == "fe80:0000:0000:0000:020c:29ff:fe3a:5b01"
    assert gid_bytes(text) == ROCE_GID
    with pytest.raises(ValueError):
        gid_text(b"\x00" * 4)


# CONNECT messages


def test_handshake_messages_round_trip_with_a_length_prefix():
    hello = Hello(token="cluster-token", backend="verbs", qp=PEER)
    frame = handshake.encode(hello)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert handshake.decode(frame[4:]) == hello
    for message in (Welcome(qp=PEER), Refuse(reason="wrong cluster token"), Ready()):
        assert handshake.decode(handshake.encode(message)[4:]) == message


def test_malformed_handshake_is_a_handshake_error():
    with pytest.raises(HandshakeError):
        handshake.decode(b"\x93\x01\x02\x03")
    with pytest.raises(HandshakeError):  # the right shape with a field of the wrong type
        handshake.decode(handshake.encode(Refuse(reason="x"))[4:].replace(b"\xa1x", b"\x01"))


async def test_read_message_and_expect():
    reader = asyncio.StreamReader()
    reader.feed_data(handshake.encode(Welcome(qp=PEER)) + handshake.encode(Ready()))
    assert await handshake.expect(reader, Welcome, Refuse) == Welcome(qp=PEER)
    with pytest.raises(HandshakeError, match="expected HELLO, got READY"):
        await handshake.expect(reader, Hello)


async def test_an_oversized_handshake_message_is_refused_before_reading_it():
    reader = asyncio.StreamReader()
    reader.feed_data((1 << 20).to_bytes(4, "big"))
    with pytest.raises(HandshakeError, match="1048576-byte"):
        await handshake.read_message(reader)


# work requests


def test_extents_merge_segments_that_continue_each_other_and_split_long_ones():
    segments = Segments([0, 100, 300, 400], [5000, 5100, 9000, 1000], [100, 50, 100, 250])
    local, remote, lengths = extents(segments, max_message=1 << 30)
    assert local.tolist() == [0, 300, 400] and remote.tolist() == [5000, 9000, 1000]
    assert lengths.tolist() == [150, 100, 250]

    local, remote, lengths = extents(segments, max_message=100)
    assert local.tolist() == [0, 100, 300, 400, 500, 600]
    assert remote.tolist() == [5000, 5100, 9000, 1000, 1100, 1200]
    assert lengths.tolist() == [100, 50, 100, 100, 100, 50]


def test_a_read_batch_is_chained_requests_in_chunks_signalled_only_at_each_chunk_end():
    segments = Segments([0, 8192, 4096, 16384, 12288], [0x9000, 0x1000, 0x5000, 0x2000, 0x7000], [4096] * 5)
    batch = rdma_batch(Opcode.READ, 42, 0x10000, 0x77, segments, 0xBEEF, depth=2, max_message=1 << 30,
                       ids=itertools.count(100))

    assert (batch.wr_id, batch.opcode, batch.byte_len, batch.left) == (42, Opcode.READ, 5 * 4096, 3)
    assert [chunk.id for chunk in batch.chunks] == [100, 101, 102]
    requests = [chunk.requests for chunk in batch.chunks]
    assert requests == [
        (WorkRequest("IBV_WR_RDMA_READ", 0x10000, 4096, 0x77, 0x9000, 0xBEEF, False),
         WorkRequest("IBV_WR_RDMA_READ", 0x12000, 4096, 0x77, 0x1000, 0xBEEF, True)),
        (WorkRequest("IBV_WR_RDMA_READ", 0x11000, 4096, 0x77, 0x5000, 0xBEEF, False),
         WorkRequest("IBV_WR_RDMA_READ", 0x14000, 4096, 0x77, 0x2000, 0xBEEF, True)),
        (WorkRequest("IBV_WR_RDMA_READ", 0x13000, 4096, 0x77, 0x7000, 0xBEEF, True),),
    ]
    assert all(chunk.batch is batch for chunk in batch.chunks)


def test_a_write_batch_and_a_send():
    write = rdma_batch(Opcode.WRITE, 7, 0x1000, 1, Segments.one(16, 0x8000, 64), 2, depth=8, max_message=1 << 30,
                       ids=itertools.count(1))
    assert write.chunks[0].requests == (WorkRequest("IBV_WR_RDMA_WRITE", 0x1010, 64, 1, 0x8000, 2, True),)
    send = send_batch(9, 0x2000, 3, 100, itertools.count(5))
    assert (send.wr_id, send.opcode, send.byte_len, send.chunks[0].id) == (9, Opcode.SEND, 100, 5)
    assert send.chunks[0].requests == (WorkRequest("IBV_WR_SEND", 0x2000, 100, 3, 0, 0, True),)


def _batch(wr_id: int, n: int, depth: int, ids):
    segments = Segments(np.arange(n) * 2 * 64, np.arange(n) * 2 * 64, [64] * n)  # gaps: no merging
    return rdma_batch(Opcode.READ, wr_id, 0, 1, segments, 2, depth=depth, max_message=1 << 30, ids=ids)


def test_send_queue_posts_while_requests_fit_and_holds_the_rest_in_order():
    ids = itertools.count(1)
    queue = SendQueue(depth=4)
    big, small = _batch(1, 6, 4, ids), _batch(2, 1, 4, ids)  # chunks 1 (4 requests), 2 (2); then 3 (1)

    assert [c.id for c in queue.submit(big)] == [1]
    assert [c.id for c in queue.submit(small)] == []  # 4 of 4 in flight; chunk 3 would overtake chunk 2
    assert queue.used == 4 and [c.id for c in queue.held] == [2, 3]

    completion, admitted = queue.complete(1, Status.SUCCESS)
    assert completion is None and [c.id for c in admitted] == [2, 3] and queue.used == 3

    completion, admitted = queue.complete(2, Status.SUCCESS)
    assert completion == Completion(1, Opcode.READ, Status.SUCCESS, 6 * 64) and admitted == []
    completion, _ = queue.complete(3, Status.SUCCESS)
    assert completion == Completion(2, Opcode.READ, Status.SUCCESS, 64)
    assert queue.used == 0 and not queue.in_flight and not queue.held


def test_a_failed_chunk_settles_its_batch_once_and_abort_settles_the_others():
    ids = itertools.count(1)
    queue = SendQueue(depth=2)
    first, second, third = _batch(10, 3, 2, ids), _batch(20, 1, 2, ids), _batch(30, 1, 2, ids)
    for batch in (first, second, third):
        queue.submit(batch)  # in flight: chunk 1 (2 requests); held: 2, 3, 4

    completion, admitted = queue.complete(1, Status.REMOTE_ACCESS_ERROR, "IBV_WC_REM_ACCESS_ERR")
    assert completion == Completion(10, Opcode.READ, Status.REMOTE_ACCESS_ERROR, 0, "IBV_WC_REM_ACCESS_ERR")
    assert admitted == []  # nothing more is posted on a failing queue pair
    assert queue.complete(1, Status.FLUSHED) == (None, [])  # a flushed request of the same chunk

    aborted = queue.abort(Status.TRANSPORT_ERROR, "closed")
    assert aborted == [Completion(20, Opcode.READ, Status.TRANSPORT_ERROR, 0, "closed"),
                       Completion(30, Opcode.READ, Status.TRANSPORT_ERROR, 0, "closed")]
    assert queue.used == 0 and queue.abort(Status.FLUSHED, "") == []


def test_send_queue_posting_and_completing_from_two_threads_loses_nothing_and_never_overruns():
    """Push mode posts WRITEs on the engine thread while completions drain on the event loop: the
    queue's accounting must hold under any interleaving (forced here by a tiny switch interval)."""
    ids, depth, batches = itertools.count(1), 4, 2000
    queue = SendQueue(depth)
    posted: collections.deque = collections.deque()  # what the NIC holds, in posting order
    settled: list[int] = []
    overruns: list[int] = []

    def post(chunks) -> None:
        posted.extend(chunks)
        in_nic = sum(len(c.requests) for c in list(posted))
        if in_nic > depth:
            overruns.append(in_nic)

    def nic() -> None:  # completes what was posted, as the completion channel would
        while len(settled) < batches:
            if not posted:
                time.sleep(0)
                continue
            chunk = posted.popleft()
            completion, admitted = queue.complete(chunk.id, Status.SUCCESS)
            if completion is not None:
                settled.append(completion.wr_id)
            post(admitted)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        completer = threading.Thread(target=nic)
        completer.start()
        for wr_id in range(batches):
            post(queue.submit(_batch(wr_id, 1 + wr_id % 6, depth, ids)))
        completer.join(timeout=30)
    finally:
        sys.setswitchinterval(switch)
    assert not completer.is_alive(), f"stalled with {len(settled)} of {batches} settled, {queue.used} in use"
    assert sorted(settled) == list(range(batches)) and not overruns
    assert queue.used == 0 and not queue.in_flight and not queue.held


# completion statuses


@pytest.mark.parametrize("wc_status, opcode, status", [
    ("IBV_WC_SUCCESS", Opcode.READ, Status.SUCCESS),
    ("IBV_WC_REM_ACCESS_ERR", Opcode.READ, Status.REMOTE_ACCESS_ERROR),
    ("IBV_WC_REM_ACCESS_ERR", Opcode.WRITE, Status.REMOTE_ACCESS_ERROR),
    ("IBV_WC_REM_INV_REQ_ERR", Opcode.READ, Status.REMOTE_ACCESS_ERROR),
    ("IBV_WC_REM_INV_REQ_ERR", Opcode.SEND, Status.LENGTH_ERROR),
    ("IBV_WC_LOC_LEN_ERR", Opcode.RECV, Status.LENGTH_ERROR),
    ("IBV_WC_WR_FLUSH_ERR", Opcode.RECV, Status.FLUSHED),
    ("IBV_WC_RETRY_EXC_ERR", Opcode.READ, Status.TRANSPORT_ERROR),
    ("IBV_WC_RNR_RETRY_EXC_ERR", Opcode.SEND, Status.TRANSPORT_ERROR),
    ("IBV_WC_LOC_PROT_ERR", Opcode.WRITE, Status.TRANSPORT_ERROR),
    ("IBV_WC_FATAL_ERR", Opcode.READ, Status.TRANSPORT_ERROR),
])
def test_completion_status(wc_status, opcode, status):
    assert completion_status(wc_status, opcode) is status


def test_unavailable_reason_says_why():
    reason = VerbsEndpoint.unavailable_reason()
    if reason is None:
        pytest.skip("an RDMA device is present here")
    assert "pyverbs" in reason or "RDMA device" in reason


# the pyverbs objects built from the plans (pyverbs needed, no device)


def test_transitions_become_the_qp_attributes_and_mask():
    enums = pytest.importorskip("pyverbs.enums", reason="pyverbs is not importable from this Python")
    from kvmesh.libs.rdma.verbs.device import apply

    class RecordingQp:
        def modify(self, attr, mask):
            self.attr, self.mask = attr, mask

    qp = RecordingQp()
    apply(qp, to_rtr(ROCE, PEER))
    assert qp.mask == (enums.IBV_QP_STATE | enums.IBV_QP_AV | enums.IBV_QP_PATH_MTU | enums.IBV_QP_DEST_QPN
                       | enums.IBV_QP_RQ_PSN | enums.IBV_QP_MAX_DEST_RD_ATOMIC | enums.IBV_QP_MIN_RNR_TIMER)
    attr = qp.attr
    assert (attr.qp_state, attr.path_mtu, attr.dest_qp_num, attr.rq_psn) == (enums.IBV_QPS_RTR, enums.IBV_MTU_1024,
                                                                            0x11A, 0xABCDE)
    assert (attr.max_dest_rd_atomic, attr.min_rnr_timer) == (16, 12)
    ah = attr.ah_attr
    assert (ah.is_global, ah.dlid, ah.port_num, ah.sgid_index, ah.hop_limit) == (1, 0, 1, 3, 64)
    assert str(ah.dgid) == "0000:0000:0000:0000:0000:ffff:c0a8:0a02"

    apply(qp, to_init(ROCE))
    assert qp.attr.qp_access_flags == (enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_READ
                                       | enums.IBV_ACCESS_REMOTE_WRITE)


def test_a_chunk_becomes_linked_send_wrs():
    enums = pytest.importorskip("pyverbs.enums", reason="pyverbs is not importable from this Python")
    from kvmesh.libs.rdma.verbs.device import send_wrs

    segments = Segments([0, 8192], [0x9000, 0x1000], [4096, 4096])
    chunk = rdma_batch(Opcode.READ, 1, 0x10000, 0x77, segments, 0xBEEF, depth=8, max_message=1 << 30,
                       ids=itertools.count(5)).chunks[0]
    first, second = send_wrs(chunk)
    assert (first.wr_id, first.opcode, first.num_sge, first.send_flags) == (5, enums.IBV_WR_RDMA_READ, 1, 0)
    assert (second.wr_id, second.send_flags) == (5, enums.IBV_SEND_SIGNALED)
    # The links (next_wr) and RDMA fields cannot be read back before rdma-core 63.
    if hasattr(first, "rdma_remote_addr"):
        assert (first.rdma_remote_addr, first.rdma_rkey, second.rdma_remote_addr) == (0x9000, 0xBEEF, 0x1000)
