"""`fak bench ab` and `fak bench overhead` end to end through the command line, against
fake upstreams (ab) and the near-instant upstream with a real `fak serve` (overhead)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from governor.auth import sha256_hex
from governor.bench.cli import _sigterm_interrupts
from governor.bench.governor_proc import SERVING
from governor.cli import main
from tests.adapters.vllm_vectors import INT_RUN
from tests.http_client import HTTP
from tests.processes import serving

from .fake_upstream import FakeUpstream, FakeUpstreamConfig, serving_in_thread
from .outputs import check_outputs

ROOT = Path(__file__).resolve().parents[2]
@pytest.mark.slow
def test_ab_from_the_command_line(tmp_path: Path, tokenizer, capsys) -> None:  # type: ignore[no-untyped-def]
    ups = [FakeUpstream(FakeUpstreamConfig(seed=i, sigma=0.05), tokenizer) for i in (1, 2)]
    plan = tmp_path / "plan.toml"
    with serving_in_thread(*ups) as (a, b):
        plan.write_text(f'workload = "prefix-repetition"\nprefix_len = 32\ninput_len = 8\n'
                        f'num_prefixes = 2\noutput_len = 3\nblocks = 3\n'
                        f'[arms]\na = "{a}"\nb = "{b}"\n')
        rc = main(["bench", "ab", "--plan", str(plan), "--concurrency", "1,4",
                   "--out", str(tmp_path / "out"), "--no-progress", "--metric", "ttft.p50",
                   # CI installs vLLM beside the tests: only a machine this busy waits
                   "--settle-max-busy", "0.9"])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    assert "c1 b/a:" in out and "c4 b/a:" in out
    docs = check_outputs(tmp_path / "out", ("a", "b"), ("c1", "c4"))
    assert rc == (0 if all(d["comparison"]["claim_allowed"] for d in docs) else 1)
    assert docs[0]["workload"]["name"] == "prefix-repetition"
    # shared prefixes inside a block are this run's own reuse, not contamination
    assert all("cached prompt tokens" not in r for d in docs for r in d["comparison"]["reasons"])
    assert any(a["figures"]["prefix_cache_hit_ratio"] for d in docs for a in d["arms"])


@pytest.mark.parametrize("argv", [
    ["bench", "ab", "--arm", "a=http://127.0.0.1:1"],
    ["bench", "ab", "--arm", "a=http://x", "--arm", "a=http://y"],
    ["bench", "ab", "--arm", "a=ftp://x", "--arm", "b=http://y"],
    ["bench", "ab", "--arm", "a=http://x/v1", "--arm", "b=http://y"],
    ["bench", "ab", "--arm", "noequals", "--arm", "b=http://y"],
    ["bench", "ab", "--arm", "a=http://x", "--arm", "b=http://y", "--blocks", "1"],
    ["bench", "ab", "--arm", "a=http://x", "--arm", "b=http://y", "--workload", "tenant-mix",
     "--arm-log", "zzz=/tmp/log"],
    *(["bench", "ab", "--arm", "a=http://x", "--arm", "b=http://y", flag, value]
      for flag, value in (("--settle-max-busy", "0"), ("--settle-max-busy", "1.5"),
                          ("--settle-max-busy", "nan"), ("--settle-timeout", "-1"),
                          ("--settle-timeout", "inf"), ("--settle-timeout", "nan"))),
])
def test_bad_usage_is_refused_in_one_line(argv: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fak bench: ") and err.count("\n") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _instant_upstream(*flags: str) -> Iterator[str]:
    """bench/instant_upstream.py on a free port, once it answers /health: its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with serving([str(ROOT / "bench" / "instant_upstream.py"), "--port", str(port), *flags],
                 url + "/health"):
        yield url


def test_the_instant_upstream_answers_metrics_with_a_recorded_exposition() -> None:
    recorded = INT_RUN / "metrics_after.prom"
    with _instant_upstream("--metrics-file", str(recorded)) as url:
        assert HTTP.get(url + "/metrics", timeout=10).text == recorded.read_text()
    with _instant_upstream() as url:
        assert "vllm:cache_config_info" in HTTP.get(url + "/metrics", timeout=10).text


