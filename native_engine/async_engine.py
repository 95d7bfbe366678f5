"""AsyncLLMEngine: the blocking step loop on a worker thread, outputs streamed to asyncio.

The worker thread is the only one that touches the LLMEngine: every mutation (add, abort,
evict_span, reset, stats) is a call queued to it and awaited through a concurrent Future, so
the engine needs no locks. Each step's outputs are handed to the event loop with
`call_soon_threadsafe` and routed to per-request asyncio queues. A consumer that stops
iterating (client gone, task cancelled) aborts its request. If a step raises, every open
stream receives the error and the engine is marked dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from native_engine.engine import EngineStats, LLMEngine, RequestOutput
from native_engine.request import SamplingParams

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine accepts no more work."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._calls: deque[tuple[Callable[[LLMEngine], Any], Future]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="native-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._dead is None and not self._stopping

    # -- calls into the worker ----------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the worker thread between steps and return its result."""
        if self._dead is not None:
            raise EngineDeadError("the engine loop failed") from self._dead
        if self._thread is None or self._stopping:
            raise RuntimeError("the engine is not running; await start() first")
        future: Future = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        return await asyncio.wrap_future(future)

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda e: e.abort(request_id))

    async def evict_span(self, namespace: str | None, tokens: Sequence[int], start: int) -> int:
        return await self.call(lambda e: e.evict_span(namespace, tokens, start))

    async def reset_prefix_cache(self) -> bool:
        return await self.call(lambda e: e.reset_prefix_cache())

    async def stats(self) -> EngineStats:
        return await self.call(lambda e: e.stats())

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has `finished` set. Bad input raises
        ValueError before anything is yielded."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self.call(lambda e: e.add_request(prompt_token_ids, params, request_id))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop failed") from item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None and not self._stopping:
                with contextlib.suppress(RuntimeError):
                    self._submit_nowait(lambda e: e.abort(request_id))

    def _submit_nowait(self, fn: Callable[[LLMEngine], Any]) -> None:
        with self._wake:
            self._calls.append((fn, Future()))
            self._wake.notify()

    # -- the worker thread --------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not (self._stopping or self._calls or engine.has_unfinished()):
                    self._wake.wait()
                if self._stopping:
                    calls = list(self._calls)
                    self._calls.clear()
                    for _, future in calls:
                        future.set_exception(RuntimeError("the engine is closing"))
                    return
                calls = list(self._calls)
                self._calls.clear()
            for fn, future in calls:
                try:
                    future.set_result(fn(engine))
                except Exception as exc:  # the caller gets it; the loop goes on
                    future.set_exception(exc)
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                self._fail(exc)
                return
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)  # type: ignore[union-attr]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail(self, exc: BaseException) -> None:
        self._dead = exc
        with self._wake:
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            future.set_exception(EngineDeadError("the engine loop failed"))

        def broadcast() -> None:
            for queue in self._streams.values():
                queue.put_nowait(exc)

        self._loop.call_soon_threadsafe(broadcast)  # type: ignore[union-attr]
