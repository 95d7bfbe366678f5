"""`fak bench ab` at a tiny size on real engines: the native engine (`fak engine serve`)
against the real vLLM CPU server, and the native engine direct against itself through the
governor (`--through-governor`). The artifacts validate, the plots are PNGs, and the
per-arm, per-block results load in vLLM's own result readers (run in the vLLM venv)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from governor.auth import sha256_hex
from governor.cli import main
from tests.bench.outputs import check_outputs

from .native_server import NativeServer
from .vllm_server import REPO_ROOT, VllmServer, VllmServerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = ["--concurrency", "2", "--blocks", "2", "--requests-per-block", "2",
        "--warmup-requests", "1", "--input-len", "16", "--output-len", "4", "--no-progress"]


def test_fak_bench_ab_native_vs_vllm_and_through_governor(
        vllm_server: VllmServer, native_vllm_server: NativeServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    native, vllm = native_vllm_server, vllm_server
    engines = tmp_path / "engines"
    rc = main(["bench", "ab", "--arm", f"native={native.base_url}",
               "--arm", f"vllm={vllm.base_url}", "--arm-log", f"native={native.log_path}",
               "--arm-log", f"vllm={vllm.log_path}",
               "--arm-compile-cache", "native=not_applicable",
               "--tokenizer", str(vllm.hf_dir), "--out", str(engines), *TINY])
    assert rc in (0, 1), capsys.readouterr()
    docs = check_outputs(engines, ("native", "vllm"), ("c2",))
    arms = {a["name"]: a for a in docs[0]["arms"]}
    assert arms["vllm"]["engine"] == "vllm 0.32.0"
    assert arms["vllm"]["warm"]["compile_cache"] == "not_applicable"  # eager, /server_info
    assert arms["native"]["engine"].startswith("fak ")
    for arm in arms.values():
        assert arm["figures"]["completed"] == 4 and arm["figures"]["failed"] == 0
        assert arm["warm"]["prefix_cache_at_start"] == "warm_disjoint"  # observed

    config = tmp_path / "fak.toml"
    config.write_text(f'[engine]\nkind = "vllm"\nbase_url = "{native.base_url}"\n'
                      f'model = "{native.model}"\n[engine.declare]\n'
                      f'prompt_tokens_details = true\n[[tenants]]\nid = "bench"\n'
                      f'api_key_sha256 = ["{sha256_hex("bench-key")}"]\nclass = "interactive"\n')
    monkeypatch.setenv("FAK_BENCH_API_KEY", "bench-key")
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    governed = tmp_path / "governed"
    rc = main(["bench", "ab", "--arm", f"direct={native.base_url}", "--through-governor",
               str(config), "--arm-compile-cache", "direct=not_applicable",
               "--arm-log", f"direct={native.log_path}", "--out", str(governed), *TINY])
    assert rc in (0, 1), capsys.readouterr()
    docs = check_outputs(governed, ("direct", "governor"), ("c2",))
    governor_arm = next(a for a in docs[0]["arms"] if a["name"] == "governor")
    assert governor_arm["engine"].startswith("fak governor → fak ")
    assert governor_arm["figures"]["completed"] == 4

    python = VllmServerConfig.from_env().python
    reader = Path(__file__).with_name("vllm_result_reader.py")
    proc = subprocess.run([str(python), str(reader), str(engines / "vllm"),
                           str(governed / "vllm")], capture_output=True, text=True,
                          timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(x.removeprefix("READER-RESULT ")) for x in proc.stdout.splitlines()
               if x.startswith("READER-RESULT ")]
    assert len(results) == 2
    for runs in results:
        assert len(runs) == 4  # two arms x two blocks
        assert all(r["completed"] == 2 and r["ttfts"] == 2 for r in runs)
    assert proc.stdout.count("Grid: 2 rows x 1 cols") == 2  # vLLM grouped the runs by arm