def _overhead_config(tmp_path: Path, url: str) -> Path:
    """A governor config over `url` with the bench tenant (API key `k-1`)."""
    config = tmp_path / "fak.toml"
    config.write_text(f'[server]\ndata_dir = "{tmp_path / "data"}"\n'
                      f'[engine]\nkind = "vllm"\nbase_url = "{url}"\nmodel = "smollm2"\n'
                      f'[engine.declare]\nprompt_tokens_details = true\n'
                      f'[[tenants]]\nid = "bench"\napi_key_sha256 = ["{sha256_hex("k-1")}"]'
                      f'\nclass = "interactive"\n')
    return config


@pytest.mark.slow
def test_overhead_from_the_command_line(tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FAK_BENCH_API_KEY", "k-1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "out"
    with _instant_upstream() as url:
        rc = main(["bench", "overhead", "--engine", url, "--config",
                   str(_overhead_config(tmp_path, url)), "--out",
                   str(out), "--rounds", "3", "--per-round", "4", "--warmup", "2",
                   "--concurrency", "1,4", "--max-tokens", "4",
                   "--engine-compile-cache", "not_applicable", "--no-progress",
                   "--settle-max-busy", "0.9", "--settle-timeout", "5"])
    text = capsys.readouterr().out
    assert rc in (0, 1)
    assert "added latency p50" in text and "added TTFT p99" in text
    assert "output throughput ratio" in text and "CPU time per request" in text
    check_outputs(out, ("direct", "governor"),
                  ("latency-c1", "ttft-c1", "throughput-c1", "throughput-c4"))
    assert (out / "governor" / "governor-data").is_dir()  # its own fresh data dir
    assert "plan_sha256" in json.loads(next((out / "artifacts").glob("*.json")).read_text())[
        "workload"]


def test_overhead_refuses_a_config_that_governs_another_engine(tmp_path: Path,
                                                               capsys) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "fak.toml"
    config.write_text('[engine]\nkind = "vllm"\nbase_url = "http://127.0.0.1:9"\n')
    assert main(["bench", "overhead", "--engine", "http://127.0.0.1:8", "--config",
                 str(config)]) == 2
    assert "must govern --engine" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--settle-max-busy", "0"),
                                        ("--settle-timeout", "-0.5")])
