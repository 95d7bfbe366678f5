"""The governor at line rate: req/s and latency under wrk, fak beside a bare proxy
(issue 19's table).

Non-streaming one-token completions against bench/instant_upstream.py (or `--upstream-url`),
one wrk thread per run, the load generator, the upstream and the proxy sharing the machine.
Arms, interleaved (the order rotates every rep), medians over reps:

  direct            wrk → upstream
  fak               wrk → fak serve → upstream
  aiohttp-httpx     wrk → a bare aiohttp server with an httpx client → upstream
  aiohttp-aiohttp   wrk → a bare aiohttp server with an aiohttp client → upstream (a
                    stream's bytes relayed as they are read)
  litellm           wrk → LiteLLM's proxy → upstream (only with --litellm-bin). LiteLLM is
                    no dependency of fak; in a venv of its own:
                      python3 -m venv /tmp/litellm
                      /tmp/litellm/bin/pip install 'litellm[proxy]==1.108.7'
                    then --litellm-bin /tmp/litellm/bin/litellm
  fak-wN            wrk → fak serve --workers N → upstream (postgres state: $FAK_STATE_DSN)
  aiohttp-aiohttp-wN  the bare aiohttp proxy in N processes on one port (SO_REUSEPORT)
  tcp-relay         wrk → a byte relay on uvloop → upstream: one more process hop and no
                    HTTP read at all, the least any proxy on this machine can add
  NAME              fak serve from another checkout (with --fak-arm NAME=PATH, e.g. the
                    main branch's worktree: before and after a change in one run)

Added latency is fak's p50 (or p99) minus direct's, paired per rep, then the median; fak
beside another tree (NAME) is its req/s and CPU per request over NAME's, rep by rep, the
median ratio with the reps' range (a range holding 1.0 is not resolved). CPU time per
request is charged to each arm's processes, the upstream and wrk: on a machine where they
share the cores, cores / their sum bounds the req/s any arm can reach.
Run it under the bench lock, as every measurement here:

    flock /tmp/fak-bench.lock .venv/bin/python bench/line_rate.py [--reps 3] [--duration 5]

`wrk` must be on PATH (Debian: `apt-get install wrk`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from governor.bench.artifact import load_average, machine_line

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-" + "5eed" * 16  # LiteLLM's proxy refuses a weak master key; fak takes any
MODEL = "smollm2"
BODY = ('{"model":"smollm2","prompt":"Say hello in one word.","max_tokens":1,'
        '"temperature":0}')
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


@dataclass(frozen=True, slots=True)
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int  # non-2xx answers plus socket errors
    cpu_us: float | None = None  # the arm's own processes: CPU time per request
    upstream_us: float | None = None  # the upstream's (when this script started it)
    wrk_us: float = 0.0  # the load generator's


@dataclass(frozen=True, slots=True)
class Arm:
    url: str
    pid: int | None  # the process (with its children) charged to the arm (None: direct)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode} before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


@contextlib.contextmanager
def process(cmd: list[str], ready_url: str, root: Path = ROOT,
            env: dict[str, str] | None = None, ready_timeout_s: float = 120) -> Iterator[int]:
    env = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(ready_url, proc, ready_timeout_s)
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def governor_config(directory: Path, upstream: str, shared: bool = False) -> Path:
    """fak serve's config; `shared`: the postgres state backend `--workers` needs, its DSN in
    $FAK_STATE_DSN (a database of its own: the bench appends to its audit log)."""
    if shared and not os.environ.get("FAK_STATE_DSN"):
        raise SystemExit("a fak-wN arm needs $FAK_STATE_DSN: a PostgreSQL database for the "
                         "workers' shared state")
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    state = '[state]\nbackend = "postgres"\ndsn_env = "FAK_STATE_DSN"\n' if shared else ""
    path = directory / "fak.toml"
    path.write_text(f"""{state}
[server]
data_dir = "{directory / 'data'}"
max_engine_concurrency = 256
admission_wait_s = 60.0

[engine]
kind = "vllm"
base_url = "{upstream}"
model = "{MODEL}"

[engine.declare]
prompt_tokens_details = true

[[tenants]]
id = "bench"
api_key_sha256 = ["{digest}"]
class = "interactive"
max_concurrency = 256
max_tokens = 2048
""")
    return path


def wrk_script(directory: Path, stream_tokens: int = 0) -> Path:
    """The request every run sends: BODY, or a stream of `stream_tokens` chunks."""
    body = BODY if not stream_tokens else BODY.replace(
        '"max_tokens":1', f'"max_tokens":{stream_tokens},"stream":true')
    path = directory / "post.lua"
    path.write_text(f"""wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {KEY}"
