"""Pure decisions (docs/design.md §3): facts in, decisions out. No I/O, no clocks, no globals.

Modules: salts (tenant cache salts, client salt inputs), priority (tenant class → engine
priority, admission rank), quarantine (plan per engine capabilities), determinism (operator
declaration parser), measurement (A/B warm-state gates), eviction (value-aware victims).
"""
