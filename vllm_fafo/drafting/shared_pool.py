"""One pool per tenant, shared by its requests.

Traffic repeats itself across requests (system prompts, templates, code,
agent loops); a pool per request cannot use that, vLLM's ``suffix`` method
keeps a tree over past responses for it. Where pools are shared, a request
files every n-gram (prompt, output, lanes) into its tenant's pool only, each
candidate tagged with the request that last filed it (tags are never reused:
:meth:`PoolArena.new_tag`), and drafts from it: its own candidates cast
``OWN_VOTES`` each where a key's candidates disagree, others' one, and it wins
ties (:func:`vllm_fafo.drafting.pool.match_in`). One filing and one lookup
per key where a pool per request and a shared one took two of each: 0.58x to
0.76x the proposer's host time per step at batch 8 to 128, replayed tau within
1 % (docs/results/host-time.md).

A tenant is vLLM's ``cache_salt`` (the same value that isolates prefix-cache
blocks): requests only see candidates of requests with the same salt;
requests without one share the unsalted pool. Memory is bounded in bytes per
tenant: each key is charged what it takes with ``capacity`` candidates (its
most; :meth:`PoolArena.bytes_per_key`), so a tenant's pool keeps
``max_bytes // bytes_per_key`` keys, and on top of them the keys its running
requests filed (each anchor counted at every key length, taken off when the
request stops: a long prompt never evicts its own start while it runs); past
that its first filed keys are evicted (a key filed or chosen again is not
moved: keeping them in recency order, relinked on every use, cost 5-13 % of a
step at batch 8-128 and drafted no better, docs/results/host-time.md); one
tenant's traffic never evicts another's keys. A new tenant past
``max_tenants`` drops the least recently used one whole (a dropped tenant's
running requests keep filing into its pool until they finish; new requests of
that tenant start afresh).
"""

from __future__ import annotations

from collections import OrderedDict

from vllm_fafo.drafting.pool import NgramPool, PoolArena


class TenantPools:
    """One bounded :class:`NgramPool` per tenant, least recently used tenant evicted.
    The pools live in ``arena`` (the draft index's) and take its settings."""

    def __init__(self, arena: PoolArena, *, max_bytes: int, max_tenants: int) -> None:
        per_key = arena.bytes_per_key()
        if max_bytes < per_key or max_tenants < 1:
            raise ValueError(f"need max_bytes={max_bytes} >= {per_key} (one key) and max_tenants={max_tenants} >= 1")
        self.arena = arena
        self.max_keys = max_bytes // per_key
        """Keys each tenant's pool holds besides its running requests' (its bytes' bound, each
        key charged at full capacity)."""
        self.max_tenants = max_tenants
        self._pools: OrderedDict[str | None, NgramPool] = OrderedDict()

    def pool_for(self, tenant: str | None) -> NgramPool:
        """The tenant's pool (made on first use), refreshed as most recently used."""
        pool = self._pools.get(tenant)
        if pool is None:
            arena = self.arena
            pool = self._pools[tenant] = NgramPool(
                arena.max_key_len, arena.capacity, min_key_len=arena.min_key_len, max_keys=self.max_keys,
                key_eviction="fifo", touch_on_lookup=arena.touch_on_lookup, rank=arena.rank, arena=arena)
            if len(self._pools) > self.max_tenants:  # one tenant more than the bound: the least recent goes
                self._pools.popitem(last=False)
        else:
            self._pools.move_to_end(tenant)
        return pool

    @property
    def num_tenants(self) -> int:
        return len(self._pools)

    def num_keys(self) -> int:
        """Keys held over all tenants (``max_keys`` each and their running requests')."""
        return sum(map(len, self._pools.values()))

    def num_entries(self) -> int:
        """Candidates held over all tenants and keys."""
        return sum(pool.num_entries() for pool in self._pools.values())

    def nbytes(self) -> int:
        """Bytes the tenants' keys are charged (each at full capacity; the bound's measure)."""
        return sum(pool.nbytes() for pool in self._pools.values())

    def clear(self) -> None:
        """Empty every tenant's pool in place (running requests hold them, and lose their
        own candidates too)."""
        for pool in self._pools.values():
            pool.clear()
