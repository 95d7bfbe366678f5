"""ModelRunner over the paged KV cache against the dense no-cache reference.

Runners here use one torch thread: on a shared 2-core machine two OpenMP threads spin-wait
on each other and a decode step runs several times slower.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from native_engine.model.runner import ModelRunner, RunnerConfig
from native_engine.model.weights import load_model
from tests.native_engine.reference import ReferenceModel
from tests.native_engine.runner_batches import BatchChunk, runner_batch
from tests.native_engine.tiny_model import random_model


@dataclass
class Trace:
    """One request driven through the runner: its tokens and the logits rows it got."""

    tokens: list[int]
    prompt_len: int
    block_table: list[int]
    computed: int = 0
    rows: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


def drive(runner: ModelRunner, prompts: list[list[int]], chunk_cap: int,
          decode_steps: int, seed: int = 0) -> list[Trace]:
    """Run all prompts together: chunked prefill (≤ chunk_cap per request per step), then
    greedy decode until each has `decode_steps` new tokens. Blocks are handed out shuffled."""
    bs = runner.block_size
    free = list(range(runner.num_blocks))
    random.Random(seed).shuffle(free)
    traces = []
    for prompt in prompts:
        need = -(-(len(prompt) + decode_steps) // bs)
        traces.append(Trace(list(prompt), len(prompt), [free.pop() for _ in range(need)]))
    while True:
        active = [t for t in traces if t.generated < decode_steps]
        if not active:
            return traces
        chunks = []
        for t in active:
            n = min(chunk_cap, len(t.tokens) - t.computed)
            chunks.append(BatchChunk(t.tokens[t.computed:t.computed + n], t.computed,
                                     t.block_table))
        logits = runner.execute(runner_batch(chunks, bs))
        for t, chunk, row in zip(active, chunks, logits, strict=True):
            t.computed += len(chunk.token_ids)
            t.rows[t.computed - 1] = row
            if t.computed == len(t.tokens):
                t.tokens.append(int(row.argmax()))


def check_against_reference(ref: ReferenceModel, traces: list[Trace], atol: float) -> None:
    for t in traces:
        expected = ref.logits(t.tokens[:-1])
        for pos, row in t.rows.items():
            torch.testing.assert_close(row, expected[pos], atol=atol, rtol=0)
        greedy = expected[t.prompt_len - 1:].argmax(-1).tolist()
        assert greedy == t.tokens[t.prompt_len:]


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelRunner, ReferenceModel]:
    model = random_model(seed=1)
    runner = ModelRunner(RunnerConfig(dtype="float32", num_blocks=64, block_size=4,
                                      attention_backend="torch", num_threads=1), model)
    return runner, ReferenceModel(model.config, model.weights)


def tiny_prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 259) for _ in range(length)] for length in (5, 21, 37)[:n]]


def test_tiny_chunked_prefill_and_decode_match_reference(tiny: tuple) -> None:
    runner, ref = tiny
    traces = drive(runner, tiny_prompts(), chunk_cap=7, decode_steps=12)
    check_against_reference(ref, traces, atol=1e-4)
    runner.check_integrity()


def test_tiny_chunking_does_not_change_greedy_output(tiny: tuple) -> None:
    runner, _ = tiny
    whole = drive(runner, tiny_prompts(), chunk_cap=64, decode_steps=8)
    chunked = drive(runner, tiny_prompts(), chunk_cap=3, decode_steps=8, seed=5)
    assert [t.tokens for t in whole] == [t.tokens for t in chunked]


def test_copy_slots_and_read_slots_are_bit_exact(tiny: tuple) -> None:
    runner, _ = tiny
    trace = drive(runner, tiny_prompts(1), chunk_cap=8, decode_steps=1)[0]
    bs = runner.block_size
    src = torch.tensor([trace.block_table[p // bs] * bs + p % bs for p in range(5)])
    used = set(trace.block_table)
    spare = next(b for b in range(runner.num_blocks) if b not in used)
    dst = torch.arange(spare * bs, spare * bs + 4)
    runner.copy_slots(src[:4], dst)
    for (k_src, v_src), (k_dst, v_dst) in zip(runner.read_slots(src[:4]),
                                              runner.read_slots(dst), strict=True):
        assert torch.equal(k_src, k_dst) and torch.equal(v_src, v_dst)
        assert k_src.abs().sum() > 0
    with pytest.raises(ValueError):
        runner.copy_slots(src, dst)


def test_batch_check_rejects_bad_batches(tiny: tuple) -> None:
    runner, _ = tiny
    good = runner_batch([BatchChunk([5, 6], 0, [0])], runner.block_size)
    runner.execute(good)
    bad_slot = runner_batch([BatchChunk([5], 0, [runner.num_blocks])], runner.block_size)
    with pytest.raises(ValueError, match="slot_mapping"):
        runner.execute(bad_slot)
    with pytest.raises(ValueError, match="block_table too short"):
        runner_batch([BatchChunk([1] * 5, 0, [0])], 4)
    good.context_lens = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="context_lens"):
        runner.execute(good)
    too_far = runner_batch([BatchChunk([1], runner.max_model_len, list(range(200)))], 4)
    with pytest.raises(ValueError, match="positions"):
        runner.execute(too_far)


def test_runner_config_validation_and_budget() -> None:
    with pytest.raises(ValueError, match="dtype"):
        RunnerConfig(dtype="int8")
    with pytest.raises(ValueError, match="attention_backend"):
        RunnerConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="block_size"):
        RunnerConfig(block_size=0)
    model = random_model()
    runner = ModelRunner(RunnerConfig(dtype="float32", kv_cache_bytes=1 << 20,
                                      attention_backend="torch", num_threads=1), model)
    # 2 (K,V) x 2 layers x 2 kv heads x 16 dims x 16 tokens x 4 bytes = 8 KiB a block.
    assert runner.block_bytes() == 8192
    assert runner.num_blocks == 128
    assert runner.kv_caches[0][0].shape == (128, 16, 2, 16)
    runner.check_integrity()


# --- the real SmolLM2-135M-Instruct ---------------------------------------------------------

PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three primary colors.",
)


@pytest.fixture(scope="module")
def smollm() -> tuple[ModelRunner, ReferenceModel]:
    model = load_model(None, torch.float32)
    runner = ModelRunner(RunnerConfig(dtype="float32", num_blocks=64,
                                      attention_backend="torch", num_threads=1), model)
    return runner, ReferenceModel(model.config, model.weights)


def chat_ids(runner: ModelRunner, text: str) -> list[int]:
    rendered = runner.chat_template.render([{"role": "user", "content": text}])
    return runner.tokenizer.encode(rendered)


@pytest.mark.slow
def test_smollm_paged_batch_matches_reference(smollm: tuple) -> None:
    runner, ref = smollm
    prompts = [chat_ids(runner, p) for p in PROMPTS]
    traces = drive(runner, prompts, chunk_cap=16, decode_steps=16)
    check_against_reference(ref, traces, atol=2e-3)
    runner.check_integrity()


@pytest.mark.slow
def test_smollm_reference_answers_paris(smollm: tuple) -> None:
    runner, ref = smollm
    out = ref.greedy_generate(chat_ids(runner, PROMPTS[0]), 24, runner.stop_token_ids)
    assert "Paris" in runner.tokenizer.decode(out)
    assert out[-1] in runner.stop_token_ids
