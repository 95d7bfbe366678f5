"""The Triton backend: what `select_backend` returns for "triton" (same names as torch_ref)."""

from __future__ import annotations

from native_engine.kernels.triton_attention import INTERPRETED, paged_attention
from native_engine.kernels.triton_store import store_kv

__all__ = ["INTERPRETED", "paged_attention", "store_kv"]
