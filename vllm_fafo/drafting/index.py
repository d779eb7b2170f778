"""The draft index: every place a draft comes from, filed and drafted batch-wide.

One object per engine holds what drafts are made of: the tenants' pools (or,
sharing off, the requests' own; one :class:`~vllm_fafo.drafting.pool.PoolArena`),
the deep matches' texts (:class:`~vllm_fafo.drafting.deep_match.TenantTexts`),
Cacheback's frozen table and the prior table. Once per step
:meth:`DraftIndex.draft_batch` files the n-grams every decoding request
completed, feeds and matches the deep matches' texts and drafts for all of
them, in one numba call (:func:`~vllm_fafo.drafting.step_kernel.file_and_draft`);
the proposer and the pool replay (benchmarks/replay_pool.py) both draft through it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllm_fafo.config import FafoConfig
from vllm_fafo.drafting import pool_kernels, step_kernel, text_kernels
from vllm_fafo.drafting.deep_match import MATCH_DEPTH, TenantTexts
from vllm_fafo.drafting.pool import (
    ORIGIN_CODE,
    NgramPool,
    Origin,
    PoolArena,
    RequestPool,
    alternatives_in,
    file_each_in,
)
from vllm_fafo.drafting.prior_table import PriorTable
from vllm_fafo.drafting.shared_pool import TenantPools
from vllm_fafo.step_arrays import same_or_new

for _name in ("PROMPT", "OUTPUT", "SHARED", "DEEP_MATCH", "PRIOR"):  # the kernel's copies of the codes
    assert getattr(step_kernel, f"ORIGIN_{_name}") == ORIGIN_CODE[Origin[_name]], _name


_NO_KEPT_LENS = np.zeros(0, dtype=np.int64)
""":meth:`DraftIndex.draft_batch`'s ``kept_lens`` where every request drafts (the kernel reads
it only with a stride above 1)."""
INITIAL_KEYS = 8192
"""Keys the engine's pools have room for at first (about 0.9 MB): a request files about
three keys per token, so from the 256 of a bare arena the first requests' steps grew it
six times and more, each such step running its kernel twice (about 100 us at batch 1 on
the 2-core CPU: docs/results/host-time.md)."""


class BatchDrafts(NamedTuple):
    """One step's drafts, row ``i`` for the ``i``-th request asked for."""

    tokens: np.ndarray
    """int32 (requests, longest room): the drafts, ``lengths[i]`` tokens each."""
    origins: np.ndarray
    """Each token's :class:`~vllm_fafo.drafting.pool.Origin` code."""
    lengths: np.ndarray
    key_lens: np.ndarray
    """The length of the context each draft matched (its first piece's key, the deep
    match's depth, 0 for the prior table's): the goodput controller's evidence."""


def tenant_texts(config: FafoConfig) -> TenantTexts | None:
    """The texts deep matches are drafted from, one cache per tenant (None: the modes,
    which draft from their pools alone)."""
    if not config.deep_match:
        return None
    # deep matches no deeper than the pool's keys are the pool's: its candidates (lanes' n-grams
    # included) did as well there in replay (benchmarks/replay_pool.py)
    return TenantTexts(config.tenant_answers_mib << 20 if config.share_pool else 0, config.shared_pool_tenants,
                       config.max_key_len + 1)


def first_anchor(config: FafoConfig, prompt_len: int) -> int:
    """The first history position whose following n-gram a new request files: the
    prompt's start, or (prompt not seeded) the last n-gram that reaches the output."""
    return 0 if config.seed_from_prompt else max(0, prompt_len - config.ngram_len)


def candidate_room(config: FafoConfig) -> int:
    """Tokens the arena's candidates have room for at first: the text's n-grams, and the
    lanes' where lanes run (a longer candidate grows the room: :meth:`PoolArena.reserve`).
    Every column more widens every candidate's row, and a step's walks over candidate
    lists read whole rows (docs/results/host-time.md)."""
    return max(config.ngram_len, config.lane_len) if config.num_lanes > 0 else config.ngram_len


