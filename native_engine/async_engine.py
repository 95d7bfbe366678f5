"""AsyncLLMEngine: the blocking step loop on a worker thread, outputs streamed to asyncio.

The worker thread is the only one that touches the LLMEngine: every mutation (add, abort,
evict_span, reset, stats) is a call queued to it and awaited through a concurrent Future, so
the engine needs no locks. Each step's outputs are handed to the event loop with
`call_soon_threadsafe` and routed to per-request asyncio queues. A consumer that stops
iterating (client gone, task cancelled) aborts its request.

Failures: a request the engine failed (its output carries the error) raises
RequestFailedError in its own stream only; the loop goes on. If the loop itself dies (an
exception escapes a step), a supervisor on the event loop restarts it: every open stream gets
RequestFailedError, and after `backoff_s` a new worker thread rebuilds the engine state
around the same model and runner; calls queued meanwhile run on the rebuilt engine. More than
`max_restarts` crashes within `window_s` leave the engine dead (EngineDeadError, with the
reason in `liveness()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from native_engine.engine import EngineStats, LLMEngine, RequestOutput
from native_engine.request import SamplingParams

T = TypeVar("T")
log = logging.getLogger("fak.engine")


class EngineDeadError(RuntimeError):
    """The step loop failed for good (or the engine was closed); it accepts no more work."""


class RequestFailedError(RuntimeError):
    """Serving this one request failed inside the engine; the engine goes on."""


class EngineState(enum.Enum):
    STOPPED = "stopped"  # not started yet, or closed
    ALIVE = "alive"
    RESTARTING = "restarting"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Liveness:
    """What the supervisor knows: the state, restarts so far, and the last crash's reason."""

    state: EngineState
    restarts: int
    reason: str | None

    @property
    def alive(self) -> bool:
        return self.state is EngineState.ALIVE


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """At most `max_restarts` restarts of the loop within any `window_s` seconds (one more
    crash and the engine is dead), each `backoff_s` after its crash."""

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError("max_restarts must be an int >= 0")
        if not self.window_s > 0 or not self.backoff_s >= 0:
            raise ValueError("window_s must be > 0 and backoff_s >= 0")


@dataclass(frozen=True, slots=True)
class _Failure:
    """Put in a stream's queue when the loop crashed or the engine closed (dead: for good)."""

    dead: bool
    message: str
    cause: BaseException | None

    def error(self) -> Exception:
        error = (EngineDeadError if self.dead else RequestFailedError)(self.message)
        error.__cause__ = self.cause
        return error


