"""GGUF loading: dequantisation per type, llama.cpp's q/k permutation, weight cache."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from native_engine.model import gguf_loader, weights
from native_engine.model.gguf_loader import load_gguf, unpermute_rotary_rows
from native_engine.model.llama import LlamaConfig
from native_engine.model.loaded import LoadedModel
from native_engine.model.weights import load_model
from tests.native_engine.tiny_model import CHATML_TEMPLATE, random_model

Q = gguf.GGMLQuantizationType
CYCLE = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1)
# Worst-case absolute error per element for weights of scale ~1/sqrt(64).
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 5e-3, Q.Q4_0: 8e-2, Q.Q4_1: 5e-2}

LAYER_STEMS = {v: k for k, v in gguf_loader._LAYER_NAMES.items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, as written there."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf: str) -> str:
    for stem, name in gguf_loader._GLOBAL_NAMES.items():
        if name == hf:
            return stem
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER_STEMS[rest]}"


def write_gguf(path: Path, model: LoadedModel) -> dict[str, tuple[Q, np.ndarray]]:
    """A llama GGUF of `model` as llama.cpp's converter writes it; returns what was stored."""
    cfg, tok = model.config, model.tokenizer
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    writer.add_token_list(vocab)
    writer.add_token_types([3, 3, 3] + [1] * (len(vocab) - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_chat_template(CHATML_TEMPLATE)
    stored = {}
    for i, (name, value) in enumerate(sorted(model.weights.items())):
        array = value.numpy()
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_kv_heads)
        qtype = Q.F32 if array.ndim == 1 else CYCLE[i % len(CYCLE)]
        data = gguf.quants.quantize(array, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        stored[name] = (qtype, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel, dict]:
    model = random_model(seed=3)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, model, write_gguf(path, model)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(6 * 16 * 4, dtype=np.float32).reshape(6 * 16, 4)
    for heads in (1, 3, 6):
        back = unpermute_rotary_rows(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))


def test_config_and_tokenizer_from_gguf(tiny_gguf: tuple) -> None:
    path, model, _ = tiny_gguf
    loaded = load_gguf(path)
    assert loaded.config == model.config
    text = "héllo <|im_start|>wörld 123\n"
    assert loaded.tokenizer.encode(text) == model.tokenizer.encode(text)
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.chat_template is not None


def test_every_quant_type_dequantises_like_gguf(tiny_gguf: tuple) -> None:
    path, model, stored = tiny_gguf
    loaded = load_gguf(path)
    seen = set()
    for name, (qtype, data) in stored.items():
        heads = {"q_proj": model.config.num_heads, "k_proj": model.config.num_kv_heads}
        expected = torch.from_numpy(gguf.quants.dequantize(data, qtype).copy())
        for key, n in heads.items():
            if key in name:
                expected = unpermute_rotary_rows(expected, n)
        assert torch.equal(loaded.weights[name], expected), name
        error = (loaded.weights[name] - model.weights[name]).abs().max().item()
        assert error <= TOLERANCE[qtype], (name, qtype.name, error)
        seen.add(qtype)
    assert seen == set(CYCLE)


def test_unsupported_tensor_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tensor"):
        gguf_loader.hf_name("blk.0.attn_qkv.weight")


def test_weight_cache_roundtrip(tiny_gguf: tuple, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, _, _ = tiny_gguf
    monkeypatch.setenv("FAK_CACHE_DIR", str(tmp_path))
    first = load_model(path, torch.float32)
    digest = weights.file_digest(path)
    assert (tmp_path / "weights" / f"{digest}-float32.safetensors").is_file()

    def refuse(_: Path) -> LoadedModel:
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(gguf_loader, "load_gguf", refuse)
    second = load_model(path, torch.float32)
    assert second.config == first.config
    assert second.tokenizer.stop_token_ids == first.tokenizer.stop_token_ids
    assert second.chat_template.source == first.chat_template.source
    for name, value in first.weights.items():
        assert torch.equal(second.weights[name], value), name


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither"):
        load_model(tmp_path / "nope.bin", torch.float32)


@pytest.mark.slow
def test_embedded_gguf_is_smollm2() -> None:
    path = weights.embedded_gguf_path()
    assert path.name.endswith(".gguf") and path.is_file()
    loaded = load_model(None, torch.float32)
    assert loaded.config == LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
