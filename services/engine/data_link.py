"""Where an engine's data plane listens and, with the verbs backend, which RDMA device, port and GID
it uses (libs/rdma/topology.py chooses from the node's topology when told `auto`); what the engine
registers as its GPU-to-NIC pairing (KVDirect 4.2)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.libs.controlplane import ConfigError
from kvmesh.libs.rdma.topology import SYSFS, choose_nic, gid_index, gpu_pci_address, interface_address

from .config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataLink:
    host: str                                  # the address the data plane listens on and advertises
    nic: str                                   # the RDMA device (verbs), else the backend's name
    gpu: int                                   # the CUDA device index (0 on CPU)
    options: dict = field(default_factory=dict)  # the backend's own: device, gid_index, ib_port


def data_link(config: EngineConfig, sysfs: Path = SYSFS) -> DataLink:
    if not config.token:
        raise ConfigError(f"dataplane {config.dataplane}: the data plane needs the cluster token (token, KVMESH_TOKEN), "
                          "which its CONNECT carries; or set dataplane = \"none\"")
    try:
        host = interface_address(config.data_interface) if config.data_interface else config.data_host
    except ValueError as exc:
        raise ConfigError(f"data_interface: {exc}") from None
    gpu = int(config.device.partition(":")[2] or 0) if config.device.startswith("cuda") else 0
    if config.dataplane != "verbs":
        return DataLink(host, config.dataplane, gpu)
    device = config.rdma_device
    if device == "auto":
        choice = choose_nic(gpu_pci_address(config.device), config.data_interface, config.rdma_port, sysfs)
        if choice is None:
            raise ConfigError("dataplane verbs: this node has no RDMA device (/sys/class/infiniband is empty)")
        device = choice.device
        log.info("RDMA device %s: %s", device, choice.why)
    gid = config.rdma_gid_index
    if gid is None:
        gid = gid_index(device, config.rdma_port, config.data_interface, sysfs)
    return DataLink(host, device, gpu, {"device": device, "gid_index": gid, "ib_port": config.rdma_port})