REASON_CHARS = 300


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, supervisor: SupervisorConfig | None = None) -> None:
        self.engine = engine
        self.supervisor = supervisor or SupervisorConfig()
        self._calls: deque[tuple[Callable[[LLMEngine], Any], Future]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._state = EngineState.STOPPED
        self._restarts = 0
        self._crash_times: deque[float] = deque()
        self._reason: str | None = None
        self._dead: BaseException | None = None
        self._restart_timer: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | _Failure]] = {}

    async def start(self) -> None:
        if self._thread is not None or self._stopping:
            return
        self._loop = asyncio.get_running_loop()
        self._state = EngineState.ALIVE
        self._start_thread(rebuild=False)

    async def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._restart_timer is not None:
            self._restart_timer.cancel()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._state is not EngineState.DEAD:
            self._state = EngineState.STOPPED
        self._fail_calls(EngineDeadError("the engine is closed"))
        self._fail_streams(_Failure(True, "the engine is closed", None))

    @property
    def is_alive(self) -> bool:
        return self._state is EngineState.ALIVE and not self._stopping

    def liveness(self) -> Liveness:
        state = EngineState.STOPPED if self._stopping and not self._dead else self._state
        return Liveness(state, self._restarts, self._reason)

    # -- calls into the worker ----------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the worker thread between steps and return its result (while
        the loop restarts, the call waits for the rebuilt engine)."""
        if self._state is EngineState.DEAD:
            raise EngineDeadError(f"the engine loop is dead: {self._reason}") from self._dead
        if self._state is EngineState.STOPPED or self._stopping:
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
        ValueError before anything is yielded; a failure of this request raises
        RequestFailedError, a dead engine EngineDeadError."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | _Failure] = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self.call(lambda e: _add(e, prompt_token_ids, params, request_id))
            while not finished:
                item = await queue.get()
                if isinstance(item, _Failure):
                    finished = item.dead
                    raise item.error()
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError("the engine failed while serving this request"
                                             ) from item.error
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._state in (EngineState.ALIVE, EngineState.RESTARTING):
                self._submit_nowait(lambda e: e.abort(request_id))

    def _submit_nowait(self, fn: Callable[[LLMEngine], Any]) -> None:
        with self._wake:
            self._calls.append((fn, Future()))
            self._wake.notify()

    # -- the worker thread --------------------------------------------------------------

    def _start_thread(self, rebuild: bool) -> None:
        self._thread = threading.Thread(target=self._run, args=(rebuild,),
                                        name="native-engine", daemon=True)
        self._thread.start()

    def _run(self, rebuild: bool) -> None:
        try:
            if rebuild:
                self.engine.rebuild()
                self._post(self._set_alive)
            self._serve()
        except BaseException as exc:  # the loop died: the supervisor decides what next
            self._post(self._on_crash, exc)

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not (self._stopping or self._calls or engine.has_unfinished()):
                    self._wake.wait()
                if self._stopping:
                    return
                calls = list(self._calls)
                self._calls.clear()
            for fn, future in calls:
                if not future.set_running_or_notify_cancel():
                    continue  # its caller went away before it ran
                try:
                    future.set_result(fn(engine))
                except Exception as exc:  # the caller gets it; the loop goes on
                    future.set_exception(exc)
            if engine.has_unfinished():
                outputs = engine.step()
                if outputs:
                    self._post(self._deliver, outputs)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody left to tell
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]

    # -- on the event loop: delivery and the supervisor ---------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _set_alive(self) -> None:
        if self._state is EngineState.RESTARTING:
            self._state = EngineState.ALIVE

    def _on_crash(self, exc: BaseException) -> None:
        if self._stopping:
            return
        now = time.monotonic()
        self._crash_times.append(now)
        while self._crash_times[0] < now - self.supervisor.window_s:
            self._crash_times.popleft()
        self._reason = f"{type(exc).__name__}: {exc}"[:REASON_CHARS]
        crashes = len(self._crash_times)
        if crashes > self.supervisor.max_restarts:
            log.error("the engine loop crashed %d times in %.0f s; the engine is dead",
                      crashes, self.supervisor.window_s, exc_info=exc)
            self._state, self._dead = EngineState.DEAD, exc
            self._fail_calls(EngineDeadError(f"the engine loop is dead: {self._reason}"))
            self._fail_streams(_Failure(True, f"the engine loop is dead: {self._reason}", exc))
            return
        log.error("the engine loop crashed; its requests end with an error and it restarts "
                  "in %.1f s", self.supervisor.backoff_s, exc_info=exc)
        self._state = EngineState.RESTARTING
        self._fail_streams(_Failure(False, "the engine loop failed while serving this request; "
                                    "it restarts", exc))
        self._restart_timer = self._loop.call_later(  # type: ignore[union-attr]
            self.supervisor.backoff_s, self._restart)

    def _restart(self) -> None:
        self._restart_timer = None
        if self._stopping or self._state is not EngineState.RESTARTING:
            return
        self._restarts += 1
        if self._thread is not None:
            self._thread.join()  # it has already posted its crash: it ends at once
        self._start_thread(rebuild=True)

    def _fail_calls(self, exc: BaseException) -> None:
        with self._wake:
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)

    def _fail_streams(self, failure: _Failure) -> None:
        for queue in self._streams.values():
            queue.put_nowait(failure)


def _add(engine: LLMEngine, prompt_token_ids: Sequence[int], params: SamplingParams,
         request_id: str) -> None:
    """On the worker: add the request; a failure that is not bad input is this request's."""
    try:
        engine.add_request(prompt_token_ids, params, request_id)
    except ValueError:
        raise
    except Exception as exc:
        log.error("request %s failed while being added", request_id, exc_info=exc)
        raise RequestFailedError("the engine failed to add this request") from exc