""")
    return path


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(number) * UNITS[unit]


def parse_wrk(out: str) -> WrkResult:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                      out):
        errors += sum(int(g) for g in m.groups())
    return WrkResult(rps, p50, p99, errors)


def cpu_seconds(pid: int | None) -> float:
    """User plus system CPU time of a process and its live children (a supervisor's
    workers); 0 for None."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        own += sum(cpu_seconds(int(child)) for child in children)
    return own


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wrk(arm: Arm, script: Path, concurrency: int, duration_s: float,
        upstream_pid: int | None = None) -> WrkResult:
    before = (cpu_seconds(arm.pid), cpu_seconds(upstream_pid), children_cpu_seconds())
    out = subprocess.run(
        ["wrk", "-t1", f"-c{concurrency}", f"-d{duration_s:g}s", "--latency", "--timeout",
         "10s", "-s", str(script), arm.url + "/v1/completions"],
        check=True, capture_output=True, text=True).stdout
    after = (cpu_seconds(arm.pid), cpu_seconds(upstream_pid), children_cpu_seconds())
    result = parse_wrk(out)
    done = max(1.0, float(re.search(r"(\d+) requests in", out).group(1)))  # type: ignore[union-attr]
    per_request = [(a - b) / done * 1e6 for a, b in zip(after, before, strict=True)]
    return WrkResult(result.rps, result.p50_ms, result.p99_ms, result.errors,
                     per_request[0] if arm.pid else None,
                     per_request[1] if upstream_pid else None, per_request[2])


# -- the bare proxies (the floor fak is measured against) ---------------------------------------


def serve_bare_proxy(client: str, port: int, upstream: str, processes: int = 1) -> None:
    """A ten-line aiohttp proxy: the body forwarded, the answer's bytes returned (an SSE
    answer's as they are read, over aiohttp's client; httpx's reads it whole); with
    `processes` > 1, that many on the port (SO_REUSEPORT), as `fak serve --workers`."""
    import multiprocessing

    if processes > 1:
        ctx = multiprocessing.get_context("spawn")
        for _ in range(processes - 1):
            ctx.Process(target=serve_bare_proxy, args=(client, port, upstream),
                        kwargs={"processes": -1}, daemon=True).start()
    from aiohttp import ClientSession, TCPConnector, web

    target = upstream + "/v1/completions"
    headers = {"Content-Type": "application/json"}
    sse_headers = {"Content-Type": "text/event-stream"}

    async def with_aiohttp(app: web.Application) -> AsyncIterator[None]:
        session = ClientSession(connector=TCPConnector(limit=512))

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with session.post(target, data=body, headers=headers) as r:
                if r.headers.get("Content-Type", "")[:17] != "text/event-stream":
                    return web.Response(body=await r.read(), status=r.status,
                                        content_type="application/json")
                out = web.StreamResponse(status=r.status, headers=sse_headers)
                await out.prepare(request)
                async for data in r.content.iter_any():
                    await out.write(data)
                await out.write_eof()
                return out

        app.router.add_post("/v1/completions", handle)
        yield
        await session.close()

    async def with_httpx(app: web.Application) -> AsyncIterator[None]:
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=512), timeout=60)

        async def handle(request: web.Request) -> web.Response:
            r = await http.post(target, content=await request.read(), headers=headers)
            return web.Response(body=r.content, status=r.status_code,
                                content_type="application/json")

        app.router.add_post("/v1/completions", handle)
        yield
        await http.aclose()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(with_aiohttp if client == "aiohttp" else with_httpx)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                reuse_port=processes != 1)


