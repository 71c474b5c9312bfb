"""The reliable-connected queue pair's state machine and completion statuses, as plain data.

Each transition (RESET -> INIT at creation, INIT -> RTR -> RTS once the peer's queue pair is known,
anything -> ERR at teardown) is a `Transition`: the target state, the `ibv_qp_attr` fields to set and
the attribute mask, named as in <infiniband/verbs.h>. `device.apply` turns one into a QPAttr and an
`ibv_modify_qp`; nothing here needs pyverbs or a device, so the values are unit-tested exactly.
Attribute values are ints, an enum name (str), a tuple of flag names (OR-ed) or a `Route`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..work import Opcode, Status
from .handshake import QpInfo

ACCESS_FLAGS = ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_WRITE")
MTU_BYTES = (256, 512, 1024, 2048, 4096)  # IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5

MIN_RNR_TIMER = 12  # 0.64 ms before a SEND that found no posted receive is retried
RNR_RETRY = 7  # 7 means forever: a SEND waits for the peer to post its receive, as the other backends do
ACK_TIMEOUT = 14  # 4.096 us * 2**14 = 67 ms per try ...
RETRY_COUNT = 7  # ... so a dead peer fails outstanding work within about half a second
HOP_LIMIT = 64
MAX_RD_ATOMIC = 16  # READs in flight per queue pair, if the device allows as many


@dataclass(frozen=True)
class LocalPort:
    """What the local end of a connection contributes: port, addressing and capabilities."""

    port_num: int
    lid: int
    gid: bytes
    gid_index: int
    mtu: int  # bytes
    ethernet: bool  # RoCE: the link layer is Ethernet, so every packet carries a GRH
    rd_atomic: int


@dataclass(frozen=True)
class Route:
    """An `ibv_ah_attr`: how packets reach the peer (by LID, or by GID with a global route header)."""

    port_num: int
    dlid: int
    is_global: bool
    dgid: str | None = None  # 'xxxx:xxxx:...:xxxx', as pyverbs' GID takes it
    sgid_index: int = 0
    hop_limit: int = 0
    sl: int = 0
    traffic_class: int = 0
    flow_label: int = 0


@dataclass(frozen=True)
class Transition:
    state: str
    attrs: dict[str, int | str | tuple[str, ...] | Route]
    mask: tuple[str, ...]


def qp_info(port: LocalPort, qp_num: int, psn: int) -> QpInfo:
    """What this side tells the peer about its queue pair."""
    return QpInfo(qp_num=qp_num, psn=psn, lid=port.lid, gid=port.gid, mtu=port.mtu, rd_atomic=port.rd_atomic)


def to_init(port: LocalPort) -> Transition:
    return Transition("IBV_QPS_INIT",
                      {"pkey_index": 0, "port_num": port.port_num, "qp_access_flags": ACCESS_FLAGS},
                      ("IBV_QP_STATE", "IBV_QP_PKEY_INDEX", "IBV_QP_PORT", "IBV_QP_ACCESS_FLAGS"))


def to_rtr(port: LocalPort, remote: QpInfo) -> Transition:
    """Ready to receive from the peer's queue pair: its number, first PSN, path and READ depth."""
    return Transition("IBV_QPS_RTR",
                      {"path_mtu": mtu_name(min(port.mtu, remote.mtu)), "dest_qp_num": remote.qp_num,
                       "rq_psn": remote.psn, "max_dest_rd_atomic": rd_atomic(port, remote),
                       "min_rnr_timer": MIN_RNR_TIMER, "ah_attr": route(port, remote)},
                      ("IBV_QP_STATE", "IBV_QP_AV", "IBV_QP_PATH_MTU", "IBV_QP_DEST_QPN", "IBV_QP_RQ_PSN",
                       "IBV_QP_MAX_DEST_RD_ATOMIC", "IBV_QP_MIN_RNR_TIMER"))


