"""The policy example in docs/compression_policies.md runs as written.

The guide's code is executed as a module, registered in POLICIES, parsed
from a user config, and driven through the region simulation of
test_region.py against a reference: so the guide cannot rot silently.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

from vllm_fafo.config import FafoConfig
from vllm_fafo.lanes import compression

from .test_region import HK, Request, run_simulation

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "compression_policies.md"


def example_module(monkeypatch) -> types.ModuleType:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    source = next(b for b in blocks if "class PromptHeadPolicy" in b)
    module = types.ModuleType("prompt_head")
    monkeypatch.setitem(sys.modules, "prompt_head", module)  # dataclasses look it up
    exec(compile(source, str(GUIDE), "exec"), module.__dict__)
    return module


def test_guide_example_registers_parses_and_selects(monkeypatch):
    module = example_module(monkeypatch)
    monkeypatch.setitem(compression.POLICIES, "prompt_head", module.PromptHeadPolicy)
    config = FafoConfig.from_user_dict(
        {"method": "fafo", "compression": "prompt_head", "kv_budget": 24, "sink_tokens": 2,
         "prompt_head_recent_tokens": 8, "num_speculative_tokens": 4}
    )
    policy = config.make_policy()
    layout = policy.layout
    assert (layout.sink_tokens, layout.selected_slots, layout.ring_slots) == (2, 14, 8)

    def reference(req, num_final, lane_query, lane_step):
        if lane_step != 1:
            return None
        end = min(layout.sink_tokens + layout.selected_slots, layout.oldest_in_ring(num_final))
        return [list(range(layout.sink_tokens, end))] * HK

    requests = [Request("a", 40, seed=1), Request("b", 12, seed=2)]
    checked, selected = run_simulation(policy, requests, 512, num_lanes=2, lane_len=2,
                                       max_drafts=3, steps=8, seed=0, reference=reference)
    assert checked > 0 and selected["a"] == [list(range(2, 16))] * HK
