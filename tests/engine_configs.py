"""Every engine configuration the engine tests run, one in-process engine each.

Each configuration's engine runs the mixed call (tests/mixed_workload.py) once; its
tests read that run and, where a check needs a call of its own (a salt, an abort, a
spy on the worker), make it on the same engine. Configurations were merged where one
engine covers two (deep matches are always drafted first, so the lanes engine
drafts from them; trees with lanes cover the ``fafo with lanes`` tree mode).
"""

from __future__ import annotations

from typing import Any

LANES_SPEC = {"method": "fafo", "num_lanes": 4, "lane_len": 4, "kv_budget": 64, "sink_tokens": 4,
              "controller": "fixed", "num_speculative_tokens": 4}
"""Lanes pinned on (the goodput controller would turn them off where they do not pay), a
64-token region so every prompt overflows it and the window's ring wraps, deep matches
(always drafted first), 4-token drafts (sampled requests pay every draft token)."""

TREE_SPEC = {**LANES_SPEC, "num_candidates": 4}
"""Lanes and up to three branches next to each spine, every one run (fixed controller)."""

POOL_TREE_SPEC = {"method": "fafo", "num_lanes": 0, "num_candidates": 4}
"""No lanes: deep matches, the n-gram pool and the prior table, with draft trees sized by
the goodput controller."""

FROZEN_TABLE = object()
"""Stands for the path of the Cacheback frozen table the session builds."""

GOODPUT_LANES_SPEC = {"method": "fafo", "num_lanes": 16}
"""Lanes asked for, the goodput controller deciding each step whether they run (the CPU
default until 2026-12-05): they go on when it probes them and off again."""

CONFIGS: dict[str, dict[str, Any]] = {
    "cacheback": {"method": "cacheback", "frozen_table": FROZEN_TABLE, "num_candidates": 4},
    "chunked-prefill": LANES_SPEC,
    "default": {"method": "fafo"},
    "lanes": LANES_SPEC,
    "lookahead": {"method": "lookahead", "window": 6, "ngram": 4, "guesses": 6, "num_candidates": 4},
    "pool-tree": POOL_TREE_SPEC,
    "quest": {**LANES_SPEC, "compression": "quest", "kv_budget": 96, "quest_page_size": 16,
              "quest_recent_tokens": 32, "quest_refresh_steps": 2},
    "snapkv": {**LANES_SPEC, "compression": "snapkv", "kv_budget": 64, "snapkv_window": 16,
               "snapkv_recent_tokens": 24},
    "tree": TREE_SPEC,
    "goodput-lanes": GOODPUT_LANES_SPEC,
}
"""name -> speculative_config. Quest's and SnapKV's budgets are well below the prompts'
lengths, so every policy has to choose. Each configuration's mixed workload is seeded by
its place here (tests/conftest.py's ``mixed_run``): a configuration added goes at the
end, so that the others keep their prompts and sampled requests."""

ENGINE_OVERRIDES: dict[str, dict[str, Any]] = {
    "chunked-prefill": {"max_num_batched_tokens": 32, "max_num_seqs": 4},
}
"""Engine arguments beyond tests/engine_utils.py's, per configuration."""

SAMPLED = ("default", "lanes", "tree")
"""Configurations whose mixed call carries sampled requests: every acceptance rule
(chains, trees, the goodput controller's cut drafts; padded drafts in
tests/test_padded_engine.py) and the draft sources (lanes, deep matches, the pools, the
prior table). The modes and the compression policies
verify through the same rules and sources."""
