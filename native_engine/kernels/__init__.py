"""Attention kernels behind one contract (see torch_ref's docstring)."""

from __future__ import annotations

from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "torch", "cpu")


def select_backend(name: str, device: torch.device | str) -> ModuleType:
    """Return a module exposing `store_kv` and `paged_attention` for `name` on `device`.

    `auto` is Triton on CUDA; on a CPU it is `cpu` (torch_fast with its decodes through
    fak's C kernel) where that kernel built, else `torch`. `torch` is `torch_fast` (decodes
    batched through SDPA); `torch_ref`, the batch-invariant oracle, is imported directly by
    tests. `cpu` where the kernel did not build is refused here, as is `triton` off CUDA
    unless Triton's CPU interpreter is on (TRITON_INTERPRET=1 set before the kernels are
    first imported; slow, meant for tests), rather than failing at the first call.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "cpu" or (name == "auto" and not on_cuda):
        from native_engine.kernels import cpu_native

        if cpu_native.load() is not None and not on_cuda:
            from native_engine.kernels import cpu_backend

            return cpu_backend
        if name == "cpu":
            raise ValueError(
                "the cpu attention backend needs fak's C kernels on a CPU device; "
                + ("they did not build here (see the 'cpu kernels: off' log line)"
                   if not on_cuda else f"got {torch.device(device)}")
                + "; use --attention-backend torch")
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
