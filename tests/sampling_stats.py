"""The sampled-distribution test: does an engine's sampled text follow plain vLLM's?

At each tested position the tokens of the two sets of samples are binned (every
token at least ``MIN_BIN_SHARE`` of the pooled samples its own bin, the rest one
bin) and compared by Pearson's chi-square test of homogeneity. The positions'
p-values are Bonferroni-combined, so a healthy engine fails with probability at
most :data:`FALSE_ALARM` (tests/test_sampling_stats.py checks that by simulation,
and what shifts the test catches at the suite's sample sizes).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
from scipy.stats import chi2, chi2_contingency, ncx2

FALSE_ALARM = 1e-3
"""Probability that a correct engine fails the test (all positions together)."""
MIN_BIN_SHARE = 0.02
OTHER = -1


def bins(reference: Sequence[int], other: Sequence[int]) -> list[int]:
    pooled = collections.Counter(reference) + collections.Counter(other)
    total = len(reference) + len(other)
    return sorted(t for t, n in pooled.items() if n >= MIN_BIN_SHARE * total)


def table(reference: Sequence[int], other: Sequence[int]) -> np.ndarray:
    """2 x bins counts (the last bin: every other token)."""
    kept = bins(reference, other)
    index = {t: i for i, t in enumerate(kept)}
    counts = np.zeros((2, len(kept) + 1), dtype=np.int64)
    for row, tokens in enumerate((reference, other)):
        for t in tokens:
            counts[row, index.get(t, len(kept))] += 1
    return counts[:, counts.sum(0) > 0]


def position_tokens(samples: Sequence[Sequence[int]], position: int) -> list[int]:
    return [s[position] if len(s) > position else OTHER for s in samples]


def p_values(reference: Sequence[Sequence[int]], got: Sequence[Sequence[int]], positions: Sequence[int]) -> list[float]:
    out = []
    for position in positions:
        counts = table(position_tokens(reference, position), position_tokens(got, position))
        out.append(1.0 if counts.shape[1] < 2 else float(chi2_contingency(counts, correction=False).pvalue))
    return out


def assert_same_distribution(reference: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                             positions: Sequence[int]) -> None:
    """Fails with probability :data:`FALSE_ALARM` when both follow one distribution."""
    values = p_values(reference, got, positions)
    assert min(values) * len(values) > FALSE_ALARM, (
        f"sampled tokens differ from plain vLLM's: p-values per position {values} "
        f"(Bonferroni over {len(values)} positions, false-alarm rate {FALSE_ALARM})")


def power(probs: Sequence[float], shifted: Sequence[float], n_reference: int, n_got: int, num_positions: int) -> float:
    """Probability that the test catches ``shifted`` where plain vLLM samples ``probs``
    (binned distributions at one position; noncentral chi-square approximation)."""
    p, q = np.asarray(probs, float), np.asarray(shifted, float)
    pooled = (n_reference * p + n_got * q) / (n_reference + n_got)
    keep = pooled > 0
    noncentrality = (n_reference * n_got / (n_reference + n_got)) * float(((p - q)[keep] ** 2 / pooled[keep]).sum())
    dof = int(keep.sum()) - 1
    critical = chi2.ppf(1 - FALSE_ALARM / num_positions, dof)
    return float(ncx2.sf(critical, dof, noncentrality))
