"""A fleet of vLLM-compatible upstreams behind one EngineDriver (docs/design.md §7)."""