def test_overhead_refuses_a_bad_settle_before_it_starts(tmp_path: Path, capsys,  # type: ignore[no-untyped-def]
                                                       flag: str, value: str) -> None:
    config = tmp_path / "fak.toml"
    config.write_text('[engine]\nkind = "vllm"\nbase_url = "http://127.0.0.1:9"\n')
    out = tmp_path / "out"
    assert main(["bench", "overhead", "--engine", "http://127.0.0.1:9", "--config",
                 str(config), "--out", str(out), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fak bench overhead: settle_") and err.count("\n") == 1
    assert not out.exists()  # refused before a governor or a request


def test_overhead_refuses_a_tenant_the_governor_would_shed(tmp_path: Path, capsys,  # type: ignore[no-untyped-def]
                                                          monkeypatch) -> None:
    """At concurrency 64 a tenant capped at 16 is answered 429 through the governor: that
    is admission, not overhead, so the run is refused before it starts."""
    config = tmp_path / "fak.toml"
    config.write_text(f'[server]\ndata_dir = "{tmp_path / "data"}"\n'
                      '[engine]\nkind = "vllm"\nbase_url = "http://127.0.0.1:9"\n'
                      f'[[tenants]]\nid = "bench"\napi_key_sha256 = ["{sha256_hex("k-1")}"]\n')
    monkeypatch.setenv("FAK_BENCH_API_KEY", "k-1")
    assert main(["bench", "overhead", "--engine", "http://127.0.0.1:9", "--config",
                 str(config), "--concurrency", "1,64", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tenant bench" in err and "max_concurrency 16 < --concurrency 64" in err


def test_ab_through_the_governor_refuses_a_tenant_it_would_shed(tmp_path: Path, capsys,  # type: ignore[no-untyped-def]
                                                                monkeypatch) -> None:
    """Queueing is the governor's own behaviour in an A/B, so the bound is max_concurrency
    plus the tenant's queue: 16 + 16 holds c32 and sheds c64, refused before the run."""
    config = tmp_path / "fak.toml"
    config.write_text(f'[server]\ndata_dir = "{tmp_path / "data"}"\n'
                      '[engine]\nkind = "vllm"\nbase_url = "http://127.0.0.1:9"\n'
                      f'[[tenants]]\nid = "bench"\napi_key_sha256 = ["{sha256_hex("k-1")}"]\n')
    monkeypatch.setenv("FAK_BENCH_API_KEY", "k-1")
    argv = ["bench", "ab", "--arm", "direct=http://127.0.0.1:9", "--through-governor",
            str(config), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main([*argv, "--concurrency", "1,64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tenant bench" in err
    assert "max_concurrency 16 + max_queued 16 = 32 < --concurrency 64" in err
    assert not (tmp_path / "out" / "governor").exists(), "no governor started for the run"


@pytest.mark.slow
def test_a_terminated_overhead_run_stops_its_governor(tmp_path: Path) -> None:
    """SIGTERM mid-run (a CI timeout, a `kill`): the bench exits 143 in one line and the
    governor it started no longer serves."""
    env = dict(os.environ, FAK_BENCH_API_KEY="k-1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "out"
    with _instant_upstream() as url:  # busy: the signal often lands inside a task
        bench = subprocess.Popen(
            [sys.executable, "-m", "governor.cli", "bench", "overhead", "--engine", url,
             "--config", str(_overhead_config(tmp_path, url)), "--out", str(out),
             "--rounds", "50", "--per-round", "50", "--concurrency", "1,4",
             "--engine-compile-cache", "not_applicable", "--no-progress",
             "--settle-max-busy", "0.9", "--settle-timeout", "1"],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            governor = _governor_of(bench, out / "governor" / "governor.log")
            time.sleep(1)  # into its requests
            bench.send_signal(signal.SIGTERM)
            _, err = bench.communicate(timeout=60)
        finally:
            bench.kill()
    assert bench.returncode == 143
    assert err.strip().splitlines() == [
        "fak bench: stopped before the end; what it started is stopped"]
    with pytest.raises(httpx.TransportError):
        HTTP.get(governor + "/ready")


@pytest.fixture(params=["default", "ignored"])
def sigint(request: pytest.FixtureRequest) -> Iterator[str]:
    """SIGINT as Python installs it, or ignored: a job that a non-interactive shell starts
    in the background (`cmd &`) inherits SIGINT ignored, and then `asyncio.run` installs
    no handler for it."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler if request.param == "default"
                  else signal.SIG_IGN)
    yield request.param
    signal.signal(signal.SIGINT, previous)


def test_sigterm_inside_a_task_cancels_the_run_and_fails_no_task(sigint: str) -> None:
    """SIGTERM handled while another task runs (mid-write, as CI saw it): the main task is
    cancelled and unwinds; the busy task is cancelled, not left holding an exception that
    asyncio later prints as 'Task exception was never retrieved'."""
    seen: dict[str, object] = {}

    async def busy() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(200_000))  # Python runs the handler here, inside this task's step
        await asyncio.sleep(10)

    async def run() -> None:
        seen["busy"] = asyncio.create_task(busy())
        try:
            await asyncio.sleep(10)
        finally:
            seen["unwound"] = True

    with _sigterm_interrupts() as sigterm, pytest.raises(KeyboardInterrupt):
        asyncio.run(run())
    task = seen["busy"]
    assert sigterm.received and seen["unwound"]
    assert isinstance(task, asyncio.Task) and task.cancelled()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_with_no_loop_running_raises_where_the_run_is(sigint: str) -> None:
    with _sigterm_interrupts() as sigterm, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)
        sum(range(200_000))  # the handler runs by here
    assert sigterm.received


def _governor_of(bench: subprocess.Popen[str], log: Path) -> str:
    """The URL of the governor `bench` started, once it answers /ready."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and bench.poll() is None:
        found = SERVING.search(log.read_bytes()) if log.exists() else None
        with contextlib.suppress(httpx.TransportError):
            if found and HTTP.get(found[1].decode() + "/ready").status_code == 200:
                return found[1].decode()
        time.sleep(0.2)
    raise AssertionError(bench.stderr.read() if bench.poll() is not None and bench.stderr
                         else "no governor ready")
