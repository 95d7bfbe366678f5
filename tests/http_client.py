"""One httpx client for the tests' plain calls. `httpx.post(...)` and its siblings build a
client, TLS context included, per call (~50 ms here); this one is built once. Keep-alive is
off, so each request still opens a connection of its own, as those functions did. The
timeout is a hang's bound, not a latency check: httpx's 5 s default failed a real vLLM
CPU completion on a loaded machine."""

from __future__ import annotations

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0),
                    timeout=httpx.Timeout(60.0, connect=10.0))
