"""The workloads `fak bench ab` sends, generated offline from a tokenizer and seeds.

- `random`: vLLM's random dataset (vllm/benchmarks/datasets): lengths uniform in
  input_len·[1 − r, 1 + r], special tokens excluded; decoded, re-encoded and topped up or
  cut until the text is exactly that many tokens (vLLM's `gen_prompt_decode_to_target_len`).
  Unlike vLLM, each token is drawn on its own: vLLM's `allowed[(offset + i + arange(len))]`
  gives two prompts the same first block whenever their offsets meet, one chance in
  |allowed| per pair, so a re-run of a few hundred prompts against the same server found
  some of the last run's in its cache.
- `prefix-repetition`: vLLM's prefix_repetition: `num_prefixes` random prefixes of
  prefix_len tokens, each followed by several random suffixes of input_len, shuffled.
- `multi-turn`: returning conversations. Turn k's prompt is turn k−1's prompt, the
  replayed assistant reply (output_len planned tokens, as a recorded conversation would
  carry) and a new user message of input_len; turns of a conversation run in order, each
  after the previous answer, so the engine can reuse the history it has cached.
- `tenant-mix`: prefix-repetition whose every prefix is used by every tenant (one API key
  each): the traffic for which per-tenant cache isolation has a price.

Fresh prompts per block: the token content comes from a generator seeded with the run's
seed, its run id, the level, the block and the arm, so no block (and no re-run against the
same servers) finds another's prompts in the cache. Lengths are seeded without the arm, so
block i asks the same amount of work of every arm.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from governor.bench.config import WorkloadConfig

MAX_LENGTH_FIXES = 10


class BenchTokenizer:
    """The served model's tokenizer, for exact prompt lengths. `front_tokens`: how many
    tokens the tokenizer adds before a text (a BOS), which every prompt then shares."""

    def __init__(self, backend: Tokenizer, source: str) -> None:
        self.backend = backend
        self.source = source
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.allowed = tuple(i for i in range(backend.get_vocab_size()) if i not in special)
        plain = len(backend.encode("a", add_special_tokens=False).ids)
        self.front_tokens = max(0, len(backend.encode("a", add_special_tokens=True).ids) - plain)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: Path | None) -> BenchTokenizer:
    """`tokenizer.json`, an HF directory holding one, a GGUF file, or (None) the embedded
    model's GGUF."""
    if path is not None and path.suffix != ".gguf":
        file = path / "tokenizer.json" if path.is_dir() else path
        return BenchTokenizer(Tokenizer.from_file(str(file)), str(file))
    import gguf

    from native_engine.model.gguf_loader import read_tokenizer
    from native_engine.model.weights import embedded_gguf_path

    gguf_path = path or embedded_gguf_path()
    tokenizer, _ = read_tokenizer(gguf.GGUFReader(gguf_path))
    return BenchTokenizer(tokenizer.backend, str(gguf_path))


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request as sent. `prompt_ids`: the prompt as the server tokenizes it (without
    front tokens); `tenant`: index into the run's API keys, or None for the first."""

    prompt: str
    prompt_ids: tuple[int, ...]
    output_len: int
    tenant: int | None = None
    conversation: int | None = None
    turn: int | None = None


Session = tuple[PlannedRequest, ...]


@dataclass(frozen=True, slots=True)
class PlannedBlock:
    """Sessions run concurrently; the requests of one session run in order."""

    sessions: tuple[Session, ...]

    @property
    def requests(self) -> tuple[PlannedRequest, ...]:
        return tuple(r for s in self.sessions for r in s)


def exact_length(tok: BenchTokenizer, ids: list[int], target: int,
                 rng: random.Random) -> tuple[str, tuple[int, ...]]:
    """Decode, re-encode, top up with random allowed tokens or cut, until the text is
    `target` tokens (or the tries run out, as in vLLM; the result is then the nearest)."""
    text = tok.decode(ids)
    for _ in range(MAX_LENGTH_FIXES):
        ids = tok.encode(text)
        if len(ids) == target:
            break
        if len(ids) < target:
            ids = ids + [rng.choice(tok.allowed) for _ in range(target - len(ids))]
        else:
            ids = ids[:target]
        text = tok.decode(ids)
    return text, tuple(tok.encode(text))


