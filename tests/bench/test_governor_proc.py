"""The governor a benchmark starts binds its own ports (0 for both listeners) and is found
from the line it prints: no port is chosen here and bound later, so none can be taken in
between, and the metrics listener is never put on an unchecked port + 1."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from governor.bench.governor_proc import running_governor
from tests.governor.fak_serve_process import write_config

pytestmark = pytest.mark.slow


def test_the_benchmarks_governor_binds_its_own_ports(tmp_path: Path) -> None:
    config = tmp_path / "fak.toml"
    write_config(config, {}, {"kind": "native", "max_model_len": 256, "num_blocks": 32},
                 {"bench-key": {"id": "bench", "class": "interactive"}}, "admin")
    with running_governor(config, tmp_path / "run") as gov:
        args = list(gov.process.args)  # type: ignore[arg-type]
        assert args[args.index("--port") + 1] == args[args.index("--metrics-port") + 1] == "0"
        assert urlsplit(gov.url).port and httpx.get(gov.url + "/ready").status_code == 200
        assert f"serving on {gov.url} (metrics on http://127.0.0.1:" in gov.log_path.read_text()
    assert gov.process.poll() is not None  # stopped on leaving