def serve_tcp_relay(port: int, upstream: str) -> None:
    """Each connection piped byte for byte to a connection of its own to the upstream, both
    ways, nothing parsed: the hop without the proxy."""
    import asyncio

    import uvloop

    address = httpx.URL(upstream)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def relay(client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        upstream_in, upstream_out = await asyncio.open_connection(address.host, address.port)
        with contextlib.suppress(ConnectionError):
            await asyncio.gather(pipe(client_in, upstream_out), pipe(upstream_in, client_out))

    async def serve() -> None:
        server = await asyncio.start_server(relay, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


# -- the run --------------------------------------------------------------------------------------


def start_arms(stack: contextlib.ExitStack, tmp: Path, upstream: str,
               args: argparse.Namespace, under: tuple[str, ...] = (),
               ready_timeout_s: float = 120) -> dict[str, Arm]:
    """Every arm (the upstream itself is `direct`); `under` prefixes each arm's command (a
    tool it runs under, as bench/instructions.py's valgrind)."""
    py = sys.executable
    arms = {"direct": Arm(upstream, None)}
    for name in args.arms:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        workers = re.fullmatch(r"(fak|aiohttp-aiohttp)-w(\d+)", name)
        if name == "fak" or name in args.fak_roots or (workers and workers[1] == "fak"):
            root = Path(args.fak_roots.get(name, ROOT)).resolve()
            (tmp / name).mkdir()
            config = governor_config(tmp / name, upstream, shared=workers is not None)
            cmd = [py, "-m", "governor.cli", "serve", "--config", str(config), "--port",
                   str(port), "--metrics-port", str(free_port()), "--init-key"]
            if workers:
                cmd += ["--workers", workers[2]]
            pid = stack.enter_context(process([*under, *cmd], base + "/ready", root,
                                              ready_timeout_s=ready_timeout_s))
        elif name in ("aiohttp-httpx", "aiohttp-aiohttp") or workers:
            client = name.split("-")[1]
            cmd = [py, __file__, "proxy", client, str(port), upstream,
                   workers[2] if workers else "1"]
            pid = stack.enter_context(process([*under, *cmd], base + "/health",
                                              ready_timeout_s=ready_timeout_s))
        elif name == "tcp-relay":
            cmd = [py, __file__, "relay", str(port), upstream]
            pid = stack.enter_context(process([*under, *cmd], base + "/health",
                                              ready_timeout_s=ready_timeout_s))
        elif name == "litellm":
            cmd = [args.litellm_bin, "--model", f"hosted_vllm/{MODEL}", "--api_base",
                   upstream + "/v1", "--host", "127.0.0.1", "--port", str(port),
                   "--num_workers", "1"]
            pid = stack.enter_context(process(cmd, base + "/health/liveliness",
                                              env={"LITELLM_MASTER_KEY": KEY}))
        else:
            raise SystemExit(f"unknown arm {name!r}")
        arms[name] = Arm(base, pid)
    return arms


def run(args: argparse.Namespace) -> None:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not on PATH (Debian: apt-get install wrk)")
    print(f"CPU: {machine_line()}; load average at start {load_average()}")
    with tempfile.TemporaryDirectory() as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        upstream, upstream_pid = args.upstream_url, None
        if upstream is None:
            port = free_port()
            upstream = f"http://127.0.0.1:{port}"
            upstream_pid = stack.enter_context(process(
                [sys.executable, "bench/instant_upstream.py", "--port", str(port),
                 "--interval-ms", str(args.stream_interval_ms),
                 "--prefill-ms", str(args.stream_prefill_ms)],
                upstream + "/health"))
        arms = start_arms(stack, tmp, upstream, args)
        script = wrk_script(tmp, args.stream_tokens)
        for arm in arms.values():  # warm-up, discarded
            wrk(arm, script, 16, 1)
        results: dict[tuple[str, int], list[WrkResult]] = {}
        names = list(arms)
        for rep in range(args.reps):
            for c in args.concurrency:
                shift = (rep + c) % len(names)
                for name in names[shift:] + names[:shift]:
                    got = wrk(arms[name], script, c, args.duration, upstream_pid)
                    results.setdefault((name, c), []).append(got)
            print(f"  rep {rep + 1}/{args.reps} done; load average {load_average()}",
                  flush=True)
        what = (f"streaming, {args.stream_tokens} chunks, {args.stream_interval_ms} ms apart"
                f" after {args.stream_prefill_ms} ms of prefill"
                if args.stream_tokens else "non-streaming, max_tokens=1")
        print(f"\nrequests: {what}")
        report(results, names, args.concurrency,
               [n for n in names if n == "fak" or n in args.fak_roots or n.startswith("fak-w")])
        for other in args.fak_roots:
            if "fak" in names and other != "fak":
                print(f"\nfak against {other} (paired per rep):")
                for line in paired_ratios(results, args.concurrency, "fak", other):
                    print("  " + line)
    print(f"load average at the end {load_average()}")


def report(results: dict[tuple[str, int], list[WrkResult]], names: list[str],
           levels: list[int], governors: list[str]) -> None:
    print("\nreq/s, p50, p99 (medians over reps; wrk -t1)")
    print("| concurrency | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for c in levels:
        cells = []
        for name in names:
            runs = results[(name, c)]
            errors = sum(r.errors for r in runs)
            cell = (f"{statistics.median(r.rps for r in runs):,.0f} req/s, "
                    f"p50 {statistics.median(r.p50_ms for r in runs):.2f} ms, "
                    f"p99 {statistics.median(r.p99_ms for r in runs):.2f} ms")
            cells.append(cell + (f" ({errors} errors)" if errors else ""))
        print(f"| {c} | " + " | ".join(cells) + " |")
    print("\nCPU µs per request (medians): the arm's processes + the upstream + wrk = total; "
          "the ceiling is cores / total")
    for c in levels:
        cells = []
        for name in names:
            runs = results[(name, c)]
            arm = statistics.median(r.cpu_us or 0.0 for r in runs)
            up = statistics.median(r.upstream_us or 0.0 for r in runs)
            load = statistics.median(r.wrk_us for r in runs)
            total = arm + up + load
            cells.append(f"{arm:.0f} + {up:.0f} + {load:.0f} = {total:.0f} "
                         f"(≤ {(os.cpu_count() or 1) / total * 1e6:,.0f} req/s)")
        print(f"| {c} | " + " | ".join(cells) + " |")
    for gov in governors:
        print(f"\n{gov} against direct (paired per rep, median):")
        for c in levels:
            pairs = list(zip(results[("direct", c)], results[(gov, c)], strict=True))
            p50 = statistics.median(f.p50_ms - d.p50_ms for d, f in pairs)
            p99 = statistics.median(f.p99_ms - d.p99_ms for d, f in pairs)
            rps = statistics.median(r.rps for r in results[(gov, c)])
            print(f"  c={c}: {rps:,.0f} req/s; added p50 {p50:.2f} ms, added p99 {p99:.2f} ms")


def paired_ratios(results: dict[tuple[str, int], list[WrkResult]], levels: list[int],
                  arm: str, other: str) -> list[str]:
    """Per level, `arm` over `other` rep by rep (the two ran back to back within each rep,
    their order rotating): the median ratio of req/s and of CPU per request, with the
    reps' range. A range that holds 1.0 is a difference the run does not resolve."""
    lines = []
    for c in levels:
        pairs = list(zip(results[(arm, c)], results[(other, c)], strict=True))
        rps = [a.rps / b.rps for a, b in pairs if b.rps]
        if not rps:
            lines.append(f"c={c}: {other} answered nothing")
            continue
        cpu = [a.cpu_us / b.cpu_us for a, b in pairs if a.cpu_us and b.cpu_us]
        line = f"c={c}: req/s {_ratio(rps)}"
        if cpu:
            line += f", CPU per request {_ratio(cpu)}"
        lines.append(line + f" over {len(pairs)} reps")
    return lines


def _ratio(values: list[float]) -> str:
    return f"×{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:
        client, port, upstream = argv[1], int(argv[2]), argv[3]
        serve_bare_proxy(client, port, upstream, int(argv[4]) if len(argv) > 4 else 1)
        return
    if argv[:1] == ["relay"]:
        serve_tcp_relay(int(argv[1]), argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream-url", help="an engine already running (default: start "
                        "bench/instant_upstream.py)")
    parser.add_argument("--arms", type=lambda s: [a for a in s.split(",") if a],
                        default=["fak", "aiohttp-httpx", "aiohttp-aiohttp"],
                        help="comma-separated, besides direct")
    parser.add_argument("--litellm-bin", help="LiteLLM's `litellm` executable (adds the arm)")
    parser.add_argument("--fak-arm", action="append", default=[], metavar="NAME=PATH",
                        help="fak serve from another checkout as arm NAME (repeatable)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 16, 64])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--stream-tokens", type=int, default=0, help="stream this many "
                        "chunks per request instead (0: the table's non-streaming requests)")
    parser.add_argument("--stream-interval-ms", type=float, default=0.0,
                        help="the upstream pauses this long after each streamed chunk, as an "
                             "engine paces its steps (0: back to back)")
    parser.add_argument("--stream-prefill-ms", type=float, default=0.0,
                        help="the upstream pauses this long between a stream's head and its "
                             "first chunk, as an engine's prefill (0: none)")
    args = parser.parse_args(argv)
    if args.litellm_bin and "litellm" not in args.arms:
        args.arms.append("litellm")
    args.fak_roots = dict(spec.split("=", 1) for spec in args.fak_arm)
    args.arms += [name for name in args.fak_roots if name not in args.arms]
    run(args)


if __name__ == "__main__":
    main()