def random_ids(tok: BenchTokenizer, n: int, rng: random.Random) -> list[int]:
    return [rng.choice(tok.allowed) for _ in range(n)]


class WorkloadGenerator:
    """Blocks of one workload. `tenants`: how many API keys the run has."""

    def __init__(self, config: WorkloadConfig, tok: BenchTokenizer, seed: int, run_id: str,
                 tenants: int = 1) -> None:
        if config.name == "tenant-mix" and tenants < 2:
            raise ValueError("tenant-mix needs at least two API keys")
        self.config = config
        self.tok = tok
        self.seed = seed
        self.run_id = run_id
        self.tenants = tenants

    def block(self, level: str, block: int | str, arm: str, requests: int) -> PlannedBlock:
        content = random.Random(f"{self.seed}:{self.run_id}:{level}:{block}:{arm}")
        lengths = random.Random(f"{self.seed}:{level}:{block}:lengths")
        make = {"random": self._random, "prefix-repetition": self._prefix_repetition,
                "multi-turn": self._multi_turn, "tenant-mix": self._tenant_mix}[self.config.name]
        return make(requests, content, lengths)

    def _input_lengths(self, n: int, lengths: random.Random) -> list[int]:
        c = self.config
        low = max(1, int(c.input_len * (1 - c.range_ratio)))
        high = max(low, math.ceil(c.input_len * (1 + c.range_ratio)))
        return [lengths.randint(low, high) for _ in range(n)]

    def _random(self, n: int, content: random.Random, lengths: random.Random) -> PlannedBlock:
        sessions = []
        for length in self._input_lengths(n, lengths):
            ids = random_ids(self.tok, length, content)
            text, final = exact_length(self.tok, ids, length, content)
            sessions.append((PlannedRequest(text, final, self.config.output_len),))
        return PlannedBlock(tuple(sessions))

    def _shared_prefix(self, n: int, tenants: int, content: random.Random,
                       lengths: random.Random) -> PlannedBlock:
        c = self.config
        per = max(1, n // (c.num_prefixes * tenants))
        suffix_lens = self._input_lengths(c.num_prefixes * tenants * per, lengths)
        requests: list[PlannedRequest] = []
        for _ in range(c.num_prefixes):
            prefix = list(exact_length(self.tok, random_ids(self.tok, c.prefix_len, content),
                                       c.prefix_len, content)[1])
            for tenant in range(tenants):
                for _ in range(per):
                    length = suffix_lens[len(requests)]
                    ids = prefix + random_ids(self.tok, length, content)
                    text, final = exact_length(self.tok, ids, c.prefix_len + length, content)
                    requests.append(PlannedRequest(text, final, c.output_len,
                                                   tenant if tenants > 1 else None))
        content.shuffle(requests)
        return PlannedBlock(tuple((r,) for r in requests))

    def _prefix_repetition(self, n: int, content: random.Random,
                           lengths: random.Random) -> PlannedBlock:
        return self._shared_prefix(n, 1, content, lengths)

    def _tenant_mix(self, n: int, content: random.Random, lengths: random.Random) -> PlannedBlock:
        return self._shared_prefix(n, self.tenants, content, lengths)

    def _multi_turn(self, n: int, content: random.Random, lengths: random.Random) -> PlannedBlock:
        c = self.config
        conversations = max(1, n // c.turns)
        user_lens = self._input_lengths(conversations * c.turns, lengths)
        sessions = []
        for conv in range(conversations):
            history: list[int] = []
            turns = []
            for turn in range(c.turns):
                if turn:
                    history += random_ids(self.tok, c.output_len, content)  # replayed reply
                history += random_ids(self.tok, user_lens[conv * c.turns + turn], content)
                text, final = exact_length(self.tok, history, len(history), content)
                history = list(final)
                turns.append(PlannedRequest(text, final, c.output_len, None, conv, turn))
            sessions.append(tuple(turns))
        return PlannedBlock(tuple(sessions))
