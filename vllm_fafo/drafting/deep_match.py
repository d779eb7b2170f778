"""Deep matches of a request's current suffix in its own text and its tenant's answers.

The pool files candidates under keys of at most ``max_key_len`` (3) tokens,
so a lookup cannot tell a continuation that followed the same 3 tokens by
chance from one that followed the same 20: both are "found under a 3-token
key", and the goodput controller cuts both drafts alike. Deep matches look
up to ``MATCH_DEPTH`` (24) tokens back, as vLLM's ``suffix`` method does:
every ``key_len``-token key of a text is chained through the places it
ended, in the request's own text and in the answers (outputs) its tenant's
requests gave, running and finished (hash chains, one table of heads); a
lookup compares the tokens before the latest ``MAX_POSITIONS`` places of the
text's last ``key_len`` tokens, in each, with the text's end, up to
``MATCH_DEPTH`` back, and drafts the continuation
of the deepest match (the request's own text on ties, then the latest), with
the depth as the goodput controller's evidence.

Native: the texts and the places are numpy arrays worked by numba kernels
(:mod:`vllm_fafo.drafting.text_kernels`), fed and matched inside the step's
one call (:func:`vllm_fafo.drafting.step_kernel.file_and_draft`);
:class:`TenantTexts` keeps the bookkeeping (tenants, which answers are kept).
Work per draft is bounded by ``2 x MAX_POSITIONS x MATCH_DEPTH`` compares,
flat in the text's length; indexing is per decoded token. On MT-Bench,
HumanEval and GSM8K (benchmarks/replay_pool.py, 2026-12-02) deep matches add
0.3 %, 1.5 % and 1.3 % to the pool's tau; Arctic Inference's suffix trees in
their place lost 11-17 % and were removed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from vllm_fafo.drafting import step_kernel, text_kernels
from vllm_fafo.step_arrays import same_or_new

MATCH_DEPTH = 24
"""Deepest match looked for (as vLLM ``suffix``'s ``suffix_decoding_max_tree_depth``)."""
assert step_kernel.MATCH_DEPTH == MATCH_DEPTH
MAX_POSITIONS = 4
"""Latest places per key compared, in the own text and in the answers. Eight (the pool's
``pool_capacity``) drafted no better on MT-Bench, HumanEval and GSM8K (tau within 0.1 %,
uncut and cut) and cost 7-17 % more host time per step at batch 8-128
(docs/results/host-time.md)."""
assert text_kernels.MAX_POSITIONS == MAX_POSITIONS
MIN_HEADS = 1 << 12
"""Cells of the chains' table at first (it grows where it would be more than half full)."""
MIN_STORE = 1 << 14
"""Tokens of the texts' store at first (it grows where the live texts fill half)."""
MAX_TEXT_TOKENS = 1 << text_kernels.LINK_BITS
"""Tokens a text may have, and text ids (an answers' chain's link packs both)."""
TOKEN_BYTES = 16
"""A text's token in the store (int32), its own chain's ``prev`` (int32) and its answers'
chain's link (int64)."""
PLACE_BYTES = 64
"""An answer token's cell in the chains' table, at the table's emptiest (an eighth full:
it grows fourfold where it would be more than half full); an upper bound, keys repeat."""


@dataclass
class _Tenant:
    answers: int
    """The owner id its answers' chains are keyed by (never reused)."""
    kept: dict[str, int] = field(default_factory=dict)
    """Request id -> text id of each answer kept (running requests' included)."""
    finished: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Request id -> bytes charged, of each finished answer kept, the earliest finished first."""
    charged: int = 0
    """Bytes of its finished answers kept."""


@dataclass
class _Running:
    tenant: str | None
    text: int


class TenantTexts:
    """The texts deep matches draft from, one set of answers per tenant (vLLM's
    ``cache_salt``); requests start, grow, draft and stop here.

    The finished answers kept for later requests are bounded per tenant in bytes
    (``answer_bytes``, the earliest finished evicted first; 0: a request matches in
    its own text only): a finished answer is charged its text's tokens and a chain
    cell per answer token (:meth:`answer_charge`); running requests' answers are kept
    uncharged until they stop. A forgotten answer's places end the lookups that reach
    them (:mod:`~vllm_fafo.drafting.text_kernels`). At most ``max_tenants`` tenants
    (the least recently used one without running requests is dropped). ``key_len``:
    the shortest match drafted."""

    def __init__(self, answer_bytes: int, max_tenants: int, key_len: int) -> None:
        self.key_len = key_len
        self.answer_bytes = answer_bytes
        self.max_tenants = max_tenants
        self.store = np.zeros(MIN_STORE, dtype=np.int32)
        self.prev = np.full(len(self.store), -1, dtype=np.int32)
        """Beside each token of a running request's own text that ends a key: where the
        key ended before in that text (-1: nowhere), the own texts' chains."""
        self.links = np.full(len(self.store), -1, dtype=np.int64)
        """Beside each token of a kept answer that ends a key: the place (generation, text id,
        end) the key ended before in its tenant's answers (-1: none), the answers' chains."""
        self.heads = np.zeros(MIN_HEADS, dtype=np.int64)
        """The chains' heads: open addressing on (text id or answers owner, key), a cell
        holding a text id and the key's latest end there (:mod:`~vllm_fafo.drafting.text_kernels`)."""
        self.heads_used = np.zeros(1, dtype=np.int64)
        """Cells of :attr:`heads` filled."""
        self._store_end = 0
        self.starts = np.zeros(64, dtype=np.int64)
        self.lengths = np.zeros(64, dtype=np.int64)
        self.capacities = np.zeros(64, dtype=np.int64)
        """Tokens each text's segment of the store holds (0: a free text id)."""
        self._answer_starts = np.zeros(64, dtype=np.int64)
        self.answers_of = np.full(64, -1, dtype=np.int64)
        """Each text's answers owner where it is an answer kept for its tenant (a running request
        files its new places there too), else -1."""
        self.gens = np.zeros(64, dtype=np.int64)
        """Times each text id was freed (a link into a text freed since is not followed)."""
        self._next_owner = 0
        self._free_texts = list(range(63, -1, -1))
        self._tenants: OrderedDict[str | None, _Tenant] = OrderedDict()
        self._running: dict[str, _Running] = {}
        self._arguments: tuple | None = None

    # texts ----------------------------------------------------------------------------
    def _new_text(self, tokens: np.ndarray) -> int:
        if not self._free_texts:
            size = len(self.starts)
            if 2 * size > MAX_TEXT_TOKENS:
                raise RuntimeError(f"vllm-fafo: more than {MAX_TEXT_TOKENS} texts kept for deep matches")
            for name in ("starts", "lengths", "capacities", "_answer_starts", "gens"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(size, dtype=np.int64)]))
            self.answers_of = np.concatenate([self.answers_of, np.full(size, -1, dtype=np.int64)])
            self._free_texts = list(range(2 * size - 1, size - 1, -1))
        text = self._free_texts.pop()
        self.capacities[text] = 0
        self._place(text, max(64, 2 * len(tokens)))
        self.store[self.starts[text] : self.starts[text] + len(tokens)] = tokens
        self.lengths[text] = self._answer_starts[text] = len(tokens)
        return text

    def _place(self, text: int, capacity: int) -> None:
        """Give ``text`` a segment of ``capacity`` tokens (its tokens moved along)."""
        if self._store_end + capacity > len(self.store):
            self._compact(capacity)
        start, length = self._store_end, int(self.lengths[text]) if self.capacities[text] else 0
        old = int(self.starts[text])
        self.store[start : start + length] = self.store[old : old + length]
        self.prev[start : start + length] = self.prev[old : old + length]
        self.links[start : start + length] = self.links[old : old + length]
        self.starts[text], self.capacities[text] = start, capacity
        self._store_end += capacity

    def _compact(self, room: int) -> None:
        """Move the live texts together (into a larger store where they and ``room`` do not fit in half)."""
        live = np.flatnonzero(self.capacities > 0).tolist()
        needed = sum(int(self.capacities[text]) for text in live) + room
        store = np.zeros(max(len(self.store), 2 * needed), dtype=np.int32)
        prev = np.full(len(store), -1, dtype=np.int32)
        links = np.full(len(store), -1, dtype=np.int64)
        end = 0
        for text in live:
            start, length = int(self.starts[text]), int(self.lengths[text])
            store[end : end + length] = self.store[start : start + length]
            prev[end : end + length] = self.prev[start : start + length]
            links[end : end + length] = self.links[start : start + length]
            self.starts[text] = end
            end += int(self.capacities[text])
        self.store, self.prev, self.links, self._store_end = store, prev, links, end

    def _free_text(self, text: int) -> None:
        self.capacities[text] = self.lengths[text] = 0
        self.answers_of[text] = -1
        self.gens[text] += 1
        self._free_texts.append(text)

    def kernel_arguments(self) -> tuple:
        """The texts as :func:`~vllm_fafo.drafting.step_kernel.file_and_draft` takes them
        (the chains' heads, cells used, ``prev``, ``links`` and generations, store, starts,
        lengths, capacities, answers owner by text, key length, on); the same tuple while
        nothing grew."""
        self._arguments = same_or_new(self._arguments, (
            self.heads, self.heads_used, self.prev, self.links, self.gens, self.store, self.starts, self.lengths,
            self.capacities, self.answers_of, self.key_len, True))
        return self._arguments

    # requests -------------------------------------------------------------------------
    def start(self, req_id: str, tenant: str | None, prompt: np.ndarray) -> int:
        """A new request: its prompt is the first text it matches in; its answer is
        kept for its tenant's other requests, running and later. Returns its
        text id, as the step's kernel takes it (:meth:`text_of`)."""
        cache = self._tenants.get(tenant)
        if cache is None:
            cache = self._tenants[tenant] = _Tenant(self._next_owner)
            self._next_owner += 1
        self._tenants.move_to_end(tenant)
        if req_id in cache.kept:  # a request id used again: its old answer must not draft for it
            self._evict(tenant, req_id)
        prompt = np.ascontiguousarray(prompt, dtype=np.int32)
        text = self._new_text(prompt)
        self._make_heads_room(len(prompt))
        text_kernels.index_own(self.heads, self.heads_used, self.prev, self.store, self.starts, self.answers_of, 0,
                               len(prompt), self.key_len, text)
        cache.kept[req_id] = text
        self._running[req_id] = _Running(tenant, text)
        if self.answer_bytes:
            self.answers_of[text] = cache.answers
        self._drop_idle_tenants()
        return text

    def text_of(self, req_id: str) -> int:
        """A running request's text id."""
        return self._running[req_id].text

    def make_room(self, texts: np.ndarray, num_tokens: np.ndarray) -> None:
        """Grow the texts ``texts`` that ``num_tokens`` would overflow, with them those
        within a quarter of their room, and the chains' table for the keys they add (where
        the step's kernel found no room). The batch's
        texts fill up each at its own step, a few tokens a step: grown one at a time, a
        batch of 32 found a text short, and ran the kernel twice, in one step in six (at
        128: one in two)."""
        if len(num_tokens) and int(num_tokens.max()) > MAX_TEXT_TOKENS:
            raise RuntimeError(f"vllm-fafo: deep matches take texts of at most {MAX_TEXT_TOKENS} tokens")
        capacities = self.capacities[texts]
        for i in np.flatnonzero(4 * num_tokens > 3 * capacities).tolist():
            self._place(int(texts[i]), min(MAX_TEXT_TOKENS, 2 * max(int(num_tokens[i]), int(capacities[i]))))
        new_places = int(np.maximum(num_tokens - self.lengths[texts], 0).sum())
        self._make_heads_room(2 * new_places)  # a cell in the own chains and one in the answers

    def _make_heads_room(self, cells: int) -> None:
        """Room for ``cells`` more cells in the chains' table, kept at most half full: where it
        lacks it, a table of at least four times the cells it will hold, the cells moved in."""
        needed = int(self.heads_used[0]) + cells
        if needed <= len(self.heads) // 2:
            return
        old, self.heads = self.heads, np.zeros(1 << (4 * needed - 1).bit_length(), dtype=np.int64)
        text_kernels.rehash(old, self.heads, self.store, self.starts, self.answers_of, self.key_len)

    def draft(self, req_id: str, history: np.ndarray, num_tokens: int, room: int) -> tuple[list[int], int]:
        """Feed the tokens decoded since the last call, then draft up to ``room`` tokens
        after ``history[:num_tokens]``; returns the draft and its match length (one
        request; the step drafts every request inside its kernel)."""
        text = self.text_of(req_id)
        self.make_room(np.array([text]), np.array([num_tokens]))
        self.feed(text, np.ascontiguousarray(history, dtype=np.int32), num_tokens)
        if room <= 0:
            return [], 0
        context = np.ascontiguousarray(history[max(0, num_tokens - MATCH_DEPTH) : num_tokens], dtype=np.int32)
        found, end, depth = text_kernels.deep_match(
            self.heads, self.prev, self.links, self.gens, self.store, self.starts, self.answers_of, context,
            len(context), self.key_len, text)
        if depth == 0:
            return [], 0
        start = int(self.starts[found]) + end + 1
        stop = int(self.starts[found] + self.lengths[found])
        return self.store[start : min(stop, start + room)].tolist(), depth

    def feed(self, text: int, history: np.ndarray, num_tokens: int) -> None:
        """Append ``history[fed:num_tokens]`` to the text and file its new keys (room ensured)."""
        fed = int(self.lengths[text])
        if num_tokens <= fed:
            return
        start = int(self.starts[text])
        self.store[start + fed : start + num_tokens] = history[fed:num_tokens]
        text_kernels.feed_text(self.heads, self.heads_used, self.prev, self.links, self.gens, self.store, self.starts,
                               self.answers_of, fed, num_tokens, self.key_len, text)
        self.lengths[text] = num_tokens

    def stop(self, req_id: str) -> None:
        """A request finished: its answer stays for later requests of its tenant, charged
        to the tenant's bytes (the earliest finished answers go while they exceed the bound)."""
        running = self._running.pop(req_id, None)
        if running is None:
            return
        cache = self._tenants[running.tenant]
        text = running.text
        text_kernels.forget_own(self.heads, self.heads_used, self.store, self.starts, self.answers_of,
                                self.lengths[text], self.key_len, text)
        if self.answers_of[text] < 0:  # its answer is not kept for later requests
            if cache.kept.get(req_id) == text:
                self._evict(running.tenant, req_id)
            else:
                self._free_text(text)
        else:
            charge = self.answer_charge(int(self.lengths[text]), int(self.lengths[text] - self._answer_starts[text]))
            cache.finished[req_id] = charge
            cache.charged += charge
            while cache.charged > self.answer_bytes:
                self._evict(running.tenant, next(iter(cache.finished)))
        self._drop_idle_tenants()

    @staticmethod
    def answer_charge(text_len: int, answer_len: int) -> int:
        """Bytes a finished answer is charged: its text's tokens (the prompt's too, which its
        matches read back) and a chain cell per answer token."""
        return TOKEN_BYTES * text_len + PLACE_BYTES * answer_len

    def clear(self) -> None:
        """Forget every finished answer (running requests keep their own text)."""
        for tenant, cache in list(self._tenants.items()):
            for req_id in list(cache.finished):
                self._evict(tenant, req_id)

    def nbytes(self) -> int:
        """Bytes of the texts' and chains' arrays (allocated, used or not)."""
        arrays = (self.store, self.prev, self.links, self.heads, self.starts, self.lengths, self.capacities,
                  self._answer_starts, self.answers_of, self.gens)
        return int(sum(a.nbytes for a in arrays))

    @property
    def num_tenants(self) -> int:
        return len(self._tenants)

    def num_kept_answers(self) -> int:
        """Answers kept, running requests' included."""
        running = sum(int(self.answers_of[running.text] >= 0) for running in self._running.values())
        return running + sum(len(cache.finished) for cache in self._tenants.values())

    def charged_bytes(self, tenant: str | None) -> int:
        """Bytes charged for a tenant's finished answers kept (0 for an unknown tenant)."""
        cache = self._tenants.get(tenant)
        return 0 if cache is None else cache.charged

    def _evict(self, tenant: str | None, req_id: str) -> None:
        """Forget an answer (its chains' cells); its text goes unless its request still runs."""
        cache = self._tenants[tenant]
        text = cache.kept.pop(req_id)
        cache.charged -= cache.finished.pop(req_id, 0)
        self._forget_answer(text)
        running = self._running.get(req_id)
        if running is not None and running.text == text:
            self.answers_of[text] = -1  # no longer kept: freed when the request stops
        else:
            self._free_text(text)

    def _drop_idle_tenants(self) -> None:
        """Drop the least recently used tenants without running requests while there
        are more than ``max_tenants`` (tenants that all have running requests may
        exceed it: a running request's texts are never dropped)."""
        excess = len(self._tenants) - self.max_tenants
        if excess <= 0:
            return
        busy = {running.tenant for running in self._running.values()}
        for tenant in list(self._tenants):
            if excess <= 0:
                break
            if tenant not in busy:
                cache = self._tenants.pop(tenant)
                for text in cache.kept.values():
                    self._forget_answer(text)
                    self._free_text(text)
                excess -= 1

    def _forget_answer(self, text: int) -> None:
        """Delete the answers' cells that point into ``text``, if its answer is kept."""
        if self.answers_of[text] >= 0:
            text_kernels.forget_answer(self.heads, self.heads_used, self.store, self.starts, self.answers_of,
                                       self._answer_starts[text], self.lengths[text], self.key_len, text)
