"""Attention kernels behind one contract (see torch_ref's docstring)."""

from __future__ import annotations

from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "torch")


def select_backend(name: str, device: torch.device | str) -> ModuleType:
    """Return a module exposing `store_kv` and `paged_attention` for `name` on `device`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "torch" or (name == "auto" and not on_cuda):
        from native_engine.kernels import torch_ref

        return torch_ref
    raise NotImplementedError("the Triton backend is not built yet")
