"""The session's real vLLM server answers HTTP, reports cached tokens and publishes KV events;
the HF weights it serves are the same whichever converter made them."""

from __future__ import annotations

import random
import string
import time

import httpx
import msgpack
import pytest
import torch
import zmq
from safetensors.torch import load_file
from tokenizers import Tokenizer

from .vllm_server import (
    VllmServer,
    VllmServerConfig,
    fak_export_hf_dir,
    find_embedded_gguf,
    transformers_hf_dir,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _random_letters(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(count))


def _complete(client: httpx.Client, server: VllmServer, prompt: str) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = client.post(f"{server.base_url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _receive_frames(sub: zmq.Socket, timeout_s: float) -> list[bytes]:
    assert sub.poll(int(timeout_s * 1000)), "no KV event frame within the timeout"
    return sub.recv_multipart()


def test_models_completion_cached_tokens_and_kv_event(vllm_server: VllmServer) -> None:
    vllm_server.check_integrity()
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, vllm_server.kv_topic.encode())
    assert vllm_server.kv_endpoint_mode == "connect"
    sub.connect(vllm_server.kv_endpoint)
    time.sleep(0.5)  # let the subscription reach the PUB socket (ZeroMQ slow joiner)
    prompt = _random_letters(200, seed=time.time_ns())
    try:
        with httpx.Client(timeout=300.0) as client:  # the first request after start-up is slow
            models = client.get(f"{vllm_server.base_url}/v1/models").json()
            assert [m["id"] for m in models["data"]] == [vllm_server.model]
            first = _complete(client, vllm_server, prompt)
            second = _complete(client, vllm_server, prompt)
        topic, seq, payload = _receive_frames(sub, timeout_s=10.0)
    finally:
        sub.close()
    assert first["usage"]["prompt_tokens"] > vllm_server.block_size
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % vllm_server.block_size == 0
    assert topic == vllm_server.kv_topic.encode()
    assert len(seq) == 8
    ts, events, _dp_rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    assert ts > 0
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and stored[0]["block_size"] == vllm_server.block_size


def test_fak_exporter_matches_transformers_conversion() -> None:
    """Both converters give the server the same weights (fak's exporter must undo
    llama.cpp's Q/K permutation exactly), the same tokenization and chat template."""
    config = VllmServerConfig.from_env()
    gguf = find_embedded_gguf()
    fak_dir = fak_export_hf_dir(config, gguf)
    reference_dir = transformers_hf_dir(config, gguf)
    assert fak_dir is not None, "native_engine.model.export_hf failed; see logs/hf-conversion.log"
    assert reference_dir is not None, "transformers conversion failed"
    ours = load_file(fak_dir / "model.safetensors")
    theirs = load_file(reference_dir / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name].float(), tensor.float()), name
    text = "<|im_start|>user\nHello, vLLM! 12345 ünïcödé<|im_end|>\n"
    assert (
        Tokenizer.from_file(str(fak_dir / "tokenizer.json")).encode(text).ids
        == Tokenizer.from_file(str(reference_dir / "tokenizer.json")).encode(text).ids
    )
    template = "chat_template.jinja"
    assert (fak_dir / template).read_text() == (reference_dir / template).read_text()
