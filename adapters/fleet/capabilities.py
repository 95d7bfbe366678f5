"""A fleet's capabilities: what every upstream offers (unknown = off, so one upstream without
a capability turns it off for the fleet), fixed at start-up. An upstream that comes up later
must serve the same model and offer at least as much, or it is refused (kept out of routing).
Exact-span eviction is never offered across a fleet: a quarantine there is a flush on every
member or a salt rotation.
"""

from __future__ import annotations

from collections.abc import Mapping

from schemas.engine import Determinism, EngineCapabilities

FLAGS = ("cache_salt", "priority_scheduling", "prefix_reset", "kv_events", "kv_replay",
         "cached_tokens_in_usage")


class FleetMismatch(ValueError):
    """The upstreams cannot be one fleet (different models)."""


def _common(values: list[object]) -> object | None:
    return values[0] if values and all(v == values[0] for v in values) else None


def fleet_capabilities(by_upstream: Mapping[str, EngineCapabilities]) -> EngineCapabilities:
    caps = list(by_upstream.values())
    models = {c.model_id for c in caps}
    if len(models) != 1:
        raise FleetMismatch(f"the upstreams serve different models: {sorted(models)}")
    lengths = [c.max_model_len for c in caps if c.max_model_len]
    determinism = _common([c.determinism for c in caps])
    def everywhere(name: str) -> bool:
        return all(getattr(c, name) for c in caps)

    notes = tuple(f"upstream {name}: {c.engine_version or '?'}, "
                  f"{c.prefix_caching_hash_algo or '?'}, {c.num_blocks or '?'} blocks of "
                  f"{c.block_size or '?'}" for name, c in by_upstream.items())
    return EngineCapabilities(
        engine_kind="vllm", model_id=models.pop(),
        max_model_len=min(lengths) if lengths else None,
        block_size=_common([c.block_size for c in caps]),  # type: ignore[arg-type]
        exact_span_evict=False,
        determinism=determinism if isinstance(determinism, Determinism)
        else Determinism.UNAVAILABLE,
        prefix_caching_hash_algo=_common(  # type: ignore[arg-type]
            [c.prefix_caching_hash_algo for c in caps]),
        probed=tuple(sorted(set.intersection(*(set(c.probed) for c in caps)))),
        declared=tuple(sorted(set.intersection(*(set(c.declared) for c in caps)))),
        notes=(f"fleet of {len(caps)} upstreams", *notes),
        cache_salt=everywhere("cache_salt"),
        priority_scheduling=everywhere("priority_scheduling"),
        prefix_reset=everywhere("prefix_reset"),
        kv_events=everywhere("kv_events"),
        kv_replay=everywhere("kv_replay"),
        cached_tokens_in_usage=everywhere("cached_tokens_in_usage"),
    )


def incompatibility(fleet: EngineCapabilities, caps: EngineCapabilities) -> str | None:
    """Why an upstream that (re)joined cannot take the fleet's traffic, or None."""
    if caps.model_id != fleet.model_id:
        return f"serves {caps.model_id!r}, the fleet serves {fleet.model_id!r}"
    lacking = [name for name in FLAGS if getattr(fleet, name) and not getattr(caps, name)]
    if lacking:
        return f"lacks {', '.join(lacking)}, which the fleet offers"
    return None
