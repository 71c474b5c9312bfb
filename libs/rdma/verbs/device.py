"""The pyverbs side of the verbs backend: opening the device, and applying the plain-data plans.

pyverbs is imported inside functions, so this module imports on any machine; everything here needs
rdma-core's Python bindings and an RDMA device (a NIC or Soft-RoCE) to run.

Two file descriptors are read with the event loop: a completion channel's and the device context's
asynchronous-event fd. Recent pyverbs (rdma-core 56+) has `CompChannel.fd`; older releases, and the
async fd in every release, are not exposed, so they are found as the one "[infinibandevent]"
descriptor that creating the object opened (see `_opened_event_fd`).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..work import RdmaError
from .plan import LocalPort, Route, Transition, gid_bytes, mtu_bytes
from .work_requests import Chunk, WorkRequest

EVENT_FD_LINK = "anon_inode:[infinibandevent]"
_event_fd_lock = threading.Lock()


class DeviceError(RdmaError):
    """The RDMA device cannot be opened or used as configured."""


def unavailable_reason() -> str | None:
    """None when pyverbs imports and lists a device, else why the verbs backend cannot run here."""
    try:
        from pyverbs import device
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        return (f"pyverbs is not importable from this Python: {exc} (install rdma-core's python3-pyverbs "
                "and use a venv made with --system-site-packages)")
    try:
        devices = device.get_device_list()
    except PyverbsError as exc:
        return f"no RDMA device (ibv_get_device_list failed: {exc}: no kernel RDMA support, or no permission)"
    if not devices:
        return "no RDMA device (ibv_get_device_list returned none)"
    return None


def enum(name: str) -> int:
    from pyverbs import enums

    return getattr(enums, name)


def flags(names: tuple[str, ...]) -> int:
    value = 0
    for name in names:
        value |= enum(name)
    return value


def enum_names(names: tuple[str, ...]) -> dict[int, str]:
    """Value -> name for the names this rdma-core defines."""
    from pyverbs import enums

    return {getattr(enums, name): name for name in names if hasattr(enums, name)}


@dataclass
class Device:
    """An opened device port: its context, a protection domain, and what connections need of it."""

    context: Any
    pd: Any
    port: LocalPort
    max_qp_wr: int
    max_message: int
    async_fd: int

    @classmethod
    def open(cls, name: str | None, ib_port: int, gid_index: int) -> Device:
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError

        reason = unavailable_reason()
        if reason is not None:
            raise DeviceError(reason)
        names = [d.name.decode() for d in get_device_list()]
        if name is not None and name not in names:
            raise DeviceError(f"no RDMA device {name!r}; there are: {', '.join(names)}")
        name = name or names[0]
        try:
            context, async_fd = _opened_event_fd(lambda: Context(name=name))
        except PyverbsError as exc:
            raise DeviceError(f"opening RDMA device {name}: {exc}") from exc
        try:
            port_attr, device_attr = context.query_port(ib_port), context.query_device()
            port = _local_port(context, name, ib_port, gid_index, port_attr, device_attr.max_qp_rd_atom)
            set_nonblocking(async_fd)
            return cls(context, PD(context), port, device_attr.max_qp_wr, port_attr.max_msg_sz, async_fd)
        except BaseException as exc:
            context.close()
            if isinstance(exc, PyverbsError):
                raise DeviceError(f"RDMA device {name} port {ib_port}: {exc}") from exc
            raise

    def close(self) -> None:
        self.context.close()  # pyverbs closes what hangs off the context (PD, MRs, QPs, CQs) first


def _local_port(context: Any, name: str, ib_port: int, gid_index: int, attr: Any, rd_atomic: int) -> LocalPort:
    if attr.state != enum("IBV_PORT_ACTIVE"):
        raise DeviceError(f"port {ib_port} of RDMA device {name} is not active (state {attr.state})")
    gid = gid_bytes(context.query_gid(ib_port, gid_index).gid)
    ethernet = attr.link_layer == enum("IBV_LINK_LAYER_ETHERNET")
    if ethernet and not any(gid):
        raise DeviceError(f"GID index {gid_index} of {name} port {ib_port} is empty; RoCE needs a GID (gid_index=)")
    return LocalPort(port_num=ib_port, lid=attr.lid, gid=gid, gid_index=gid_index, mtu=mtu_bytes(attr.active_mtu),
                     ethernet=ethernet, rd_atomic=max(1, rd_atomic))


def apply(qp: Any, transition: Transition) -> None:
    """ibv_modify_qp with the transition's attributes and mask."""
    from pyverbs.qp import QPAttr

    attr = QPAttr()
    attr.qp_state = enum(transition.state)
    for name, value in transition.attrs.items():
        setattr(attr, name, _value(value))
    qp.modify(attr, flags(transition.mask))


