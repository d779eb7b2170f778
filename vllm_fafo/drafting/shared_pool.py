"""Pools shared across requests, one per tenant.

Traffic repeats itself across requests (system prompts, templates, code,
agent loops); a request's own pool cannot use that, vLLM's ``suffix`` method
keeps a tree over past responses for it. Every n-gram a request files into
its own pool (prompt, output, lanes) is also filed into its tenant's shared
pool, while it runs, so later and concurrent requests draft from it. The
request's own pool is looked up first under every key
(:func:`vllm_fafo.drafting.pool.match_pools`).

A tenant is vLLM's ``cache_salt`` (the same value that isolates prefix-cache
blocks): requests only see candidates of requests with the same salt;
requests without one share the unsalted pool. Memory is bounded in bytes per
tenant: each key is charged what it takes with ``capacity`` candidates (its
most; :meth:`PoolArena.bytes_per_key`), so a tenant's pool keeps at most
``max_bytes // bytes_per_key`` keys, its first filed key evicted past them (a
key filed or chosen again is not moved: keeping them in recency order, relinked
on every use, cost 5-13 % of a step at batch 8-128 and drafted no better,
docs/results/host-time.md); one tenant's traffic never evicts another's keys.
A new tenant past ``max_tenants`` drops the least recently used one whole (a dropped tenant's
running requests keep filing into its pool until they finish; new requests of
that tenant start afresh).
"""

from __future__ import annotations

from collections import OrderedDict

from vllm_fafo.drafting.pool import NgramPool, PoolArena


class TenantPools:
    """One bounded :class:`NgramPool` per tenant, least recently used tenant evicted.
    The pools live in ``arena`` (the requests' own pools' arena, so one kernel call
    drafts from both) and take its settings."""

    def __init__(self, arena: PoolArena, *, max_bytes: int, max_tenants: int) -> None:
        per_key = arena.bytes_per_key()
        if max_bytes < per_key or max_tenants < 1:
            raise ValueError(f"need max_bytes={max_bytes} >= {per_key} (one key) and max_tenants={max_tenants} >= 1")
        self.arena = arena
        self.max_keys = max_bytes // per_key
        """Keys each tenant's pool holds (its bytes' bound, each key charged at full capacity)."""
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
        """Keys held over all tenants (at most ``max_keys`` each)."""
        return sum(map(len, self._pools.values()))

    def num_entries(self) -> int:
        """Candidates held over all tenants and keys."""
        return sum(pool.num_entries() for pool in self._pools.values())

    def nbytes(self) -> int:
        """Bytes the tenants' keys are charged (each at full capacity; the bound's measure)."""
        return sum(pool.nbytes() for pool in self._pools.values())

    def clear(self) -> None:
        """Empty every tenant's pool in place (running requests hold them)."""
        for pool in self._pools.values():
            pool.clear()
