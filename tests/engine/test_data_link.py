"""Where an engine's data plane listens and which RDMA device, port and GID it opens
(services/engine/data_link.py), on the fake sysfs of tests/rdma/test_topology.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.libs.controlplane import ConfigError
from kvmesh.services.engine.data_link import data_link
from kvmesh.services.engine.config import EngineConfig

from ..rdma.test_topology import add_gid, ipv4_gid, sysfs  # noqa: F401 (the fixture)


def config(**settings) -> EngineConfig:
    return EngineConfig(token="t", **settings)


def test_tcp_listens_on_data_host_or_on_the_interface():
    assert data_link(config(data_host="0.0.0.0")).host == "0.0.0.0"
    link = data_link(config(data_host="0.0.0.0", data_interface="lo"))
    assert (link.host, link.nic, link.gpu, link.options) == ("127.0.0.1", "tcp", 0, {})


def test_verbs_opens_the_device_topology_chooses(sysfs: Path):  # noqa: F811
    add_gid(sysfs, "mlx5_0", 3, ipv4_gid("10.0.0.7"), "RoCE v2", "eth0")
    link = data_link(config(dataplane="verbs", device="cuda:1"), sysfs)
    assert (link.nic, link.gpu, link.options) == ("mlx5_0", 1, {"device": "mlx5_0", "gid_index": 3, "ib_port": 1})


def test_verbs_settings_given_are_taken_as_they_are(sysfs: Path):  # noqa: F811
    link = data_link(config(dataplane="verbs", rdma_device="mlx5_1", rdma_port=2, rdma_gid_index=5), sysfs)
    assert link.options == {"device": "mlx5_1", "gid_index": 5, "ib_port": 2}


def test_what_cannot_be_had_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="no RDMA device"):
        data_link(config(dataplane="verbs"), tmp_path)
    with pytest.raises(ConfigError, match="data_interface: no IPv4 address on network interface 'nosuch0'"):
        data_link(config(data_interface="nosuch0"))
    with pytest.raises(ConfigError, match="needs the cluster token"):
        data_link(EngineConfig())
