"""The embedded SmolLM2-135M through the whole engine (fp32, torch path): greedy output equals the
dense reference token for token on varied prompts, and one prompt's output is identical alone,
among 16 concurrent requests, with a warm (partial-block) prefix, and with chunked prefill."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from native_engine.config import EngineConfig
from native_engine.engine import CompletedRequest, LLMEngine
from native_engine.model.loaded import LoadedModel
from native_engine.model.weights import load_model
from native_engine.request import SamplingParams
from tests.native_engine.reference import ReferenceModel

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "Water boils at",
    "The quick brown fox",
    "Translate to French: good morning",
    "import numpy as np\nx = np.",
    "List three colors:",
    "Q: What is 12 times 12?\nA:",
    "A haiku about the sea:",
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(None, torch.float32)


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> LLMEngine:
    return build(loaded, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> ReferenceModel:
    return ReferenceModel(loaded.config, loaded.weights)


def build(loaded: LoadedModel, **kw) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 16, "num_blocks": 256, "dtype": "float32",
                          "attention_backend": "torch", **kw})
    return LLMEngine.from_config(cfg, loaded=loaded)


def assert_greedy(reference: ReferenceModel, engine: LLMEngine, prompt: list[int],
                  out: list[int], finish_reason: str | None) -> None:
    """Teacher-forced check, equivalent to comparing with `reference.greedy_generate` token for
    token (by induction) at one dense forward per prompt: every output token is the argmax of
    the reference's logits after the tokens before it, and the run ends where greedy ends."""
    logits = reference.logits([*prompt, *out])
    argmax = logits[len(prompt) - 1 :].argmax(-1).tolist()
    assert out == argmax[: len(out)]
    stops = engine.eos_token_ids
    assert not any(t in stops for t in out[:-1])
    if finish_reason == "stop":
        assert out[-1] in stops
    else:
        assert finish_reason == "length" and len(out) == MAX_TOKENS


@pytest.fixture(scope="module")
def concurrent(engine: LLMEngine) -> list[CompletedRequest]:
    extra = [f"Filler request number {i} says" for i in range(16 - len(TEXTS))]
    results = engine.generate([*TEXTS, *extra], GREEDY)  # 16 concurrent requests
    engine.check_integrity()
    return results


def test_batched_greedy_equals_reference(
    engine: LLMEngine, reference: ReferenceModel, concurrent: list[CompletedRequest]
) -> None:
    for result in concurrent[: len(TEXTS)]:
        assert_greedy(reference, engine, list(result.prompt_token_ids), list(result.token_ids),
                      result.finish_reason)


def test_same_prompt_alone_warm_and_chunked(
    engine: LLMEngine, reference: ReferenceModel, concurrent: list[CompletedRequest]
) -> None:
    text = TEXTS[2]
    assert engine.reset_prefix_cache()
    alone = engine.generate([text], GREEDY)[0]
    want = list(alone.token_ids)
    assert alone.cached_tokens == 0
    assert_greedy(reference, engine, list(alone.prompt_token_ids), want, alone.finish_reason)
    assert list(concurrent[2].token_ids) == want
    ids = engine.tokenizer.encode(text)
    assert engine.reset_prefix_cache()
    engine.generate([[*ids[:-2], 28]], SamplingParams(temperature=0, max_tokens=2))
    warm = engine.generate([text], GREEDY)[0]
    assert 0 < warm.cached_tokens == len(ids) - 2 and list(warm.token_ids) == want
    # Chunked prefill: a second engine over the same runner (this one's cache emptied first).
    assert engine.reset_prefix_cache()
    chunked = LLMEngine(replace(engine.config, max_num_batched_tokens=4), engine.runner,
                        engine.tokenizer)
    assert list(chunked.generate([text], GREEDY)[0].token_ids) == want