class DraftIndex:
    """Where every request's drafts come from (:mod:`vllm_fafo.drafting.index`).

    ``frozen``: Cacheback's table (a read-only pool, its own arena); ``prior``: the
    prior table; each drafted from where the pools miss, in that order."""

    def __init__(self, config: FafoConfig, *, frozen: NgramPool | None = None,
                 prior: PriorTable | None = None) -> None:
        self.config = config
        self.arena = PoolArena(config.max_key_len, config.pool_capacity, min_key_len=config.min_key_len,
                               touch_on_lookup=config.touch_on_lookup, rank=config.rank_candidates,
                               candidate_len=candidate_room(config), initial_keys=INITIAL_KEYS)
        self.shared = None if not config.share_pool else TenantPools(
            self.arena, max_bytes=config.shared_pool_mib << 20, max_tenants=config.shared_pool_tenants)
        self.texts = tenant_texts(config)
        self.frozen = frozen
        self._frozen_state = None if frozen is None else frozen.arena.state
        rows = np.zeros((0, 1), dtype=np.int32) if prior is None else prior.rows
        self._prior = np.ascontiguousarray(rows, dtype=np.int32)
        self._prior_lens = np.zeros(0, dtype=np.int32) if prior is None else prior.lengths.astype(np.int32)
        self._scratch = frozen.arena.scratch if frozen is not None and frozen.capacity > self.arena.capacity \
            else self.arena.scratch
        empty = np.zeros(0, dtype=np.int64)
        no_tokens = np.zeros(0, dtype=np.int32)
        self._no_texts = (np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64), no_tokens, empty, empty,
                          no_tokens, empty, empty, empty, empty, 1, False)
        """The kernel's deep-match arguments where there are none (the modes)."""
        self._outputs = self._new_outputs(8, max(1, config.num_speculative_tokens))
        self._views: dict[int, BatchDrafts] = {}
        """:meth:`drafts`' views of the outputs, by request count (emptied where the outputs grow)."""
        self._frozen_owner = -1 if frozen is None else frozen.owner
        self._arguments: tuple | None = None

    def start(self, req_id: str, tenant: str | None, prompt: np.ndarray) -> RequestPool:
        """A new request's pool: its tenant's, under a new tag, where requests share, else
        its own; its prompt is the first text deep matches look in."""
        arena = self.arena
        if self.shared is not None:
            target = RequestPool(self.shared.pool_for(tenant), arena.new_tag())
        else:
            target = RequestPool(NgramPool(arena.max_key_len, arena.capacity, min_key_len=arena.min_key_len,
                                           max_keys=self.config.max_keys, touch_on_lookup=arena.touch_on_lookup,
                                           rank=arena.rank, arena=arena), -1)
        if self.texts is not None:
            self.texts.start(req_id, tenant, prompt)
        return target

    def owners(self, req_id: str, target: RequestPool) -> np.ndarray:
        """A running request's ids in the index, as :meth:`draft_batch` takes them: its
        pool's owner and its tag there, its text (-1: none)."""
        ids = np.full(3, -1, dtype=np.int64)
        ids[:2] = target.pool.owner, target.tag
        if self.texts is not None:
            ids[2] = self.texts.text_of(req_id)
        return ids

    def nbytes(self) -> int:
        """Bytes of what the index grows as it serves (allocated, used or not): the pools'
        arena and the deep matches' texts and places. The frozen and prior tables, read
        once at start, are left out."""
        return self.arena.nbytes() + (0 if self.texts is None else self.texts.nbytes())

    def stop(self, req_id: str, target: RequestPool | None, prompt_len: int = 0, next_anchor: int = 0) -> None:
        """A request finished, its prompt ``prompt_len`` tokens, having filed ``target`` (None:
        it never decoded) up to ``next_anchor``: its keys in its tenant's pool are bounded
        with the tenant's from now on (:func:`~vllm_fafo.drafting.step_kernel.anchor_keys`),
        its answer stays for deep matches of later requests."""
        if target is not None and target.tag >= 0:
            filed = next_anchor - first_anchor(self.config, prompt_len)
            self.arena.release_running(target.pool.owner, step_kernel.anchor_keys(self.arena.state, filed))
        if self.texts is not None:
            self.texts.stop(req_id)

    def draft_batch(self, slots: np.ndarray, owners: np.ndarray, prompt_lens: np.ndarray, next_anchors: np.ndarray,
                    history: np.ndarray, rows: np.ndarray, num_tokens: np.ndarray, max_draft: int,
                    max_len: int, kept_lens: np.ndarray | None = None, draft_stride: int = 1,
                    draft_phase: int = 0) -> BatchDrafts:
        """File what each request's text ``history[rows[i], :num_tokens[i]]`` completed
        into its pool and draft up to ``min(max_draft, max_len - num_tokens[i])`` tokens:
        the deep match of its text's end, chained on from its pool, else its pool's
        chain, where it misses the frozen table, then the prior table. Request i's numbers
        are entry ``slots[i]`` of ``owners`` (its ids, :meth:`owners`), ``prompt_lens`` and
        ``next_anchors`` (the first position whose n-gram it has not filed, advanced in
        place): tables by slot, as the proposer's :class:`~vllm_fafo.request_table.RequestTable`
        keeps them (int64). With ``draft_stride`` above 1 only the requests whose
        ``kept_lens`` entry (by slot) is not 0 and every ``draft_stride``-th from
        ``draft_phase`` draft; the others file only. One kernel call
        (:func:`~vllm_fafo.drafting.step_kernel.file_and_draft`), which first checks that
        everything it may add fits (the arrays grow here, outside it, where not). The
        drafts are views of buffers the next call reuses."""
        if kept_lens is None:
            if draft_stride > 1:
                raise ValueError(f"draft_batch: a draft_stride of {draft_stride} needs kept_lens (by slot)")
            kept_lens = _NO_KEPT_LENS  # read only where the stride is above 1
        for _ in range(4):  # each shortage is made good once
            index, outputs = self.kernel_arguments(max_len)
            tokens, origins, lengths, key_lens, context = outputs
            st, frozen, frozen_owner, prior, prior_lens, texts, max_len, ngram_len, seeded, scratch = index
            status, num_keys = step_kernel.file_and_draft(
                st, frozen, frozen_owner, prior, prior_lens, texts, history, rows, num_tokens, slots, prompt_lens,
                next_anchors, owners, max_draft, max_len, ngram_len, seeded, tokens, origins, lengths, key_lens,
                scratch, context, kept_lens, draft_stride, draft_phase)
            if status == step_kernel.ROOM_OK:
                break
            self.make_room(status, num_keys, owners[slots], num_tokens, max_draft, max_len)
        else:
            raise RuntimeError(f"DraftIndex.draft_batch: the step's kernel still lacks room ({status}) after growing")
        return self.drafts(len(rows))

    def drafts(self, count: int) -> BatchDrafts:
        """The drafts the last kernel call made for its ``count`` requests (views of buffers
        the next call reuses; the same views while the buffers are)."""
        views = self._views.get(count)
        if views is None:
            tokens, origins, lengths, key_lens, _ = self._outputs
            views = self._views[count] = BatchDrafts(tokens[:count], origins[:count], lengths[:count],
                                                     key_lens[:count])
        return views

    def kernel_arguments(self, max_len: int) -> tuple[tuple, tuple]:
        """:func:`~vllm_fafo.drafting.step_kernel.file_and_draft`'s arguments but the batch's
        and the drafts' room, as two tuples (the index's, the outputs'), as
        :func:`~vllm_fafo.propose_kernel.propose_step` takes them (:meth:`make_room` where it
        lacks room); the same tuples while nothing grew."""
        texts = self._no_texts if self.texts is None else self.texts.kernel_arguments()
        self._arguments = same_or_new(self._arguments, (
            self.arena.state, self._frozen_state, self._frozen_owner, self._prior, self._prior_lens, texts, max_len,
            self.config.ngram_len, self.config.seed_from_output, self._scratch))
        return self._arguments, self._outputs

    def make_room(self, status: int, num_keys: int, owners: np.ndarray, num_tokens: np.ndarray, max_draft: int,
                  max_len: int) -> None:
        """Grow what the step's kernel found short (``status``, :data:`step_kernel.ROOM_OK`
        and after; ``num_keys``: the keys the step files), for the requests of these ids
        (one row each) and text lengths."""
        if status == step_kernel.ROOM_OUTPUTS:
            rooms = np.minimum(max_draft, max_len - num_tokens)
            self._outputs = self._new_outputs(max(len(num_tokens), 2 * len(self._outputs[2])),
                                              max(int(rooms.max(initial=0)), self._outputs[0].shape[1]))
            self._views.clear()
        elif status == step_kernel.ROOM_POOLS:
            self.arena.reserve(int(num_keys), self.config.ngram_len)
        elif status == step_kernel.ROOM_TEXTS:
            self.texts.make_room(owners[:, 2].copy(), num_tokens)
        else:
            raise ValueError(f"unknown room status {status}")

    def _new_outputs(self, count: int, width: int) -> tuple[np.ndarray, ...]:
        """The kernel's outputs for ``count`` requests of drafts up to ``width`` tokens, and its context."""
        return (np.zeros((count, width), dtype=np.int32), np.zeros((count, width), dtype=np.int32),
                np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.int64),
                np.zeros(MATCH_DEPTH + 2 * self.config.max_key_len + 2 * width, dtype=np.int32))

    def forget_shared(self) -> None:
        """Empty every tenant's pool (running requests' candidates too) and the answers
        kept for deep matches."""
        if self.shared is not None:
            self.shared.clear()
        if self.texts is not None:
            self.texts.clear()


