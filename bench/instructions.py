"""Instructions per request under callgrind: fak beside a bare proxy, without the noise
(issue 19).

The line-rate bench's CPU time per request moves by ±20 µs between reps on a shared 2-core
VM, more than most single changes to the hot path. Callgrind counts the instructions a
process executes instead: the same count for the same code and requests, whatever else the
machine is doing. Each arm runs under `valgrind --tool=callgrind` against
bench/instant_upstream.py (not under valgrind): `--warmup` requests, the counters zeroed,
`--requests` more at `--concurrency` from one aiohttp client, the counters dumped. Every
thread of the arm's process counts; the kernel's work (system calls, loopback TCP) does not,
nor do cache misses: this is the user-space work per request, not its time. Arms as in
bench/line_rate.py (one process each: no `-wN`, no LiteLLM). Counts are exact, so arms run
one after the other rather than interleaved.

    .venv/bin/python bench/instructions.py [--arms fak,aiohttp-aiohttp] \\
        [--fak-arm base=<a worktree>] [--requests 1000] [--stream-tokens 0] \\
        [--stream-interval-ms 0] [--keep DIR]

`valgrind` must be on PATH (Debian: `apt-get install valgrind`); `--keep DIR` keeps each
arm's dump for `callgrind_annotate`. The bare proxy runs on asyncio's own loop, fak on uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import line_rate

from governor.bench.artifact import machine_line

SUMMARY = re.compile(rb"^(?:summary|totals): (\d+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Counted:
    instructions: int
    requests: int
    dump: Path

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests


def request_body(stream_tokens: int) -> str:
    if not stream_tokens:
        return line_rate.BODY
    return line_rate.BODY.replace('"max_tokens":1', f'"max_tokens":{stream_tokens},'
                                  '"stream":true')


async def send(url: str, body: str, count: int, concurrency: int) -> None:
    """`count` requests, `concurrency` at a time, each answer read whole and checked."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {line_rate.KEY}"}
    left = iter(range(count))
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def worker() -> None:
            for _ in left:
                async with session.post(url + "/v1/completions", data=body,
                                        headers=headers) as answer:
                    await answer.read()
                    if answer.status != 200:
                        raise SystemExit(f"{url} answered {answer.status}")
        await asyncio.gather(*(worker() for _ in range(concurrency)))


def control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=300)


def measured_dump(directory: Path, pid: int) -> Path:
    """The dump `callgrind_control -d measured` wrote for `pid`."""
    for path in sorted(directory.glob(f"cg.{pid}.*")):
        with path.open("rb") as f:
            if b"dump measured" in f.read(4096):
                return path
    raise SystemExit(f"no measured dump for pid {pid} in {directory}")


def count(arm: line_rate.Arm, dumps: Path, args: argparse.Namespace) -> Counted:
    assert arm.pid is not None
    body = request_body(args.stream_tokens)
    asyncio.run(send(arm.url, body, args.warmup, args.concurrency))
    control("-z", str(arm.pid))
    asyncio.run(send(arm.url, body, args.requests, args.concurrency))
    control("-d", "measured", str(arm.pid))
    dump = measured_dump(dumps, arm.pid)
    found = SUMMARY.search(dump.read_bytes())
    if found is None:
        raise SystemExit(f"{dump} has no instruction total")
    return Counted(int(found.group(1)), args.requests, dump)


def run(args: argparse.Namespace) -> None:
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not on PATH (Debian: apt-get install valgrind)")
    print(f"CPU: {machine_line()}")
    with tempfile.TemporaryDirectory() as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        port = line_rate.free_port()
        upstream = f"http://127.0.0.1:{port}"
        stack.enter_context(line_rate.process(
            [sys.executable, "bench/instant_upstream.py", "--port", str(port),
             "--interval-ms", str(args.stream_interval_ms)],
            upstream + "/health"))
        under = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.%p")
        arms = line_rate.start_arms(stack, tmp, upstream, args, under, ready_timeout_s=900)
        arms.pop("direct")
        counted = {name: count(arm, tmp, args) for name, arm in arms.items()}
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name, c in counted.items():
                shutil.copy(c.dump, args.keep / f"{name}.callgrind")
    report(counted, args)


def report(counted: dict[str, Counted], args: argparse.Namespace) -> None:
    what = (f"streaming, {args.stream_tokens} chunks, {args.stream_interval_ms:g} ms apart"
            if args.stream_tokens else "non-streaming, max_tokens=1")
    print(f"\n{args.requests} requests ({what}) at concurrency {args.concurrency} after "
          f"{args.warmup} unmeasured")
    first = next(iter(counted.values())).per_request
    print("| arm | instructions per request | against the first arm |")
    print("|---|---|---|")
    for name, c in counted.items():
        print(f"| {name} | {c.per_request:,.0f} | {c.per_request / first:.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", type=lambda s: [a for a in s.split(",") if a],
                        default=["fak", "aiohttp-aiohttp"],
                        help="comma-separated (bench/line_rate.py's one-process arms)")
    parser.add_argument("--fak-arm", action="append", default=[], metavar="NAME=PATH",
                        help="fak serve from another checkout as arm NAME (repeatable)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=0,
                        help="stream this many chunks per request (0: one whole answer)")
    parser.add_argument("--stream-interval-ms", type=float, default=0.0,
                        help="the upstream's pause after each chunk (0: back to back, most "
                        "read together; paced as an engine's steps, each is a read and a "
                        "write of its own)")
    parser.add_argument("--keep", type=Path, help="copy each arm's dump here")
    args = parser.parse_args(argv)
    args.fak_roots = dict(spec.split("=", 1) for spec in args.fak_arm)
    args.arms += [name for name in args.fak_roots if name not in args.arms]
    bad = [a for a in args.arms if a == "litellm" or re.search(r"-w\d+$", a)]
    if bad:
        parser.error(f"one process per arm here: {', '.join(bad)} cannot be counted")
    if min(args.requests, args.warmup, args.concurrency) < 1 or args.stream_tokens < 0:
        parser.error("--requests, --warmup and --concurrency must be positive")
    if args.stream_interval_ms < 0:
        parser.error("--stream-interval-ms must be >= 0")
    run(args)


if __name__ == "__main__":
    main()
