"""LLMEngine: the synchronous step loop (schedule → copy reused tails → forward → sample →
detokenise → finish), over a model runner that owns the paged KV tensors.

Stop handling follows vLLM: an EOS (unless `ignore_eos`) or a listed stop token id ends the
request and stays in `token_ids` but not in the text; a stop string ends it and is cut from
the text; `max_tokens` or `max_model_len` ends it with reason "length". While a request runs,
its text delta holds back the last (longest stop string - 1) characters and any incomplete
UTF-8 sequence, so no emitted text is ever retracted.

Failures stay with the requests they hit (docs/design.md §6): an exception while sampling,
detokenising or stop-checking one request finishes that request with status FINISHED_ERROR
and the exception on its last output; a failed forward (or slot copy) does the same to every
request of that step. Either way their blocks and cache locks are released and nothing they
computed is cached. An exception from the scheduler itself leaves its state unknown: it
escapes `step()`, and the caller `rebuild()`s the engine state around the same runner.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from native_engine.config import EngineConfig
from native_engine.detokenizer import IncrementalDetokenizer
from native_engine.kvcache.block_pool import BlockPool
from native_engine.kvcache.radix_cache import CacheEventListener, RadixCache
from native_engine.kvcache.tier_types import SpanRemoval, TierRemoval, TierStats
from native_engine.request import Request, RequestStatus, SamplingParams
from native_engine.sampler import Sample, sample
from native_engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from native_engine.tiering import build_tiers

if TYPE_CHECKING:
    from native_engine.model.loaded import LoadedModel
    from native_engine.model.runner import ModelRunner

log = logging.getLogger("fak.engine")


class Runner(Protocol):
    """The model side (native_engine.model.runner.ModelRunner; the KV tiers also use its
    read_kv / write_kv)."""

    def execute(self, batch: Any) -> torch.Tensor: ...

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...


class Detokenizer(Protocol):
    stop_token_ids: tuple[int, ...]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request; `error` is set (and `finished`, with reason
    "error") when serving it failed."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens: int
    stop_reason: str | int | None = None
    logprobs: tuple[Sample, ...] = ()
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class CompletedRequest:
    """The whole result of one request (from `generate`)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters (monotonic) and gauges for metrics."""

    prompt_tokens: int
    generation_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_steps: int
    tiers: tuple[TierStats, ...] = ()


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        tokenizer: Detokenizer | None = None,
        listener: CacheEventListener | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.listener = listener
        self.tiers = build_tiers(config, runner, listener)
        self._build_state(SchedulerStats())
        self.eos_token_ids = frozenset(tokenizer.stop_token_ids if tokenizer else ())
        model_config = getattr(runner, "model_config", None)
        self.vocab_size: int | None = getattr(model_config, "vocab_size", None)
        runner_len = getattr(runner, "max_model_len", None)
        self.max_model_len = min(config.model_len, runner_len or config.model_len)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0

    def _build_state(self, stats: SchedulerStats) -> None:
        self.pool = BlockPool(self.config.num_blocks, self.config.block_size)
        self.cache = (RadixCache(self.pool, self.listener, demoter=self.tiers)
                      if self.config.enable_prefix_caching else None)
        for group, blocks in self.config.reserved_blocks().items():
            if self.cache is not None:
                self.cache.reserve(group, blocks)
        self.scheduler = Scheduler(self.config, self.pool, self.cache, self.tiers)
        self.scheduler.stats = stats
        self.requests: dict[str, Request] = {}

    def rebuild(self) -> list[str]:
        """Fresh pool, prefix cache and scheduler around the same runner, after a failure
        that may have left them inconsistent. Every unfinished request is dropped (their ids
        are returned); counters carry on; the KV tiers are emptied; KV-event subscribers
        hear the cache was cleared."""
        dropped = list(self.requests)
        self._build_state(self.scheduler.stats)
        if self.tiers is not None:  # "cleared" covers every medium: the tiers go too
            self.tiers.clear()
        if self.listener is not None:
            self.listener.on_cleared()
            self._flush_events()
        return dropped

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        listener: CacheEventListener | None = None,
        loaded: LoadedModel | None = None,
    ) -> LLMEngine:
        """Load the model named by `config.model` (None: the embedded one; `loaded`: an
        already loaded one) and build the engine over it."""
        from native_engine.model.runner import ModelRunner

        runner = ModelRunner(config.runner_config(), loaded)
        return cls(config, runner, runner.tokenizer, listener)

    @property
    def model_runner(self) -> ModelRunner:
        """The runner `from_config` builds: serving fronts read its tokenizer, chat template
        and compute choice (a runner handed to `__init__` need have none of them)."""
        from native_engine.model.runner import ModelRunner

        if not isinstance(self.runner, ModelRunner):
            raise TypeError(f"the engine runs on a {type(self.runner).__name__}, not a "
                            "ModelRunner")
        return self.runner

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"Got priority {params.priority} but Priority scheduling is not enabled."
            )
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len {self.max_model_len}"
            )
        if self.vocab_size is not None and any(t >= self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token id out of range (vocab size {self.vocab_size})")
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            time.monotonic() if arrival_time is None else arrival_time,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        self._prompt_tokens += req.num_prompt_tokens
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request (no more outputs for it); False if it is unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._flush_events()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; the cache events it caused leave as one batch (vLLM's way)."""
        try:
            return self._step()
        finally:
            self._flush_events()

    def _flush_events(self) -> int | None:
        return self.listener.flush() if self.listener is not None else None

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("no request can be scheduled although the pool is idle")
            return []
        self._steps += 1
        # A request samples once all its tokens have KV; a partial prefill chunk samples nothing.
        rows = [
            i for i, (r, n) in enumerate(plan.scheduled)
            if r.num_computed_tokens + n == r.num_tokens
        ]
        try:
            logits = self._forward(plan, rows)
        except Exception as exc:
            return self._fail_step(plan, exc)
        self.scheduler.advance(plan)
        if not rows:
            return []
        reqs = [plan.scheduled[i][0] for i in rows]
        samples = self._sample(reqs, logits)
        return [self._fail(r, s) if isinstance(s, Exception) else self._append_or_fail(r, s)
                for r, s in zip(reqs, samples, strict=True)]

    def _forward(self, plan: SchedulerOutput, rows: list[int]) -> torch.Tensor:
        if plan.copy_src:
            self.runner.copy_slots(
                torch.tensor(plan.copy_src, dtype=torch.int64),
                torch.tensor(plan.copy_dst, dtype=torch.int64),
            )
        # the runner computes logits for the sampling rows only
        return self.runner.execute(self._build_batch(plan, rows))

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[Sample | Exception]:
        """The batch's samples; if the batch raises, row by row, so a failure stays with its
        request (a seeded generator then draws twice for that step)."""
        params = [r.params for r in reqs]
        generators = [r.generator or self.default_generator for r in reqs]
        try:
            return list(sample(logits, params, generators))
        except Exception:
            log.warning("batched sampling failed; sampling the %d rows one by one", len(reqs))
        samples: list[Sample | Exception] = []
        for i in range(len(reqs)):
            try:
                samples.append(sample(logits[i : i + 1], params[i : i + 1],
                                      generators[i : i + 1])[0])
            except Exception as exc:
                samples.append(exc)
        return samples

    def _append_or_fail(self, req: Request, s: Sample) -> RequestOutput:
        try:
            return self._append(req, s)
        except Exception as exc:
            return self._fail(req, exc)

    def _fail_step(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The forward failed: every request of this step ends with the error."""
        log.error("engine step failed; its %d requests end with an error: %s",
                  len(plan.scheduled), ", ".join(r.request_id for r, _ in plan.scheduled),
                  exc_info=exc)
        return [self._finish_failed(req, exc) for req, _ in plan.scheduled]

    def _fail(self, req: Request, exc: Exception) -> RequestOutput:
        log.error("request %s failed; it ends with an error", req.request_id, exc_info=exc)
        return self._finish_failed(req, exc)

    def _finish_failed(self, req: Request, exc: Exception) -> RequestOutput:
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, cache=False)
        self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=(), text_delta="", finished=True,
            finish_reason=req.status.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens, cached_tokens=req.num_cached_tokens,
            error=exc)

    def _build_batch(self, plan: SchedulerOutput, logits_rows: list[int]) -> Any:
        from native_engine.model.runner import RunnerBatch

        return build_batch(plan, self.pool, RunnerBatch, logits_rows)

    def _append(self, req: Request, s: Sample) -> RequestOutput:
        req.token_ids.append(s.token_id)
        self._generation_tokens += 1
        status = self._check_stop_token(req, s.token_id)
        delta = self._detokenize(req, status)
        if req.stop_reason is not None and isinstance(req.stop_reason, str):
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish(req, status)
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=(s.token_id,),
            text_delta=delta,
            finished=req.is_finished,
            finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            cached_tokens=req.num_cached_tokens,
            stop_reason=req.stop_reason,
            logprobs=(s,) if s.logprob is not None else (),
        )

    def _check_stop_token(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _detokenize(self, req: Request, status: RequestStatus | None) -> str:
        """Update the request's text; returns the newly releasable text."""
        if self.tokenizer is None:
            return ""
        if req.detokenizer is None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        if status is RequestStatus.FINISHED_STOPPED:  # the stop/EOS token is not text
            text = req.detokenizer.text
        else:
            text = req.detokenizer.push(req.token_ids[-1])
        stops = req.params.stop
        if stops:
            search_from = max(0, len(req.output_text) - max(map(len, stops)))
            hits = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
            if hits:
                cut = min(hits)
                req.stop_reason = next(s for s in stops if text.find(s, search_from) == cut)
                text, status = text[:cut], RequestStatus.FINISHED_STOPPED
        req.output_text = text
        hold = 0
        if status is None:
            hold = max(map(len, stops), default=1) - 1
            if text.endswith("\ufffd"):
                hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
        end = max(req.num_text_emitted, len(text) - hold)
        delta = text[req.num_text_emitted : end]
        req.num_text_emitted = end
        return delta

    # -- conveniences -------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletedRequest]:
        """Run the prompts to completion; results in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        reqs = [
            self.add_request(self._encode(p), sp) for p, sp in zip(prompts, params, strict=True)
        ]
        while self.has_unfinished():
            self.step()
        return [
            CompletedRequest(
                r.request_id,
                tuple(r.prompt_token_ids),
                tuple(r.output_token_ids),
                r.output_text,
                r.status.finish_reason,
                r.num_cached_tokens,
            )
            for r in reqs
        ]

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        encode = getattr(self.tokenizer, "encode", None)
        if encode is None:
            raise ValueError("text prompts need a tokenizer with encode()")
        return encode(prompt)

    # -- cache control ------------------------------------------------------------------

    def evict_span(self, namespace: str | None, tokens: Sequence[int], start: int) -> int:
        """Exact-span eviction on every tier (`remove_span`); returns device tokens evicted."""
        return self.remove_span(namespace, tokens, start).device_tokens

    def remove_span(self, namespace: str | None, tokens: Sequence[int],
                    start: int) -> SpanRemoval:
        """Exact-span eviction (docs/design.md §5) from the device pool and every lower tier
        (files included), with each tier's result; unfinished requests on that path stop
        caching past `start`, so the span cannot come back when they finish."""
        if self.cache is None:
            return SpanRemoval(0)
        evicted = self.cache.evict_span(namespace, tokens, start)
        tiers = self.tiers.remove_span(namespace, tokens, start) if self.tiers else []
        self._flush_events()
        head = list(tokens[: start + 1])
        for req in self.requests.values():
            if req.namespace == namespace and req.token_ids[: start + 1] == head[: req.num_tokens]:
                req.cache_limit = start if req.cache_limit is None else min(req.cache_limit, start)
        return SpanRemoval(evicted, tuple(tiers))

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache, every tier included; False while requests run (nothing
        dropped, as vLLM) or when a lower tier could not be emptied."""
        report = self.flush_prefix_cache()
        return report is not None and all(r.ok for r in report)

    def flush_prefix_cache(self) -> tuple[TierRemoval, ...] | None:
        """`reset_prefix_cache` with each lower tier's result; None when refused. One
        AllBlocksCleared (every medium) is published."""
        if self.cache is None or self.scheduler.running or not self.cache.reset():
            return None
        tiers = self.tiers.clear() if self.tiers else []
        self._flush_events()
        return tuple(tiers)

    def retire_namespace(self, namespace: str | None) -> None:
        """An old salt epoch: its blocks can never match again, so every tier ages them out
        first and none moves them down."""
        if self.cache is not None:
            self.cache.age_out(namespace)
        if self.tiers is not None:
            self.tiers.retire(namespace)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        return EngineStats(
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.pool.usage,
            num_steps=self._steps,
            tiers=self.tiers.stats() if self.tiers else (),
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        assert all(not r.is_finished for r in self.requests.values())
        for req in self.requests.values():
            if req.detokenizer is not None:
                req.detokenizer.check_integrity()


def build_batch(plan: SchedulerOutput, pool: BlockPool, batch_type: Any,
                logits_rows: Sequence[int]) -> Any:
    """The runner's flattened batch for a plan (requests back to back, in plan order);
    logits are wanted for the requests at `logits_rows` (indices into plan.scheduled)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens: list[int] = []
    for req, n in plan.scheduled:
        lo, hi = req.num_computed_tokens, req.num_computed_tokens + n
        input_ids.extend(req.token_ids[lo:hi])
        positions.extend(range(lo, hi))
        slots.extend(pool.slots(req.block_table, lo, hi))
        starts.append(starts[-1] + n)
        context_lens.append(hi)
    width = max(len(r.block_table) for r, _ in plan.scheduled)
    tables = torch.zeros((len(plan.scheduled), width), dtype=torch.int32)
    for i, (req, _) in enumerate(plan.scheduled):
        tables[i, : len(req.block_table)] = torch.tensor(req.block_table, dtype=torch.int32)
    return batch_type(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
    )
