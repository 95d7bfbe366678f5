"""Serve one OpenAI request on the native engine: a body in, vLLM-shaped chunks out.

Used by the in-process driver (adapters/native.py) with bodies the governor already typed
(`prepare_parsed`: salt and priority as values, no dict round trip) and by `fak engine
serve` with raw bodies (`prepare`), so both give the same answers. Chunks come out as
`StreamChunk`s carrying their usage as a value. Errors are raised as EngineError with
vLLM's status, type and param, all before the first yield (a stream that has started only
ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from native_engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from native_engine.engine import RequestOutput
from native_engine.model.chat_template import ChatTemplate
from native_engine.model.prompt import PromptInvalid, off_loop, prompt_token_ids
from native_engine.model.tokenizer import TextTokenizer
from native_engine.request import SamplingParams
from native_engine.serve.openai_api import (
    Completion,
    bad_request,
    chat_logprobs,
    check_model,
    check_supported,
    completion_logprobs,
    full_response,
    response_id,
    role_chunk,
    sampling_params,
    stream_chunk,
    usage_chunk,
    validate_body,
)
from schemas.cache_control import SpanSpec
from schemas.engine import EngineError, StreamChunk, Usage
from schemas.openai import AnyRequest, Route

LogprobEntry = tuple[str, float, list[tuple[str, float]]]


@dataclass(frozen=True, slots=True)
class ServingConfig:
    model_name: str
    max_model_len: int
    prompt_tokens_details: bool = True
    priority_enabled: bool = True
    block_size: int = 16

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.max_model_len < 2 or self.block_size < 1:
            raise ValueError("max_model_len must be >= 2 and block_size >= 1")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, ready for the engine."""

    route: Route
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


