"""Which RDMA device, and which GID of it, an engine's data plane uses: read from the node's
topology in sysfs, so that the KV of GPU i goes through the NIC beside it (KVDirect 4.2).

The device, in order of preference:
1. the one on the PCI function of the data-plane interface: the VF a secondary network (Multus,
   SR-IOV) gave the pod is the one the pod may use;
2. the one nearest the GPU on the PCIe tree: the deepest shared ancestor (the same switch beats
   the same root complex), then the same NUMA node;
3. the first by name.
The GID (RoCE): the RoCE v2 GID holding an IPv4 address of the data-plane interface, else any RoCE
v2 GID with an IPv4 address, else 0 (InfiniBand, or RoCE v1 only) — as NCCL and Mooncake choose it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys")
SIOCGIFADDR = 0x8915  # linux/sockios.h


@dataclass(frozen=True)
class NicChoice:
    device: str
    gid_index: int
    why: str  # how the device was chosen, for the engine's log and state


def interface_address(name: str) -> str:
    """The IPv4 address of a network interface (say, net1 of a secondary network)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise ValueError(f"no IPv4 address on network interface {name!r}: {exc.strerror} "
                             f"(interfaces: {', '.join(sorted(n for _, n in socket.if_nameindex()))})") from None
    return socket.inet_ntoa(answer[20:24])


def gpu_pci_address(device: str) -> str | None:
    """The PCI address (domain:bus:device.function) of a CUDA device, None for anything else."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.device(device))
    if not hasattr(props, "pci_bus_id"):
        return None
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def choose_nic(gpu_pci: str | None, interface: str | None, port: int = 1, sysfs: Path = SYSFS) -> NicChoice | None:
    """The RDMA device and GID index for a GPU (its PCI address) and a data-plane interface; None when
    the node has no RDMA device."""
    devices = sorted(p.name for p in (sysfs / "class" / "infiniband").glob("*"))
    if not devices:
        return None
    function = lambda path: _resolved(path / "device")  # noqa: E731
    on_interface = function(sysfs / "class" / "net" / interface) if interface else None
    device, why = devices[0], "the first RDMA device"
    if on_interface is not None and (match := [d for d in devices
                                               if function(sysfs / "class" / "infiniband" / d) == on_interface]):
        device, why = match[0], f"on the PCI function of {interface}"
    elif gpu_pci is not None and (gpu := _resolved(sysfs / "bus" / "pci" / "devices" / gpu_pci)) is not None:
        gpu_numa = _numa_node(gpu)

        def nearness(name: str) -> tuple[int, bool]:
            nic = function(sysfs / "class" / "infiniband" / name)
            if nic is None:
                return (0, False)
            return (len(os.path.commonpath([gpu, nic]).split(os.sep)), _numa_node(nic) == gpu_numa)

        device = max(devices, key=nearness)  # on a tie, the first by name
        why = f"nearest GPU {gpu_pci} on the PCIe tree"
    return NicChoice(device, gid_index(device, port, interface, sysfs), why)


def gid_index(device: str, port: int, interface: str | None, sysfs: Path = SYSFS) -> int:
    """The RoCE v2 GID with an IPv4 address, on `interface` if one is; 0 when there is none."""
    attrs = sysfs / "class" / "infiniband" / device / "ports" / str(port)
    candidates = []
    for path in (attrs / "gid_attrs" / "types").glob("*"):
        index = int(path.name)
        try:
            if _read(path) != "RoCE v2" or not _ipv4_mapped(_read(attrs / "gids" / path.name)):
                continue
        except (OSError, ValueError):
            continue  # an unset GID slot reads as an error
        ndev = _read_or_none(attrs / "gid_attrs" / "ndevs" / path.name)
        candidates.append((ndev != interface if interface else False, index))
    return min(candidates)[1] if candidates else 0


def _ipv4_mapped(gid: str) -> bool:
    return ipaddress.IPv6Address(gid).ipv4_mapped is not None


def _resolved(path: Path) -> str | None:
    return str(path.resolve()) if path.exists() else None


def _numa_node(pci_path: str) -> int:
    return int(_read_or_none(Path(pci_path) / "numa_node") or -1)


def _read(path: Path) -> str:
    return path.read_text().strip()


def _read_or_none(path: Path) -> str | None:
    try:
        return _read(path)
    except OSError:
        return None