def load_kernels(config: FafoConfig) -> None:
    """Run the draft index's kernels once, on a throwaway index with ``config``'s settings,
    so that numba loads them (on a new machine: compiles them, into its cache) while the
    engine starts, not in its first request's step: loading took about 0.3 s and 66 MiB
    of resident memory on the 2-core CPU machine (docs/results/host-time.md)."""
    index = DraftIndex(config)
    history = (np.arange(64) % 7).astype(np.int32)[None, :]  # int32 rows, as vLLM's token_ids_cpu
    target = index.start("warm-up", None, history[0, :32])
    one = np.zeros(1, dtype=np.int64)
    anchors = np.array([first_anchor(config, 32)], dtype=np.int64)
    index.draft_batch(one, index.owners("warm-up", target)[None], np.array([32]), anchors, history, one,
                      np.array([40]), 4, 64)
    pool_kernels.rehash(index.arena.state)  # what growing the arena runs, in a step where it grows
    file_each_in([target], [([1, 2], (3, 4))], Origin.LANE)
    list(alternatives_in(target, [1, 2]))
    index.stop("warm-up", target, 32, int(anchors[0]))
    texts = index.texts
    if texts is not None:  # what growing the chains' table runs
        text_kernels.rehash(texts.heads, np.zeros_like(texts.heads), texts.store, texts.starts, texts.answers_of,
                            texts.key_len)
