"""Choosing the RDMA device and GID from the node's topology (libs/rdma/topology.py), on a fake sysfs
laid out as the kernel lays it out: two NUMA nodes, a PCIe switch under each root port, a GPU and a
NIC (with a VF) behind the switches."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.libs.rdma.topology import choose_nic, gid_index, interface_address

# numa 0: root complex pci0000:00, switch 0000:00:01.0 -> 0000:02:00.0; GPU 0000:03:00.0, NIC mlx5_0 0000:04:00.0
#          and a VF of it, mlx5_2, at 0000:04:00.2 (carrying net1)
# numa 1: root complex pci0000:80, GPU 0000:83:00.0 and NIC mlx5_1 0000:84:00.0 behind 0000:80:01.0/0000:82:00.0
PCI = {
    "0000:03:00.0": ("pci0000:00/0000:00:01.0/0000:02:00.0/0000:03:00.0", 0),
    "0000:04:00.0": ("pci0000:00/0000:00:01.0/0000:02:00.0/0000:04:00.0", 0),
    "0000:04:00.2": ("pci0000:00/0000:00:01.0/0000:02:00.0/0000:04:00.2", 0),
    "0000:05:00.0": ("pci0000:00/0000:00:02.0/0000:05:00.0", 0),
    "0000:83:00.0": ("pci0000:80/0000:80:01.0/0000:82:00.0/0000:83:00.0", 1),
    "0000:84:00.0": ("pci0000:80/0000:80:01.0/0000:82:00.0/0000:84:00.0", 1),
}
NICS = {"mlx5_0": "0000:04:00.0", "mlx5_1": "0000:84:00.0", "mlx5_2": "0000:04:00.2"}
NETDEVS = {"eth0": "0000:04:00.0", "eth1": "0000:84:00.0", "net1": "0000:04:00.2", "eth9": "0000:05:00.0"}
EMPTY_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def ipv4_gid(address: str) -> str:
    a, b, c, d = (int(x) for x in address.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def add_gid(sysfs: Path, device: str, index: int, gid: str, kind: str, ndev: str, port: int = 1) -> None:
    base = sysfs / "class" / "infiniband" / device / "ports" / str(port)
    for sub, value in (("gids", gid), ("gid_attrs/types", kind), ("gid_attrs/ndevs", ndev)):
        (base / sub).mkdir(parents=True, exist_ok=True)
        (base / sub / str(index)).write_text(value + "\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    for address, (path, numa) in PCI.items():
        function = root / "devices" / path
        function.mkdir(parents=True)
        (function / "numa_node").write_text(f"{numa}\n")
        (root / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
        (root / "bus" / "pci" / "devices" / address).symlink_to(function)
    for kind, names in (("infiniband", NICS), ("net", NETDEVS)):
        for name, address in names.items():
            (root / "class" / kind / name).mkdir(parents=True)
            (root / "class" / kind / name / "device").symlink_to(root / "bus" / "pci" / "devices" / address)
    return root


def test_the_nic_beside_each_gpu(sysfs: Path):
    assert choose_nic("0000:03:00.0", None, sysfs=sysfs).device == "mlx5_0"   # same switch (its VF ties: first name)
    assert choose_nic("0000:83:00.0", None, sysfs=sysfs).device == "mlx5_1"   # the other NUMA node's
    assert "nearest GPU 0000:83:00.0" in choose_nic("0000:83:00.0", None, sysfs=sysfs).why


def test_the_interfaces_own_function_wins_over_nearness(sysfs: Path):
    # a pod given the VF behind net1 uses it, even with its GPU beside the other NIC
    choice = choose_nic("0000:83:00.0", "net1", sysfs=sysfs)
    assert (choice.device, choice.why) == ("mlx5_2", "on the PCI function of net1")


def test_an_interface_without_rdma_falls_back_to_the_gpu_then_the_first(sysfs: Path):
    assert choose_nic("0000:83:00.0", "eth9", sysfs=sysfs).device == "mlx5_1"
    assert choose_nic(None, "eth9", sysfs=sysfs).device == "mlx5_0"
    assert choose_nic("0000:99:00.0", None, sysfs=sysfs).device == "mlx5_0"   # a GPU sysfs does not know
    assert choose_nic(None, None, sysfs=sysfs).why == "the first RDMA device"


def test_no_rdma_device_is_no_choice(tmp_path: Path):
    assert choose_nic("0000:03:00.0", "net1", sysfs=tmp_path) is None


def test_the_roce_v2_gid_of_the_interfaces_ipv4_address(sysfs: Path):
    add_gid(sysfs, "mlx5_2", 0, "fe80:0000:0000:0000:0000:00ff:fe00:0001", "IB/RoCE v1", "net1")
    add_gid(sysfs, "mlx5_2", 1, "fe80:0000:0000:0000:0000:00ff:fe00:0001", "RoCE v2", "net1")  # link-local
    add_gid(sysfs, "mlx5_2", 2, ipv4_gid("10.0.0.7"), "IB/RoCE v1", "net1")
    add_gid(sysfs, "mlx5_2", 3, ipv4_gid("192.168.1.5"), "RoCE v2", "vlan5")
    add_gid(sysfs, "mlx5_2", 4, ipv4_gid("10.0.0.7"), "RoCE v2", "net1")
    add_gid(sysfs, "mlx5_2", 5, EMPTY_GID, "RoCE v2", "net1")
    assert gid_index("mlx5_2", 1, "net1", sysfs) == 4
    assert gid_index("mlx5_2", 1, None, sysfs) == 3          # no interface named: the first RoCE v2 IPv4 GID
    assert gid_index("mlx5_2", 1, "eth9", sysfs) == 3        # none on it: any RoCE v2 IPv4 GID
    assert choose_nic(None, "net1", sysfs=sysfs).gid_index == 4


def test_infiniband_and_roce_v1_only_use_gid_0(sysfs: Path):
    assert gid_index("mlx5_0", 1, None, sysfs) == 0           # no GID attributes at all (InfiniBand)
    add_gid(sysfs, "mlx5_1", 0, ipv4_gid("10.1.0.2"), "IB/RoCE v1", "eth1")
    add_gid(sysfs, "mlx5_1", 1, ipv4_gid("10.1.0.2"), "IB/RoCE v1", "eth1", port=2)
    assert gid_index("mlx5_1", 1, "eth1", sysfs) == 0


def test_interface_address():
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="no IPv4 address on network interface 'nosuch0'.*interfaces: .*lo"):
        interface_address("nosuch0")