class RequestObserver(Protocol):
    """Told of one request's progress (server metrics: TTFT, inter-token, end to end)."""

    def on_output(self, num_new_tokens: int) -> None: ...

    def on_finish(self, finish_reason: str) -> None: ...


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: TextTokenizer,
                 chat_template: ChatTemplate | None, config: ServingConfig,
                 observe: Callable[[], RequestObserver] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.config = config
        self.observe = observe

    def prompt_ids(self, parsed: AnyRequest) -> list[int]:
        try:
            return prompt_token_ids(parsed, self.tokenizer, self.chat_template)
        except PromptInvalid as exc:
            raise bad_request(str(exc), exc.param) from None

    def _created_cache_tokens(self, route: Route, prompt_tokens: int, cached: int) -> int | None:
        """Prompt tokens in full blocks this request newly cached; vLLM 0.32 reports it for
        chat and leaves it null for completions (vectors/vllm-0.32.0-cpu/http.jsonl)."""
        if route != "chat":
            return None
        bs = self.config.block_size
        return max(0, prompt_tokens // bs * bs - cached)

    def _logprob_entries(self, out: RequestOutput) -> list[LogprobEntry]:
        def text(token_id: int) -> str:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)

        return [(text(s.token_id), float(s.logprob),
                 [(text(t), lp) for t, lp in (s.top_logprobs or ())])
                for s in out.logprobs if s.logprob is not None]

    def _format_logprobs(self, route: Route, entries: list[LogprobEntry],
                         offset: int) -> dict[str, Any]:
        return chat_logprobs(entries) if route == "chat" else completion_logprobs(entries,
                                                                                    offset)

    def span_tokens(self, span: SpanSpec) -> list[int]:
        """The ids a request of this span would cache (its own validation and
        tokenisation; one output token of room is required)."""
        if span.token_ids is not None:
            return list(span.token_ids)
        if span.text is not None:
            return self.prepare("completions", {"prompt": span.text, "max_tokens": 1}).prompt_ids
        messages = [dict(m) for m in span.messages or ()]
        return self.prepare("chat", {"messages": messages, "max_tokens": 1}).prompt_ids

    def prepare(self, route: Route, body: Any) -> Prepared:
        """Validate and tokenise a raw body; every 4xx a request can get is raised here."""
        return self._prepare(route, validate_body(route, body), None, None)

    async def prepare_off_loop(self, route: Route, parsed: AnyRequest,
                               namespace: str | None, priority: int | None,
                               cache_group: str | None = None) -> Prepared:
        """`prepare_parsed`, on a worker thread when the text or id list is long:
        tokenising or checking a large prompt must not stall every request on the loop."""
        if not off_loop(parsed):
            return self.prepare_parsed(route, parsed, namespace, priority, cache_group)
        return await asyncio.to_thread(self.prepare_parsed, route, parsed, namespace, priority,
                                       cache_group)

    def prepare_parsed(self, route: Route, parsed: AnyRequest, namespace: str | None,
                       priority: int | None, cache_group: str | None = None) -> Prepared:
        """A body the governor typed: what this engine supports, then tokenise, with the
        governor's namespace, priority and cache group (the tenant) as values."""
        check_supported(parsed)
        return self._prepare(route, parsed, namespace, priority, cache_group)

    def _prepare(self, route: Route, parsed: AnyRequest, namespace: str | None,
                 priority: int | None, cache_group: str | None = None) -> Prepared:
        check_model(parsed, self.config.model_name)
        ids = self.prompt_ids(parsed)
        params = sampling_params(parsed, len(ids), self.config.max_model_len,
                                 self.tokenizer.stop_token_ids, self.config.priority_enabled,
                                 namespace, priority, cache_group)
        options = parsed.stream_options
        return Prepared(route, ids, params, bool(parsed.stream),
                        bool(options is not None and options.include_usage))

    async def generate(self, prepared: Prepared, request_id: str
                       ) -> AsyncGenerator[StreamChunk, None]:
        """Run a prepared request: one full response, or stream chunks then the done one."""
        route, ids, params = prepared.route, prepared.prompt_ids, prepared.params
        stream, include_usage = prepared.stream, prepared.include_usage
        rid = response_id(route, request_id)
        model, created = self.config.model_name, int(time.time())
        want_logprobs = params.logprobs is not None
        observer = self.observe() if self.observe is not None else None
        text: list[str] = []
        entries: list[LogprobEntry] = []
        last: RequestOutput | None = None
        try:
            async for out in self.engine.generate(ids, params, request_id):
                if observer is not None:
                    observer.on_output(len(out.new_token_ids))
                new = self._logprob_entries(out) if want_logprobs else []
                if stream and last is None and route == "chat":
                    yield StreamChunk(role_chunk(rid, model, created))
                if stream and (out.text_delta or out.finished):
                    lp = self._format_logprobs(route, new, len("".join(text))) if new else None
                    yield StreamChunk(stream_chunk(route, rid, model, created, out.text_delta,
                                                   out.finish_reason, lp, out.stop_reason))
                text.append(out.text_delta)
                entries.extend(new)
                last = out
        except EngineDeadError as exc:
            raise EngineError(503, f"the native engine is not running: {exc}",
                              type="ServiceUnavailableError") from None
        except RequestFailedError as exc:  # logged with its cause by the engine
            raise EngineError(500, str(exc), type="InternalServerError") from None
        except ValueError as exc:
            raise bad_request(str(exc), None) from None
        finally:
            if observer is not None:
                observer.on_finish((last.finish_reason or "stop")
                                   if last is not None and last.finished else "abort")
        assert last is not None  # generate() always ends with a finished output
        done = Completion("".join(text), last.finish_reason, last.num_prompt_tokens,
                          last.num_output_tokens, last.cached_tokens, last.stop_reason,
                          self._created_cache_tokens(route, last.num_prompt_tokens,
                                                     last.cached_tokens))
        details = self.config.prompt_tokens_details
        usage = Usage(done.prompt_tokens, done.completion_tokens,
                      done.cached_tokens if details else None)
        if not stream:
            logprobs = self._format_logprobs(route, entries, 0) if want_logprobs else None
            yield StreamChunk(full_response(route, rid, model, done, details, created, logprobs),
                              usage=usage)
            return
        if include_usage:
            yield StreamChunk(usage_chunk(route, rid, model, created, done, details),
                              usage=usage)
        yield StreamChunk(None, done=True)

    def models(self, root: str) -> dict[str, Any]:
        created = int(time.time())
        permission = {"id": f"modelperm-{self.config.model_name}", "object": "model_permission",
                      "created": created, "allow_create_engine": False,
                      "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None,
                      "is_blocking": False}
        return {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": created,
            "owned_by": "fak", "root": root, "parent": None,
            "max_model_len": self.config.max_model_len, "permission": [permission],
        }]}
