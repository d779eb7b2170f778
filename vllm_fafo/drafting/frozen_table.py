"""Cacheback's frozen table (Cacheback Sec. 3.3): frequent n-grams, built offline.

The most frequent ``leader_capacity`` n-grams of ``leader_len`` tokens in a
corpus become leaders; each keeps its ``follower_capacity`` most frequent
followers of ``follower_len`` tokens. At decode time the table is read-only
and consulted only where the request's own (dynamic) table misses.

Build one (:mod:`vllm_fafo.tools.build_frozen_table`) from text files, or from a
bundled prompt set as a stand-in corpus::

    vllm-fafo-frozen-table --model MODEL_DIR --out table.json --dataset mtbench
    vllm-fafo-frozen-table --model MODEL_DIR --out table.json corpus/*.txt

and load it with ``{"method": "cacheback", "frozen_table": "table.json"}``.
The token ids belong to the tokenizer it was built with: use the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_fafo.drafting.pool import NgramPool, Origin, RequestPool, file_each_in
from vllm_fafo.errors import FafoConfigError

FORMAT = "vllm-fafo-frozen-table/1"


def load_table(path: str, leader_len: int, follower_len: int) -> NgramPool:
    """The table as a read-only pool; errors name the config key and the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise FafoConfigError(
            f"speculative_config['frozen_table']={path!r} cannot be read as a frozen "
            f"table ({error}); build one with vllm-fafo-frozen-table"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FafoConfigError(
            f"speculative_config['frozen_table']={path!r} is not a {FORMAT} file; "
            "build one with vllm-fafo-frozen-table"
        )
    if (data["leader_len"], data["follower_len"]) != (leader_len, follower_len):
        raise FafoConfigError(
            f"speculative_config['frozen_table']={path!r} has leader_len="
            f"{data['leader_len']}, follower_len={data['follower_len']}, but the config "
            f"has leader_len={leader_len}, follower_len={follower_len}"
        )
    capacity = max((len(followers) for _, followers in data["entries"]), default=1)
    pool = NgramPool(leader_len, capacity, min_key_len=leader_len, touch_on_lookup=False)
    # least frequent first: the most frequent is MRU
    ngrams = [(leader, tuple(follower)) for leader, followers in data["entries"] for follower in followers]
    file_each_in([RequestPool(pool, -1)] * len(ngrams), ngrams, Origin.FROZEN)
    return pool
