"""Attention kernels behind one contract (see torch_ref's docstring)."""

from __future__ import annotations

from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "torch")


def select_backend(name: str, device: torch.device | str) -> ModuleType:
    """Return a module exposing `store_kv` and `paged_attention` for `name` on `device`.

    `auto` is Triton on CUDA and torch elsewhere. `torch` is `torch_fast` (decodes batched);
    `torch_ref`, its batch-invariant oracle, is imported directly by tests. `triton` off CUDA
    runs only under Triton's CPU interpreter (TRITON_INTERPRET=1 set before the kernels are
    first imported; slow, meant for tests); otherwise it is refused here rather than failing
    at the first launch.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "torch" or (name == "auto" and not on_cuda):
        from native_engine.kernels import torch_fast

        return torch_fast
    from native_engine.kernels import triton_backend

    if not on_cuda and not triton_backend.INTERPRETED:
        raise ValueError(
            f"the triton attention backend needs a CUDA device (got {torch.device(device)}); "
            "on CPU it runs only under Triton's interpreter: set TRITON_INTERPRET=1 before "
            "the kernels are first imported, or use --attention-backend torch"
        )
    return triton_backend