def _value(value: int | str | tuple[str, ...] | Route) -> Any:
    if isinstance(value, Route):
        return _ah_attr(value)
    if isinstance(value, str):
        return enum(value)
    if isinstance(value, tuple):
        return flags(value)
    return value


def _ah_attr(route: Route) -> Any:
    from pyverbs.addr import GID, AHAttr, GlobalRoute

    grh = None
    if route.is_global:
        grh = GlobalRoute(dgid=GID(route.dgid), flow_label=route.flow_label, sgid_index=route.sgid_index,
                          hop_limit=route.hop_limit, traffic_class=route.traffic_class)
    return AHAttr(dlid=route.dlid, sl=route.sl, is_global=int(route.is_global), port_num=route.port_num, gr=grh)


def send_wrs(chunk: Chunk) -> list[Any]:
    """The chunk's requests as linked SendWRs (keep the list alive until ibv_post_send returns)."""
    wrs: list[Any] = []
    for request in reversed(chunk.requests):
        wrs.append(_send_wr(chunk.id, request, wrs[-1] if wrs else None))
    wrs.reverse()
    return wrs


def _send_wr(wr_id: int, request: WorkRequest, following: Any) -> Any:
    from pyverbs.wr import SGE, SendWR

    wr = SendWR(wr_id=wr_id, opcode=enum(request.opcode), num_sge=1,
                sg=[SGE(request.local_addr, request.length, request.lkey)],
                send_flags=enum("IBV_SEND_SIGNALED") if request.signaled else 0, next_wr=following)
    if request.opcode != "IBV_WR_SEND":
        wr.set_wr_rdma(request.rkey, request.remote_addr)
    return wr


def recv_wr(wr_id: int, addr: int, length: int, lkey: int) -> Any:
    from pyverbs.wr import SGE, RecvWR

    return RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(addr, length, lkey)])


def completion_channel(context: Any) -> tuple[Any, int]:
    """A completion channel and its (non-blocking) fd."""
    from pyverbs.cq import CompChannel

    if hasattr(CompChannel, "fd"):
        channel = CompChannel(context)
        fd = channel.fd
    else:
        channel, fd = _opened_event_fd(lambda: CompChannel(context))
    set_nonblocking(fd)
    return channel, fd


def set_nonblocking(fd: int) -> None:
    """Event fds are read only when the loop says they are readable; a spurious wake must not block."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)


def _opened_event_fd(create: Callable[[], Any]) -> tuple[Any, int]:
    """Run `create`, which opens exactly one RDMA event fd, and return what it made with that fd.

    The lock covers this module's own creations; a second RDMA library opening event fds in the same
    process at the same moment is detected (two new fds) rather than guessed between.
    """
    with _event_fd_lock:
        before = _event_fds()
        made = create()
        opened = _event_fds() - before
    if len(opened) != 1:
        raise DeviceError(f"expected one new RDMA event fd, found {sorted(opened)}")
    return made, opened.pop()


def _event_fds() -> set[int]:
    fds = set()
    for entry in os.scandir("/proc/self/fd"):
        try:
            if os.readlink(entry.path) == EVENT_FD_LINK:
                fds.add(int(entry.name))
        except OSError:  # closed since listed
            continue
    return fds
