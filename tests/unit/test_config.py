"""Configuration: defaults, then file, then the service's table, then environment."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvmesh.libs.controlplane import ConfigError, ServiceConfig, effective, load_config


class DemoConfig(ServiceConfig, kw_only=True):
    port: int = 9000
    redis_url: str = "redis://127.0.0.1:6379/0"
    weights: list[float] = msgspec.field(default_factory=lambda: [1.0])


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvmesh.toml"
    path.write_text(text)
    return path


def test_embedded_defaults_need_no_file_or_environment():
    assert load_config(DemoConfig, "demo", env={}) == DemoConfig()


def test_precedence_defaults_file_section_shared_env_service_env(tmp_path: Path):
    path = write(tmp_path, 'cluster = "from-file"\nport = 1\n[demo]\nport = 2\nlog_level = "DEBUG"\n')
    config = load_config(DemoConfig, "demo", path, env={"KVMESH_PORT": "3", "KVMESH_CLUSTER": "from-env",
                                                         "KVMESH_DEMO_WEIGHTS": "[0.5, 2]"})
    assert (config.port, config.cluster, config.log_level, config.weights) == (3, "from-env", "DEBUG", [0.5, 2.0])
    assert load_config(DemoConfig, "demo", path, env={"KVMESH_PORT": "3", "KVMESH_DEMO_PORT": "4"}).port == 4


def test_shared_config_ignores_service_tables_and_service_env(tmp_path: Path):
    path = write(tmp_path, 'token = "t"\n[demo]\ntoken = "other"\n')
    shared = load_config(ServiceConfig, None, path, env={"KVMESH_DEMO_CLUSTER": "x", "KVMESH_CLUSTER": "c"})
    assert (shared.token, shared.cluster) == ("t", "c")


def test_config_file_named_by_environment(tmp_path: Path):
    path = write(tmp_path, "[demo]\nport = 7\n")
    assert load_config(DemoConfig, "demo", env={"KVMESH_CONFIG": str(path)}).port == 7


@pytest.mark.parametrize("text, env, message", [
    ("[demo]\nprot = 1\n", {}, "unknown keys: prot"),
    ("[demo]\nport = 'x'\n", {}, "port"),
    ("", {"KVMESH_DEMO_PORT": "eighty"}, "port"),
    ("not toml = = =", {}, "cannot read config file"),
])
def test_bad_configuration_is_a_clear_error(tmp_path: Path, text: str, env: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        load_config(DemoConfig, "demo", write(tmp_path, text), env=env)


def test_effective_config_hides_secrets():
    shown = effective(DemoConfig(token="t0ps3cret", redis_url="redis://user:hunter2@db:6379/0"))
    assert shown["token"] == "***" and shown["redis_url"] == "redis://user:***@db:6379/0"
