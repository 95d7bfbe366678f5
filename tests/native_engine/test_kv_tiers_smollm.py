"""The KV tiers on the real SmolLM2-135M (fp32, torch path): greedy output served from the
device pool, the host tier or the disk tier is token-identical to a cold run, and SEC-8 holds
in each tier (the owner hits, another namespace with the same bytes gets 0 cached tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from native_engine.engine import CompletedRequest
from native_engine.model.loaded import LoadedModel
from native_engine.model.weights import load_model
from native_engine.request import SamplingParams
from tests.native_engine.tier_helpers import block_bytes_of, build, evict_device, run, tier
from tests.native_engine.tier_helpers import tier_config as tiered

pytestmark = pytest.mark.slow

BS = 16
TEXT = ("You are a careful assistant. Answer briefly and cite the rule you apply.\n"
        "User: The quick brown fox jumps over the lazy dog. Which animal jumps, and over what?")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(None, torch.float32)


@pytest.fixture(scope="module")
def cold(loaded: LoadedModel) -> CompletedRequest:
    engine = build(loaded, block_size=BS, num_blocks=32, dtype="float32",
                   attention_backend="torch", enable_prefix_caching=False)
    return run(engine, loaded.tokenizer.encode(TEXT), greedy(None))


def greedy(namespace: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, namespace=namespace)


@pytest.mark.parametrize("place", ["GPU", "CPU", "DISK"])
def test_each_tier_round_trips_exactly_and_keeps_tenants_apart(
        loaded: LoadedModel, cold: CompletedRequest, tmp_path: Path, place: str) -> None:
    prompt = loaded.tokenizer.encode(TEXT)
    full = (len(prompt) - 1) // BS * BS
    config = tiered(block_bytes_of(loaded, BS), 16 if place == "CPU" else 0,
                    tmp_path if place == "DISK" else None, block_size=BS, num_blocks=32)
    engine = build(loaded, **{f: getattr(config, f) for f in config.__dataclass_fields__})
    first = run(engine, prompt, greedy("tenant-a"))
    if place != "GPU":
        evict_device(engine)
    owner = run(engine, prompt, greedy("tenant-a"))
    if place != "GPU":
        evict_device(engine)
        assert tier(engine, place).promotions == full // BS
    intruder = run(engine, prompt, greedy("tenant-b"))
    assert first.token_ids == owner.token_ids == intruder.token_ids == cold.token_ids
    assert owner.cached_tokens >= full > 0
    assert intruder.cached_tokens == 0
