"""Convert a llama-family GGUF into an HF directory that vLLM can load.

Runs inside the vLLM environment (scripts/setup-vllm.sh installs transformers, gguf and
accelerate there):

    .vllm-venv/bin/python scripts/hf_from_gguf.py GGUF_FILE OUTDIR

transformers' GGUF loader dequantises the weights to float, but the model it returns is
marked as quantised and `save_pretrained` would write it that way; so its state dict is
copied into a fresh model built from the same config before saving. The tokenizer (with
the GGUF's chat template) is saved beside it. Weights are written as float32 so no
precision is lost before the server casts them to its own dtype.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def convert(gguf_file: Path, outdir: Path) -> None:
    """Write config, float32 safetensors, tokenizer and chat template of `gguf_file`."""
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_file}")
    src_dir, name = str(gguf_file.parent), gguf_file.name
    # Each GGUF read parses the whole metadata (~10 s for the vocabulary here): the config
    # is read once and the loader gets a copy (it marks its own as quantised, and `fresh`
    # below must not be).
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    config.dtype = torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, config=copy.deepcopy(config), dtype=torch.float32
    )
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head may be absent from the GGUF; anything else missing is a real loss.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    outdir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(outdir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_file} carries no chat template")
    tokenizer.save_pretrained(outdir)
    absent = [f for f in REQUIRED_FILES if not (outdir / f).is_file()]
    if absent:
        raise RuntimeError(f"conversion left out {absent} in {outdir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("outdir", type=Path)
    args = parser.parse_args(argv)
    convert(args.gguf_file.resolve(), args.outdir)
    print(f"wrote {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
