"""`fak audit isolation`: run the prompt-cache timing audit (policies.isolation_audit)
against an OpenAI-compatible endpoint, one request at a time.

Key A plants; key B probes in the cross phase, key A in the control phase. Against the
governor the keys are two tenants' keys; against a bare engine they are ignored and both
keys share one cache namespace, which the audit must then find.
"""

from __future__ import annotations

import random
import time

from governor.isolation.client import TtftClient
from governor.isolation.config import AuditConfig
from governor.isolation.report import AuditReport, Sample, build_report
from policies.isolation_audit import prefix_sharing_prompt, random_prompt, schedule


def run_audit(config: AuditConfig) -> AuditReport:
    seed = config.seed if config.seed is not None else random.SystemRandom().getrandbits(63)
    rng = random.Random(seed)
    a = TtftClient(config.base_url, config.key_a, "A", config.timeout_s, config.model,
                   config.route)
    b = TtftClient(config.base_url, config.key_b, "B", config.timeout_s, config.model,
                   config.route)
    started = time.time()
    t0 = time.monotonic()
    try:
        model = config.model or a.first_model()
        a.model = b.model = model
        for client in (a, b):
            for _ in range(config.warmup):
                client.measure(random_prompt(rng, config.prompt_tokens))
        samples = []
        for index, trial in enumerate(schedule(rng, config.samples)):
            planted = random_prompt(rng, config.prompt_tokens)
            plant = a.measure(planted)
            _pause(config.interval_s)
            probe = (prefix_sharing_prompt(rng, planted, config.prefix_fraction)
                     if trial.kind == "hit" else random_prompt(rng, config.prompt_tokens))
            prober = b if trial.phase == "cross" else a
            timed = prober.measure(probe)
            _pause(config.interval_s)
            samples.append(Sample(index, trial.phase, trial.kind, timed.ttft_s,
                                  timed.prompt_tokens, timed.cached_tokens, plant.ttft_s))
    finally:
        a.close()
        b.close()
    return build_report(config, model, seed, started, time.monotonic() - t0, samples)


def _pause(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)
