"""The native pool (numba kernels) against the Python reference pool, driven alike.

Random streams over small vocabularies (so keys collide, keys and candidates get
evicted, votes tie) and a real prompt set's token streams; every answer, every
key's candidates in recency order and every pool's keys in order must be the
reference's, for every setting the methods use.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

import tests.reference_deep_match as reference_deep_match
import tests.reference_pool as reference
from vllm_fafo.config import FafoConfig
from vllm_fafo.drafting import pool as native
from vllm_fafo.drafting.index import DraftIndex
from vllm_fafo.drafting.prior_table import PriorTable

SETTINGS = {
    "fafo": dict(max_key_len=4, capacity=8, min_key_len=1, touch_on_lookup=True, rank="votes"),
    "fafo-recency": dict(max_key_len=3, capacity=2, min_key_len=1, touch_on_lookup=True, rank="recency"),
    "lookahead": dict(max_key_len=1, capacity=3, min_key_len=1, touch_on_lookup=False, rank="recency"),
    "cacheback": dict(max_key_len=2, capacity=2, min_key_len=2, touch_on_lookup=False, rank="recency"),
}


def _pair(setting: dict, max_keys: tuple[int, int], arena: native.PoolArena | None, key_eviction: str = "lru"):
    refs = tuple(reference.NgramPool(**setting, max_keys=keys, key_eviction=key_eviction) for keys in max_keys)
    pools = tuple(native.NgramPool(**setting, max_keys=keys, key_eviction=key_eviction, arena=arena)
                  for keys in max_keys)
    return refs, pools


def _same_state(refs, pools, contexts):
    for ref, pool in zip(refs, pools):
        assert pool.keys() == ref.keys()
        assert len(pool) == len(ref) and pool.num_entries() == ref.num_entries()
        for context in contexts:
            for key_len in range(1, len(context) + 1):
                assert pool.candidates(context[-key_len:]) == ref.candidates(context[-key_len:])


def _set_running_keys(ref, pool, keys: int) -> None:
    """Both pools hold ``keys`` keys of running requests on top of their bound."""
    ref.running_keys = keys
    pool.arena._owners[pool.owner, native.kernels.O_RUNNING_KEYS] = keys


TAGS = (-1, 1, 2, 3)
"""Tags the random streams file and ask under: the pool as one request's (-1) and three
requests of a tenant."""


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("shared_arena", [False, True])
@pytest.mark.parametrize("key_eviction", native.KEY_EVICTIONS)
def test_random_streams_match_the_reference(name, shared_arena, key_eviction):
    setting = SETTINGS[name]
    rng = random.Random(7)
    arena = native.PoolArena(**{k: v for k, v in setting.items() if k != "capacity"},
                             capacity=setting["capacity"], candidate_len=2) if shared_arena else None
    # one pool unbounded (or Cacheback's leader cap), one bounded in keys as a tenant's
    refs, pools = _pair(setting, (6 if name == "cacheback" else 0, 12), arena, key_eviction)
    contexts = []
    for step in range(3000):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
        contexts.append(context)
        which, tag = rng.randrange(2), rng.choice(TAGS)
        ref, pool = (reference.RequestPool(refs[which], tag), native.RequestPool(pools[which], tag))
        if rng.random() < 0.02:  # running requests come and go: the bound moves
            _set_running_keys(refs[1], pools[1], rng.randrange(0, 8))
        if rng.random() < 0.6:
            candidate = tuple(rng.randrange(6) for _ in range(rng.randrange(1, 5)))  # longer than the arena's 2
            origin = rng.choice(list(native.Origin))
            reference.file_in(ref, context, candidate, reference.Origin(origin.value))
            native.file_in(pool, context, candidate, origin)
        else:
            guess = rng.choice([None, rng.randrange(6)])
            want = reference.match_in(ref, context, guess)
            have = native.match_in(pool, context, guess)
            assert (have is None) == (want is None), step
            if want is not None:
                assert (have.candidate, have.origin.value, have.key_len) == (
                    want.candidate, want.origin.value, want.key_len), step
            assert list(native.alternatives_in(pool, context)) == list(reference.alternatives_in(ref, context))
        if step % 500 == 0:
            _same_state(refs, pools, contexts[-50:])
    _same_state(refs, pools, contexts[-200:])


def test_filing_a_batch_of_ngrams_is_filing_each_in_turn():
    rng = random.Random(5)
    setting = SETTINGS["fafo"]
    arena = native.PoolArena(**{k: v for k, v in setting.items()}, candidate_len=2)
    refs, pools = _pair(setting, (0, 10), arena)
    targets, ref_targets, ngrams = [], [], []
    for _ in range(400):
        which, tag = rng.randrange(2), rng.choice(TAGS)
        targets.append(native.RequestPool(pools[which], tag))
        ref_targets.append(reference.RequestPool(refs[which], tag))
        ngrams.append(([rng.randrange(4) for _ in range(rng.randrange(1, 6))],
                       tuple(rng.randrange(5) for _ in range(rng.randrange(1, 7)))))
    native.file_each_in(targets, ngrams, native.Origin.LANE)
    for target, (context, candidate) in zip(ref_targets, ngrams):
        reference.file_in(target, context, candidate, reference.Origin.LANE)
    _same_state(refs, pools, [context for context, _ in ngrams])
    for tag in TAGS:  # the tags too
        for context, _ in ngrams[:50]:
            want = reference.match_in(reference.RequestPool(refs[1], tag), context)
            have = native.match_in(native.RequestPool(pools[1], tag), context)
            assert (None if want is None else (want.candidate, want.origin.value)) == (
                None if have is None else (have.candidate, have.origin.value))


def test_pools_of_one_arena_are_isolated_and_freed():
    arena = native.PoolArena(3, 4)
    a, b = native.NgramPool(3, 4, arena=arena), native.NgramPool(3, 4, arena=arena)
    a.add([1, 2, 3], (4,), native.Origin.PROMPT)
    assert b.match([1, 2, 3]) is None and a.match([1, 2, 3]).candidate == (4,)
    assert arena.num_live_keys == 3
    owner = b.owner
    del a
    assert arena.num_live_keys == 0  # the handle went: its keys with it
    c = native.NgramPool(3, 4, arena=arena)
    assert c.owner != owner and c.match([1, 2, 3]) is None  # a reused id starts empty


def test_memory_is_bounded_over_ten_thousand_requests():
    """Requests come and go through one tenant's pool: what the arena allocates stays what
    the bound and the most requests running at once need, not what all of them filed."""
    rng = np.random.default_rng(0)
    arena = native.PoolArena(4, 8, rank="votes", candidate_len=4)
    tenant = native.NgramPool(4, 8, max_keys=2000, key_eviction="fifo", rank="votes", arena=arena)
    running: list[int] = []
    sizes = []
    for request in range(10_000):
        target = native.RequestPool(tenant, arena.new_tag())
        text = rng.integers(0, 50_000, size=40).tolist()
        for end in range(1, 36):
            native.file_in(target, text[max(0, end - 4) : end], tuple(text[end : end + 4]), native.Origin.OUTPUT)
        arena._owners[tenant.owner, native.kernels.O_RUNNING_KEYS] += 35 * 4  # as the step kernel counts them
        running.append(35 * 4)
        if len(running) > 8:
            arena.release_running(tenant.owner, running.pop(0))
        if request in (999, 9_999):
            sizes.append(arena.nbytes())
    assert len(tenant) == 2000 + 8 * 35 * 4  # the bound, and the running requests' keys
    assert sizes[1] == sizes[0]  # nothing grew between request 1,000 and 10,000
    with pytest.raises(RuntimeError, match="released more running keys"):
        arena.release_running(tenant.owner, 9 * 35 * 4)


def _reference_step(ref, texts, req_id, prior, history, num_tokens, prompt_len, next_anchor, ngram_len, room):
    """The Python proposer's filing and draft for one request (its code, on the reference
    pool and texts): file the completed n-grams (a tenant's pool holds their keys on top
    of its bound while the request runs), draft the deep match and chain the pool's
    candidates on after it (else from the text's end), the prior table where they miss."""
    max_key = ref.pool.max_key_len
    if ref.tag >= 0:
        ref.pool.running_keys += max(0, num_tokens - ngram_len - next_anchor) * max_key
    for anchor in range(next_anchor, num_tokens - ngram_len):
        end = anchor + 1
        origin = reference.Origin.PROMPT if anchor + ngram_len < prompt_len else reference.Origin.OUTPUT
        reference.file_in(ref, history[max(0, end - max_key) : end], tuple(history[end : end + ngram_len]), origin)
    draft, depth = texts.draft(req_id, np.array(history), num_tokens, room)
    origins = [native.ORIGIN_CODE[native.Origin.DEEP_MATCH]] * len(draft)
    context = (history[max(0, num_tokens - max_key) : num_tokens] + draft)[-max_key:]
    first_key = depth
    while len(draft) < room:
        token = context[-1]
        guess = tuple(prior[token][prior[token] >= 0].tolist())
        found = reference.match_in(ref, context, guess[0] if guess else None)
        if found is None and not guess:
            break
        candidate, origin, key_len = found if found is not None else (guess, reference.Origin.PRIOR, 0)
        if not draft:
            first_key = key_len
        piece = list(candidate[: room - len(draft)])
        draft += piece
        code = native.ORIGIN_CODE[native.Origin.SHARED if found is not None and origin is reference.Origin.SHARED
                                  else native.Origin(origin.value)]
        origins += [code] * len(piece)
        context = (context + piece)[-max_key:]
    return draft, origins, first_key


class _ReferenceTenants:
    """vllm_fafo.drafting.shared_pool.TenantPools over reference pools."""

    def __init__(self, setting: dict, max_keys: int, max_tenants: int) -> None:
        self.setting, self.max_keys, self.max_tenants = setting, max_keys, max_tenants
        self.pools: OrderedDict[str, reference.NgramPool] = OrderedDict()

    def pool_for(self, tenant: str) -> reference.NgramPool:
        if tenant not in self.pools:
            self.pools[tenant] = reference.NgramPool(**self.setting, max_keys=self.max_keys, key_eviction="fifo")
            self.trim()
        self.pools.move_to_end(tenant)
        return self.pools[tenant]

    def trim(self) -> None:
        while len(self.pools) > self.max_tenants:
            self.pools.popitem(last=False)


@pytest.mark.parametrize("answer_bytes", [0, 40_000, 1 << 20])
def test_the_step_kernel_files_and_drafts_as_the_python_proposer(answer_bytes):
    """:meth:`DraftIndex.draft_batch` (one kernel call) over a batch of requests of two
    tenants, coming and going, step after step, against the Python proposer's filing,
    deep matches and chaining on the reference pools and texts."""
    rng = np.random.default_rng(3)
    setting = SETTINGS["fafo"]
    prior = rng.integers(-1, 12, size=(12, 2)).astype(np.int32)
    prior[:, 0] = np.abs(prior[:, 0])
    prior[rng.random(12) < 0.3] = -1  # tokens the table has nothing for
    config = FafoConfig(max_key_len=setting["max_key_len"], pool_capacity=setting["capacity"],
                        tenant_answers_mib=int(answer_bytes > 0), prior_table="off")
    index = DraftIndex(config, prior=PriorTable(prior))
    index.shared.max_keys = 60  # each tenant's bound, as shared_pool_mib sets it: evictions happen
    index.texts.answer_bytes = answer_bytes  # 40,000: about three answers of a tenant
    shared_refs = _ReferenceTenants(setting, max_keys=60, max_tenants=config.shared_pool_tenants)
    ref_texts = reference_deep_match.TenantTexts(answer_bytes, config.shared_pool_tenants, config.max_key_len + 1)
    batch, length, room, ngram_len = 4, 160, 6, config.ngram_len
    # 12 token values, texts that repeat themselves: deep matches, votes and evictions all happen
    motifs = rng.integers(0, 12, size=(6, 30))
    live: list[dict] = []
    serial = 0
    seen = np.zeros(len(native.ORIGINS), dtype=np.int64)
    for step in range(120):
        while len(live) < batch:
            text = np.concatenate([motifs[rng.integers(0, 6)] if rng.random() < 0.7 else rng.integers(0, 12, 30)
                                   for _ in range(length // 30 + 1)])[:length].astype(np.int32)
            tenant = "ab"[serial % 2]
            req = dict(id=f"r{serial}", tenant=tenant, text=text, n=20, anchor=0, ref_anchor=0)
            req["pool"] = index.start(req["id"], tenant, text[:20])
            req["ref"] = reference.RequestPool(shared_refs.pool_for(tenant), req["pool"].tag)
            ref_texts.start(req["id"], tenant, text[:20])
            live.append(req)
            serial += 1
        for req in live:  # in step: requests finish in the order they started
            req["n"] = min(length - room, req["n"] + 3)
        want = []
        for req in live:
            want.append(_reference_step(req["ref"], ref_texts, req["id"], prior, req["text"].tolist(), req["n"], 20,
                                        req["ref_anchor"], ngram_len, room))
            req["ref_anchor"] = max(req["ref_anchor"], req["n"] - ngram_len)
        anchors = np.array([req["anchor"] for req in live], dtype=np.int64)
        found = index.draft_batch(np.arange(len(live)), np.stack([index.owners(req["id"], req["pool"]) for req in live]),
                                  np.full(len(live), 20), anchors, np.stack([req["text"] for req in live]),
                                  np.arange(len(live)), np.array([req["n"] for req in live]), room, length)
        for i, req in enumerate(live):
            draft, origins, first_key = want[i]
            assert found.tokens[i, : found.lengths[i]].tolist() == draft, (step, i)
            assert found.origins[i, : found.lengths[i]].tolist() == origins, (step, i)
            assert found.key_lens[i] == first_key, (step, i)
            req["anchor"] = int(anchors[i])
            assert req["anchor"] == req["ref_anchor"]
            seen += np.bincount(origins, minlength=len(seen))
        for req in [req for req in live if req["n"] >= length - room]:  # finished
            live.remove(req)
            index.stop(req["id"], req["pool"], 20, req["anchor"])
            req["ref"].pool.running_keys -= req["anchor"] * config.max_key_len
            ref_texts.stop(req["id"])
    drafted = {origin.value: int(seen[code]) for code, origin in enumerate(native.ORIGINS)}
    assert all(drafted[origin] > 0 for origin in ("prompt", "output", "shared", "deep_match", "prior")), drafted
    kept = index.texts.num_kept_answers()
    assert kept == ref_texts.num_kept_answers()
    assert kept == {0: 0, 40_000: 6 + len(live), 1 << 20: serial}[answer_bytes], (kept, len(live))
    for tenant in "ab":
        assert index.texts.charged_bytes(tenant) == ref_texts.charged_bytes(tenant)
        pool, ref = index.shared.pool_for(tenant), shared_refs.pool_for(tenant)
        assert pool.keys() == ref.keys()
        assert pool.arena._owners[pool.owner, native.kernels.O_RUNNING_KEYS] == ref.running_keys
    assert sum(ref.running_keys for ref in shared_refs.pools.values()) > 0  # requests still run


def index_for(prior=None, **settings) -> DraftIndex:
    """A draft index over pools alone (no deep matches, no sharing) unless ``settings`` say."""
    return DraftIndex(FafoConfig(**{"deep_match": False, "share_pool": False, "prior_table": "off", **settings}),
                      prior=prior)


def file_and_draft_one(index: DraftIndex, target, history, prompt_len: int, next_anchor: int = 0, room: int = 0,
                       req_id: str = "r") -> tuple[list[int], list[native.Origin], int]:
    """:meth:`DraftIndex.draft_batch` for one request whose text is ``history``: files from
    ``next_anchor`` on (``len(history)``: nothing) and drafts up to ``room`` tokens; returns the
    draft, its origins and the context length it matched."""
    history = np.asarray([history], dtype=np.int32)
    n = history.shape[1]
    found = index.draft_batch(np.array([0]), index.owners(req_id, target)[None], np.array([prompt_len]),
                              np.array([next_anchor]), history, np.array([0]), np.array([n]), room, n + room)
    length = int(found.lengths[0])
    return (found.tokens[0, :length].tolist(), [native.ORIGINS[c] for c in found.origins[0, :length].tolist()],
            int(found.key_lens[0]))


KERNELS_LOADED_AT_START = """
import numba
from vllm_fafo.control import draft_judge, kernels as controller_kernels
from vllm_fafo.drafting import pool_kernels, step_kernel, text_kernels
from vllm_fafo import request_table
from vllm_fafo.serving import metrics
from tests.test_proposer import FakeBatch, make_proposer

kernels = [f for m in (pool_kernels, text_kernels, step_kernel, controller_kernels, draft_judge, metrics,
                       request_table)
           for f in vars(m).values()
           if isinstance(f, numba.core.registry.CPUDispatcher)]
proposer = make_proposer(deep_match=True, share_pool=True, controller="goodput")  # the engine's start
before = {f.__name__: len(f.signatures) for f in kernels}
batch = FakeBatch()
batch.add("a", [1, 2, 3, 4, 5, 1, 2, 3, 4, 6] * 4)
batch.add("b", [7, 8, 9] * 5, cache_salt="t")
batch.add("c", list(range(100, 1600)))  # a long prompt: the arena and the texts grow (and the table is rebuilt)
for _ in range(6):
    batch.step(proposer, [[1, 2], [7], [1600]], num_scheduled_tokens=4)  # tokens: the controller prices steps
proposer.remove_requests(["a", "b", "c"])
after = {f.__name__: len(f.signatures) for f in kernels}
assert after == before, {name: (before[name], after[name]) for name in after if after[name] != before[name]}
"""


def test_the_engine_start_loads_every_kernel_a_step_runs():
    """No kernel meets a new argument type in a request's steps (numba would load or
    compile it there, 0.3 s and more): a fresh process, so no other test loaded one."""
    import subprocess
    import sys
    from pathlib import Path

    subprocess.run([sys.executable, "-c", KERNELS_LOADED_AT_START], check=True, cwd=Path(__file__).parent.parent)


def test_the_filings_touch_pass_reads_every_candidate_of_every_key_it_probes():
    """``_touch_filing`` (the reads ahead of a step's filing) walks each probed key's whole
    candidate list, not its newest candidate only: its checksum is the stamps of the lists'
    candidates (each read in its row), summed over the keys the filing probes (each key's
    table cell where hashed), written out in Python over the arena's arrays."""
    from vllm_fafo.drafting import pool_kernels as pk
    from vllm_fafo.drafting import step_kernel

    rng = np.random.default_rng(5)
    index = index_for(pool_capacity=8)
    target = index.start("r", None, np.zeros(0, dtype=np.int32))
    text = rng.integers(0, 6, size=200).astype(np.int32)  # 6 token values: long candidate lists
    file_and_draft_one(index, target, text, prompt_len=0)  # files the whole text
    st = index.kernel_arguments(4096)[0][0]
    table, keys, entries, stamps = st[pk.ST_TABLE], st[pk.ST_SLOTS], st[pk.ST_ENTRIES], st[pk.ST_STAMPS]
    owners = index.owners("r", target)[None]
    ngram_len, max_key, min_key = index.config.ngram_len, index.config.max_key_len, index.config.min_key_len
    start, n = 120, 150  # the filing of anchors 120..145 again: every key held
    want, lists = 0, []
    for anchor in range(start, n - ngram_len):
        for key_len in range(min_key, min(max_key, anchor + 1) + 1):
            cell = table[pk.hash_key(owners[0, 0], text, anchor + 1 - key_len, key_len) & (len(table) - 1)]
            e, walked = (keys[cell - 1, pk.S_HEAD] if cell > 0 else -1), 0
            while e >= 0:
                want += int(stamps[e])
                e, walked = entries[e, pk.E_NEXT], walked + 1
            lists.append(walked)
    assert max(lists) > 2  # long lists
    num_keys = (n - ngram_len - start) * (max_key - min_key + 1)
    got = step_kernel._touch_filing(st, text[None], np.array([0]), np.array([n]), np.array([0]), np.array([0]),
                                    np.array([start]), owners, ngram_len, True, max_key, num_keys)
    assert got == want


def test_the_engines_pools_hold_a_long_requests_keys_without_growing():
    """The draft index's arena starts with room for ``INITIAL_KEYS`` keys: a request of
    2,000 tokens (about 4,800 keys) is filed without growing it (each growth is a step
    whose kernel runs twice), where a bare arena of 256 keys grows."""
    from vllm_fafo.drafting import pool_kernels as pk
    from vllm_fafo.drafting.index import INITIAL_KEYS
    from vllm_fafo.drafting.pool import PoolArena

    index = index_for()
    target = index.start("r", None, np.zeros(0, dtype=np.int32))
    state = index.arena.state
    text = np.random.default_rng(2).integers(0, 1000, size=2000).astype(np.int32)
    file_and_draft_one(index, target, text, prompt_len=0)
    assert index.arena.num_live_keys > 4000
    assert index.arena.state is state and len(state[pk.ST_SLOTS]) == INITIAL_KEYS
    assert len(PoolArena(3, 16).state[pk.ST_SLOTS]) == 256
