"""The README's examples work as written against a real `fak serve` dev setup."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.governor.fak_serve_process import SERVING
from tests.http_client import HTTP

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.slow


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_quick_start_is_exactly_two_commands() -> None:
    start = README.index("## Quick start")
    section = README[start:README.index("\n## ", start + 1)]
    (block,) = re.findall(r"```\n(.*?)```", section, flags=re.S)
    assert block.strip().splitlines() == ["make serve", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "$(BIN)/fak serve" in makefile
    assert "pytest" in makefile and "make test" in (ROOT / ".ci/run").read_text()


def server_output(proc: subprocess.Popen[str], printed: list[str]) -> str:
    """What the server printed, and how it ended if it did: a failure's only witness."""
    time.sleep(1)
    code = proc.poll()
    if code is not None and proc.stdout is not None:
        printed = [*printed, proc.stdout.read()]
    return f"fak serve (exit code {code}) printed:\n{''.join(printed)}"


def test_curl_and_openai_examples(tmp_path: Path) -> None:
    # Both ports chosen by the kernel at bind time: a port picked free beforehand can be
    # taken in the seconds the model takes to load, and `port + 1` is never checked.
    proc = subprocess.Popen(
        [sys.executable, "-m", "governor.cli", "serve", "--port", "0", "--metrics-port", "0",
         "--data-dir", str(tmp_path / "data")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        key, serving, printed = None, None, []
        deadline = time.monotonic() + 600
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            printed.append(line)
            if not line:
                break
            if "API key:" in line:
                key = line.rsplit(" ", 1)[1].strip()
            serving = SERVING.search(line)
            if serving:
                break
        assert key and serving, server_output(proc, printed)
        url = serving.group(1)
        port = url.rsplit(":", 1)[1]
        try:
            ready = HTTP.get(f"{url}/ready").json()
        except httpx.HTTPError as exc:
            pytest.fail(f"/ready: {exc!r}; {server_output(proc, printed)}")
        assert ready == {"ready": True}
        env = {**os.environ, "FAK_KEY": key}
        (curl,) = [b for b in code_blocks("") if b.startswith("curl")]
        out = subprocess.run(["bash", "-c", curl.replace("8000", port)], env=env,
                             capture_output=True, text=True, timeout=300, check=True).stdout
        # The same greedy question twice: the model's words are the CPU's business, that
        # both examples get the same answer is the product's.
        answer = json.loads(out)["choices"][0]["message"]["content"]
        assert answer.strip()
        (snippet,) = code_blocks("python")
        out = subprocess.run([sys.executable, "-c", snippet.replace("8000", port)],
                             env=env, capture_output=True, text=True, timeout=300,
                             check=True).stdout
        assert out.startswith(answer) and "cached prompt tokens:" in out
    finally:
        proc.terminate()
        proc.wait(60)
