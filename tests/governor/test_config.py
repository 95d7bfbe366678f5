from __future__ import annotations

from pathlib import Path

import pytest

from governor.config import ConfigError, load_config, parse_config

DIGEST = "a" * 64

EXAMPLE = f"""
[server]
host = "127.0.0.1"
port = 8000
data_dir = "./fak-data"
client_cache_salt = "reject"
admin_token_sha256 = "{DIGEST}"

[engine]
kind = "native"

[engine.declare]
priority_scheduling = false
prefix_reset = false
prompt_tokens_details = false
determinism = "unavailable"

[[tenants]]
id = "acme"
api_key_sha256 = ["{"b" * 64}"]
class = "interactive"
max_concurrency = 16
max_tokens = 2048
"""


def test_issue_example_loads(tmp_path: Path) -> None:
    path = tmp_path / "fak.toml"
    path.write_text(EXAMPLE)
    config = load_config(path)
    assert config.server.port == 8000
    assert config.server.admin_token_sha256 == DIGEST
    assert config.engine.kind == "native"
    acme = config.tenant("acme")
    assert acme is not None and acme.tenant_class == "interactive"
    assert acme.api_key_sha256 == ("b" * 64,)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"server": {"client_cache_salt": "allow"}}, "client_cache_salt"),
        ({"server": {"admin_token_sha256": "xyz"}}, "admin_token_sha256"),
        ({"server": {"port": 0}}, "port"),
        ({"server": {"bogus": 1}}, "bogus"),
        ({"engine": {"kind": "tgi"}}, "kind"),
        ({"engine": {"kind": "vllm"}}, "base_url"),
        ({"engine": {"declare": {"speed": True}}}, "speed"),
        ({"tenants": [{"id": "a", "api_key_sha256": []}]}, "api_key_sha256"),
        ({"tenants": [{"id": "a b", "api_key_sha256": [DIGEST]}]}, "id"),
        ({"tenants": [{"id": "a", "api_key_sha256": [DIGEST], "class": "vip"}]}, "class"),
        ({"tenants": [{"id": "a", "api_key_sha256": [DIGEST]},
                      {"id": "a", "api_key_sha256": ["c" * 64]}]}, "unique"),
        ({"tenants": [{"id": "a", "api_key_sha256": [DIGEST]},
                      {"id": "b", "api_key_sha256": [DIGEST]}]}, "twice"),
        ({"extra": {}}, "extra"),
        ({"engine": {"kv_offloading_size": 0}}, "kv_offloading_size"),
        ({"engine": {"kv_disk_dir": "/var/kv"}}, "kv_disk_size"),
        ({"engine": {"kv_disk_size": 4}}, "kv_disk_dir"),
    ],
)
def test_bad_configs_name_the_key(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_config(raw)


def test_unparseable_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server\nport=")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(path)


def test_engine_kv_tier_keys_reach_the_native_engine() -> None:
    from adapters.native import NativeDriverConfig

    config = parse_config({"engine": {"kind": "native", "kv_offloading_size": 1.5,
                                      "kv_disk_dir": "/var/lib/fak/kv", "kv_disk_size": 20}})
    engine = NativeDriverConfig.from_section(config.engine).engine
    assert (engine.kv_offloading_size, engine.kv_disk_dir, engine.kv_disk_size) == \
        (1.5, "/var/lib/fak/kv", 20)
    assert engine.tiered
