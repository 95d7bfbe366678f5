"""Per-request state as plain counters (docs/design.md §6), and the sampling parameters.

A request's tokens are `token_ids` = prompt followed by outputs. `num_computed_tokens` counts
the leading tokens whose KV is written in the slots named by `block_table`; the next forward
computes tokens [num_computed_tokens, num_tokens). Only the last token of a sequence has no KV,
so a decoding request has num_computed_tokens == num_tokens - 1 before its step.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from schemas.values import is_int

MAX_LOGPROBS = 20
# vLLM 0.32 (vllm/sampling_params.py): below SAMPLING_EPS sampling is greedy, and a positive
# temperature under MIN_TEMPERATURE (vLLM's _MAX_TEMP) is raised to it.
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds on `seed`


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class SamplingParamError(ValueError):
    """A sampling parameter the engine cannot honour; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """What to generate. Validated (and sequences normalised to tuples) once, at construction:
    every accepted value is one the sampler honours without failing; anything else raises
    SamplingParamError naming the field.

    A temperature below SAMPLING_EPS is greedy (top-k and top-p then off, as vLLM); one in
    [SAMPLING_EPS, MIN_TEMPERATURE) is raised to MIN_TEMPERATURE, as vLLM does. (vLLM raises
    every positive temperature under MIN_TEMPERATURE, so it samples sub-epsilon ones at 0.01;
    here they are greedy.) top_k 0 or -1 and top_p 1 disable those filters; seed -1 means
    none (vLLM); `logprobs` asks for that many top alternatives per sampled token (0 = only
    the sampled token's). Lower `priority` is scheduled sooner; `namespace` (the cache salt)
    isolates the prefix cache; `cache_group` (the tenant) is whose reserved share of cached
    blocks the namespace counts against (capacity isolation, SEC-9).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    priority: int = 0
    namespace: str | None = None
    cache_group: str | None = None

    def __post_init__(self) -> None:
        self.stop = _as_tuple(self.stop, str, "stop")
        self.stop_token_ids = _as_tuple(self.stop_token_ids, int, "stop_token_ids")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        _check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               "max_tokens must be an int >= 1")
        self.temperature = _finite_float(self.temperature, "temperature")
        _check(self.temperature >= 0, "temperature", "temperature must be a finite number >= 0")
        self.top_p = _finite_float(self.top_p, "top_p")
        _check(0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]")
        _check(is_int(self.top_k) and self.top_k >= 0, "top_k",
               "top_k must be -1, 0 or a positive int")
        _check(self.seed is None or (is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
               "seed", f"seed must be None or an int in [{INT64_MIN}, {INT64_MAX}]")
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be >= 0")
        _check(
            self.logprobs is None
            or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs", f"logprobs must be None or an int in [0, {MAX_LOGPROBS}]",
        )
        _check(is_int(self.priority), "priority", "priority must be an int")
        _check(
            self.namespace is None or isinstance(self.namespace, str),
            "namespace", "namespace must be a str or None",
        )
        if self.temperature < SAMPLING_EPS:
            self.top_p, self.top_k = 1.0, 0
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)


def _finite_float(value: Any, param: str) -> float:
    """`value` as a finite float (an int too large for a float is refused, not an error)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise SamplingParamError(param, f"{param} must be a number")
    try:
        as_float = float(value)
    except OverflowError:
        raise SamplingParamError(param, f"{param} is too large") from None
    if not math.isfinite(as_float):
        raise SamplingParamError(param, f"{param} must be a finite number")
    return as_float


def _as_tuple(value: Any, kind: type, name: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, kind):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise SamplingParamError(name, f"{name} must hold {kind.__name__} values") from None
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
        raise SamplingParamError(name, f"{name} must hold {kind.__name__} values")
    return items


@dataclass(slots=True, eq=False)
class Request:
    """One generation request; the scheduler moves it between queues, nothing else owns it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    cache_node: Any = None  # the radix node this request holds a lock on (None = no lock)
    cache_limit: int | None = None  # tokens past this are never inserted (quarantined span)
    block_digests: list[bytes] = field(default_factory=list)  # chain digests, memo for tiers
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    output_text: str = ""
    num_text_emitted: int = 0
    detokenizer: Any = None  # the engine's IncrementalDetokenizer, made at the first output
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if not all(is_int(t) and t >= 0 for t in self.prompt_token_ids):
            raise ValueError("prompt token ids must be ints >= 0")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def max_num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def namespace(self) -> str | None:
        return self.params.namespace

    @property
    def cache_group(self) -> str | None:
        return self.params.cache_group

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float]:
        """Scheduling order under the priority policy: lower runs sooner."""
        return (self.params.priority, self.arrival_time)
