"""What each arm tells about itself before and during a run (the facts the plan records
and the warm gate needs), from the surfaces an engine exposes:

- `GET /version` (vLLM, fak engine serve) and `GET /v1/models` (`owned_by`: "vllm", "fak");
- vLLM's dev-mode `GET /server_info?config_format=json`: an engine started with
  `enforce_eager` (or compilation mode 0) compiles nothing, so its compile cache is
  `not_applicable` and no request can trigger a compilation;
- the server's log, when the operator names it: a compilation logged after warm-up is
  request-time compilation ("Compiling model ...", "saved AOT compiled function"; vLLM's
  "No available shared memory broadcast block ... (e.g. compilation, ...)" is a slow step,
  not a compilation).

Anything not told stays None (not observed), which the gate treats as not comparable.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from schemas.bench import CompileCacheState

COMPILE_LOG_LINE = re.compile(rb"(?i)\bcompiling (model|a graph)\b|aot compiled function")


@dataclass(frozen=True, slots=True)
class ArmIdentity:
    """`engine`: e.g. "vllm 0.32.0", "fak 0.1.0", or "unknown"; `eager`: True when the
    engine said it compiles nothing, None when it did not say."""

    engine: str
    version: str | None
    model: str | None
    owned_by: str | None
    eager: bool | None

    def facts(self) -> dict[str, str | int | float | bool | None]:
        return {"engine": self.engine, "version": self.version, "model": self.model,
                "owned_by": self.owned_by, "eager": self.eager}


async def _get_json(session: aiohttp.ClientSession, url: str,
                    headers: dict[str, str]) -> Any:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, json.JSONDecodeError,
                             UnicodeError):
        async with session.get(url, headers=headers) as response:
            if response.status == 200:
                return json.loads(await response.read())
    return None


def eager_from_server_info(info: Any) -> bool | None:
    """True/False from vLLM's `/server_info` JSON config; None when it does not say."""
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        return None
    model = config.get("model_config") or {}
    if isinstance(model, dict) and model.get("enforce_eager") is True:
        return True
    compilation = config.get("compilation_config") or {}
    mode = compilation.get("mode", compilation.get("level")) if isinstance(compilation,
                                                                           dict) else None
    if isinstance(mode, int):
        return mode == 0
    return False if isinstance(model, dict) and model.get("enforce_eager") is False else None


async def identify(session: aiohttp.ClientSession, url: str,
                   headers: dict[str, str]) -> ArmIdentity:
    version_doc = await _get_json(session, f"{url}/version", headers)
    models = await _get_json(session, f"{url}/v1/models", headers)
    info = await _get_json(session, f"{url}/server_info?config_format=json", headers)
    version = version_doc.get("version") if isinstance(version_doc, dict) else None
    first = (models.get("data") or [{}])[0] if isinstance(models, dict) else {}
    owned_by = first.get("owned_by") if isinstance(first, dict) else None
    model = first.get("id") if isinstance(first, dict) else None
    engine = f"{owned_by or 'unknown'} {version}" if version else (owned_by or "unknown")
    return ArmIdentity(engine, version, model, owned_by, eager_from_server_info(info))


class LogWatch:
    """Compilations a server logged after `mark()`; None when there is no log to read."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path and self.path.exists() else 0

    def compiled_since_mark(self) -> bool | None:
        if self.path is None or not self.path.exists():
            return None
        with self.path.open("rb") as f:
            f.seek(self.offset)
            return COMPILE_LOG_LINE.search(f.read()) is not None


def compile_facts(identity: ArmIdentity, stated: str | None, compiled: bool | None
                  ) -> tuple[CompileCacheState | None, bool | None, str]:
    """(compile_cache, request_time_compilation, source). What the engine says wins over
    what the operator stated; an eager engine cannot compile at request time."""
    if identity.eager:
        rtc = compiled if compiled is not None else False
        return CompileCacheState.NOT_APPLICABLE, rtc, "server_info"
    if stated is not None:
        state = CompileCacheState(stated)
        if state is CompileCacheState.NOT_APPLICABLE and compiled is None:
            compiled = False  # stated: the engine has no compiler to run at request time
        return state, compiled, "stated"
    return None, compiled, "not_observed"
