"""Building a ridden engine's driver from the config: one upstream (`VLLMDriver`), or a fleet
of `[[engine.upstreams]]` (`FleetDriver`), each upstream with its own API key, timeouts,
KV-event subscriber (its DP ranks on vLLM's port offsets) and declarations.

An upstream's `--api-key` is read here from `api_key_env` / `api_key_file` (a missing or
empty key refuses start-up); it never appears in the TOML, a log or an error.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from adapters.fleet.driver import FleetConfig, FleetDriver
from adapters.fleet.health import HealthConfig
from adapters.fleet.state import Upstream
from adapters.prompt_tokens import PromptTokens
from adapters.vllm.capabilities import VLLMDeclarations
from adapters.vllm.dev_control import DevControlConfig, VLLMDevControl
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig
from governor.config import ConfigError, EngineSection, UpstreamSection
from governor.secrets import StartupRefused
from policies.routing import RoutingPolicy, RoutingWeights

log = logging.getLogger("fak.fleet")
TOTAL_TIMEOUT_S = 900.0


def upstream_api_key(upstream: UpstreamSection) -> str | None:
    if upstream.api_key_env:
        key = os.environ.get(upstream.api_key_env, "")
        where = f"${upstream.api_key_env}"
    elif upstream.api_key_file:
        try:
            key = Path(upstream.api_key_file).read_text().strip()
        except OSError as exc:
            raise StartupRefused(f"upstream {upstream.name}: cannot read api_key_file: "
                                 f"{exc.strerror}") from None
        where = str(upstream.api_key_file)
    else:
        return None
    if not key:
        raise StartupRefused(f"upstream {upstream.name}: no API key in {where}")
    return key


def upstream_driver(upstream: UpstreamSection, section: EngineSection,
                    namespace_key: bytes | None, fak_control: Any = None) -> VLLMDriver:
    """One upstream's driver: HTTP with its key and timeouts, its KV subscriber, the
    dev-mode reset client only when declared (every call logged)."""
    declare = upstream.declare
    declared = VLLMDeclarations(
        priority_scheduling=declare.priority_scheduling, dev_mode_reset=declare.prefix_reset,
        prompt_tokens_details=declare.prompt_tokens_details, determinism=declare.determinism,
        served_model=section.model)
    try:
        http = VLLMHTTPConfig(upstream.base_url, connect_timeout_s=upstream.connect_timeout_s,
                              first_byte_timeout_s=upstream.read_timeout_s,
                              total_timeout_s=max(TOTAL_TIMEOUT_S, upstream.read_timeout_s),
                              api_key=upstream_api_key(upstream),
                              metrics_url=upstream.metrics_url)
        kv = None
        if upstream.kv_events:
            kv = KVEventSubscriber(KVSubscriberConfig(
                endpoint=upstream.kv_events, replay_endpoint=upstream.kv_replay,
                topic=upstream.kv_topic, mode=upstream.kv_events_mode or "auto",
                allow_remote=section.allow_remote_kv,
                data_parallel_size=upstream.data_parallel_size), namespace_key)
    except ValueError as exc:
        raise ConfigError(f"upstream {upstream.name}: {exc}") from None
    dev = None
    if declare.prefix_reset:
        dev = VLLMDevControl(DevControlConfig(upstream.base_url, enabled=True),
                             lambda call: log.warning("dev-mode control call on %s: %s",
                                                      upstream.name, call))
    return VLLMDriver(http, declared, kv=kv, reset_route=dev, fak_control=fak_control)


def build_fleet_driver(section: EngineSection, namespace_key: bytes | None) -> FleetDriver:
    routing = section.routing
    upstreams = [Upstream(u.name, upstream_driver(u, section, namespace_key),
                          u.data_parallel_size) for u in section.upstreams]
    try:
        config = FleetConfig(RoutingPolicy(routing.policy),
                             RoutingWeights(routing.overlap_weight, routing.load_weight),
                             HealthConfig(routing.health_interval_s, routing.backoff_max_s))
        tokens = PromptTokens.load(routing.tokenizer, routing.tokenize_cache_entries)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"[engine.routing]: {exc}") from None
    return FleetDriver(upstreams, config, tokens)
