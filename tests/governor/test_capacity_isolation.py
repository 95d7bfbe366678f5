"""SEC-9 through the governor: a tenant's `cache_share` keeps its cached prefix through
another tenant's flood on the native engine (the tenant is the engine's cache group); a
ridden engine has no such isolation, and a config asking for it there is refused."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from adapters.native import NativeDriver, NativeDriverConfig
from governor.auth import sha256_hex
from governor.config import ConfigError, parse_config
from governor.serve import build_driver, build_governor
from native_engine.config import EngineConfig
from policies.salts import SaltKey
from tests.http_client import HTTP
from tests.native_engine.tiny_model import random_model

from .server_thread import ServerThread


def tenants(share: float | None) -> list[dict]:
    a = {"id": "a", "api_key_sha256": [sha256_hex("key-a")], "max_tokens": 1}
    if share is not None:
        a["cache_share"] = share
    return [a, {"id": "b", "api_key_sha256": [sha256_hex("key-b")], "max_tokens": 1}]


def cached_after_flood(tmp_path: Path, share: float | None) -> int:
    config = parse_config({"server": {"data_dir": str(tmp_path)}, "engine": {"kind": "native"},
                           "tenants": tenants(share)})
    shares = tuple((t.id, t.cache_share) for t in config.tenants if t.cache_share)
    engine = EngineConfig(num_blocks=48, block_size=8, max_model_len=256,
                          max_num_batched_tokens=256, scheduling_policy="priority",
                          cache_shares=shares)
    driver = NativeDriver(NativeDriverConfig(engine=engine), loaded=random_model(seed=9))
    thread = ServerThread()
    try:
        thread.run(driver.start())
        url = thread.serve(build_governor(config, driver, create_key=True))
        rng = random.Random(4)
        prompt = [rng.randrange(3, 259) for _ in range(64)]

        def complete(key: str, ids: list[int]) -> int:
            r = HTTP.post(url + "/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"prompt": ids, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        complete("key-a", prompt)
        for _ in range(24):
            complete("key-b", [rng.randrange(3, 259) for _ in range(96)])
        return complete("key-a", prompt)
    finally:
        thread.run(driver.close())
        thread.stop()


def test_a_cache_share_survives_another_tenants_flood(tmp_path: Path) -> None:
    assert cached_after_flood(tmp_path / "shared", 0.25) >= 56
    assert cached_after_flood(tmp_path / "none", None) == 0


def test_a_ridden_engine_cannot_promise_a_share(tmp_path: Path) -> None:
    config = parse_config({"server": {"data_dir": str(tmp_path)},
                           "engine": {"kind": "vllm", "base_url": "http://127.0.0.1:9"},
                           "tenants": tenants(0.5)})
    with pytest.raises(ConfigError, match="capacity isolation"):
        build_driver(config, SaltKey(b"k" * 32))
    with pytest.raises(ConfigError, match="cache_share"):
        parse_config({"server": {"data_dir": str(tmp_path)},
                      "tenants": [{**t, "cache_share": 0.6} for t in tenants(None)]})
