"""export-hf writes a directory hf_loader reads back to the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from native_engine.model.export_hf import cmd_export_hf, export_hf, export_model
from native_engine.model.hf_loader import load_hf_dir
from native_engine.model.loaded import LoadedModel
from native_engine.model.weights import load_model
from tests.native_engine.reference import ReferenceModel
from tests.native_engine.tiny_model import random_model

HF_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"}


def assert_same_model(a: LoadedModel, b: LoadedModel, prompt: str) -> None:
    assert a.config == b.config
    assert set(a.weights) == set(b.weights)
    for name, value in a.weights.items():
        assert torch.equal(b.weights[name], value), name
    ids = a.tokenizer.encode(prompt)
    assert b.tokenizer.encode(prompt) == ids
    assert b.tokenizer.stop_token_ids == a.tokenizer.stop_token_ids
    assert (b.tokenizer.bos_token, b.tokenizer.eos_token) == (a.tokenizer.bos_token,
                                                              a.tokenizer.eos_token)
    messages = [{"role": "user", "content": prompt}]
    assert b.chat_template.render(messages) == a.chat_template.render(messages)
    logits_a = ReferenceModel(a.config, a.weights).logits(ids)
    logits_b = ReferenceModel(b.config, b.weights).logits(ids)
    assert torch.equal(logits_a, logits_b)


def test_random_model_round_trips(tmp_path: Path) -> None:
    model = random_model(seed=2)
    export_model(model, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == HF_FILES
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["added_tokens_decoder"]["1"]["content"] == "<|im_start|>"
    assert_same_model(model, load_hf_dir(tmp_path), "héllo <|im_end|> 42")


def test_untied_and_bf16_export(tmp_path: Path) -> None:
    from tests.native_engine.tiny_model import tiny_config

    model = random_model(tiny_config(tie_word_embeddings=False), seed=4)
    export_model(model, tmp_path, torch.bfloat16)
    back = load_hf_dir(tmp_path)
    assert "lm_head.weight" in back.weights
    assert back.weights["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(back.weights["lm_head.weight"],
                       model.weights["lm_head.weight"].to(torch.bfloat16))


def test_hf_loader_errors(tmp_path: Path) -> None:
    export_model(random_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "x"}}))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing"):
        load_hf_dir(tmp_path)


def test_export_refuses_a_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    assert cmd_export_hf(str(tmp_path)) == 1
    with pytest.raises(FileExistsError):
        export_hf(tmp_path)


@pytest.mark.slow
def test_smollm_export_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "smollm2"
    assert cmd_export_hf(str(out)) == 0
    assert {p.name for p in out.iterdir()} == HF_FILES
    original = load_model(None, torch.float32)
    back = load_model(out, torch.float32)
    assert back.source == str(out)
    assert_same_model(original, back, "What is the capital of France?")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2]