def to_rts(port: LocalPort, remote: QpInfo, psn: int) -> Transition:
    """Ready to send: our first PSN, the retransmission policy and how many READs may be in flight."""
    return Transition("IBV_QPS_RTS",
                      {"sq_psn": psn, "timeout": ACK_TIMEOUT, "retry_cnt": RETRY_COUNT, "rnr_retry": RNR_RETRY,
                       "max_rd_atomic": rd_atomic(port, remote)},
                      ("IBV_QP_STATE", "IBV_QP_TIMEOUT", "IBV_QP_RETRY_CNT", "IBV_QP_RNR_RETRY", "IBV_QP_SQ_PSN",
                       "IBV_QP_MAX_QP_RD_ATOMIC"))


def to_error() -> Transition:
    """Stop the queue pair: the NIC flushes what is outstanding and serves the peer nothing more."""
    return Transition("IBV_QPS_ERR", {}, ("IBV_QP_STATE",))


def route(port: LocalPort, remote: QpInfo) -> Route:
    """RoCE (or a peer without a LID) is reached by GID with a GRH; an InfiniBand subnet by LID."""
    if port.ethernet or remote.lid == 0:
        return Route(port_num=port.port_num, dlid=0, is_global=True, dgid=gid_text(remote.gid),
                     sgid_index=port.gid_index, hop_limit=HOP_LIMIT)
    return Route(port_num=port.port_num, dlid=remote.lid, is_global=False)


def rd_atomic(port: LocalPort, remote: QpInfo) -> int:
    """Our requester may not keep more READs in flight than the peer's responder accepts."""
    return max(1, min(port.rd_atomic, remote.rd_atomic, MAX_RD_ATOMIC))


def mtu_name(mtu: int) -> str:
    if mtu not in MTU_BYTES:
        raise ValueError(f"{mtu} is not an InfiniBand MTU ({', '.join(map(str, MTU_BYTES))})")
    return f"IBV_MTU_{mtu}"


def mtu_bytes(ibv_mtu: int) -> int:
    """Bytes of an `enum ibv_mtu` value (a port's active_mtu)."""
    return MTU_BYTES[ibv_mtu - 1]


def gid_text(gid: bytes) -> str:
    if len(gid) != 16:
        raise ValueError(f"a GID is 16 bytes, not {len(gid)}")
    return ":".join(gid[i:i + 2].hex() for i in range(0, 16, 2))


def gid_bytes(text: str) -> bytes:
    raw = bytes.fromhex(text.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"not a GID: {text!r}")
    return raw


# Completion statuses (enum ibv_wc_status) as the core's Status. Anything not listed is the
# transport's failure.
_STATUS = {
    "IBV_WC_SUCCESS": Status.SUCCESS,
    "IBV_WC_REM_ACCESS_ERR": Status.REMOTE_ACCESS_ERROR,
    "IBV_WC_LOC_LEN_ERR": Status.LENGTH_ERROR,
    "IBV_WC_WR_FLUSH_ERR": Status.FLUSHED,
}


def completion_status(wc_status: str, opcode: Opcode) -> Status:
    """The core's Status for a work completion's status name, for work of `opcode`."""
    if wc_status == "IBV_WC_REM_INV_REQ_ERR":
        # The responder rejected the request: for a SEND, a message longer than its receive buffer;
        # for a READ or WRITE, a request it does not accept (too long, or not allowed on its QP).
        return Status.LENGTH_ERROR if opcode is Opcode.SEND else Status.REMOTE_ACCESS_ERROR
    return _STATUS.get(wc_status, Status.TRANSPORT_ERROR)


WC_STATUS_NAMES = ("IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_EEC_OP_ERR",
                   "IBV_WC_LOC_PROT_ERR", "IBV_WC_WR_FLUSH_ERR", "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR",
                   "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR",
                   "IBV_WC_REM_OP_ERR", "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR",
                   "IBV_WC_LOC_RDD_VIOL_ERR", "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR",
                   "IBV_WC_INV_EECN_ERR", "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR",
                   "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR")

# Affiliated asynchronous events that mean a queue pair went to the error state on its own; an
# access error is the responder refusing a peer's READ or WRITE (bad key or outside the region).
QP_ERROR_EVENTS = ("IBV_EVENT_QP_FATAL", "IBV_EVENT_QP_REQ_ERR", "IBV_EVENT_QP_ACCESS_ERR")
ACCESS_ERROR_EVENT = "IBV_EVENT_QP_ACCESS_ERR"
DEVICE_FATAL_EVENT = "IBV_EVENT_DEVICE_FATAL"
