"""The CPU rejection sampler's recovered tokens keep their distribution with the
plugin's noise (``vllm_fafo.patches.rejection_sampler``): drawn only for requests
with drafts, seeded requests exactly as vLLM draws them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from vllm.platforms import current_platform

from vllm_fafo.patches.rejection_sampler import exponential_noise

VOCAB = 8


def test_noise_only_in_rows_with_drafts():
    torch.manual_seed(0)
    q = exponential_noise([2, 0, 1, 0], {}, 1000, torch.float32, torch.device("cpu"))
    assert q.shape == (4, 1000)
    assert torch.equal(q[1], torch.ones(1000)) and torch.equal(q[3], torch.ones(1000))
    for row in (q[0], q[2]):
        assert bool((row > 0).all())
        assert abs(row.mean().item() - 1.0) < 0.1  # Exp(1): mean 1, sd 1/sqrt(1000)
        assert abs(row.var().item() - 1.0) < 0.3


def test_seeded_rows_draw_what_vllm_draws():
    seeded = torch.Generator().manual_seed(1234)
    q = exponential_noise([1, 3], {1: seeded}, 500, torch.float32, torch.device("cpu"))
    expected = torch.empty(500).exponential_(generator=torch.Generator().manual_seed(1234))
    assert torch.equal(q[1], expected)


def test_seeded_row_without_drafts_draws_nothing():
    seeded = torch.Generator().manual_seed(7)
    state = seeded.get_state()
    q = exponential_noise([1, 0], {1: seeded}, 100, torch.float32, torch.device("cpu"))
    assert torch.equal(seeded.get_state(), state)
    assert torch.equal(q[1], torch.ones(100))


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the patch replaces vLLM's function on CPU only")
def test_recovered_tokens_follow_the_residual_distribution(monkeypatch):
    """One-hot drafts (``draft_probs`` None): a rejected draft's recovered token is
    sampled from the target distribution without the draft token, renormalised.

    vLLM's CPU kernel is called directly, as its dispatcher does once a CPU worker
    registered the kernel overrides (which this process does not do: its engines'
    workers do that themselves)."""
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    import vllm_fafo.patches as patches

    def cpu_kernel(output, cu, draft_ids, draft_probs, target_probs, inv_q, *, max_spec_len):
        cpu_triton_utils._sample_recovered_tokens_kernel_impl(
            output, cu, draft_ids, draft_probs, target_probs, inv_q, target_probs.shape[1],
            NO_DRAFT_PROBS=draft_probs is None)

    patches.apply_all()
    monkeypatch.setattr(rejection_sampler, "_sample_recovered_tokens", cpu_kernel)
    sample = rejection_sampler.sample_recovered_tokens
    assert getattr(sample, "vllm_fafo_patch", None) == "vllm_fafo.patches.rejection_sampler"

    rng = np.random.default_rng(0)
    # Three requests: 2 drafts, none, 1 draft; each draft position its own target distribution.
    target = torch.tensor(rng.dirichlet(np.full(VOCAB, 0.7), size=3), dtype=torch.float32)
    drafts = torch.tensor([int(target[0].argmax()), 3, 5], dtype=torch.int32)
    num_draft_tokens = [2, 0, 1]
    cu = torch.tensor(np.cumsum(num_draft_tokens), dtype=torch.int32)
    metadata = type("Metadata", (), {"generators": {}})()
    draws = 6000
    counts = np.zeros((3, VOCAB), dtype=np.int64)
    torch.manual_seed(0)
    for _ in range(draws):
        recovered = sample(2, num_draft_tokens, cu, drafts, None, target, metadata, torch.device("cpu"))
        counts[np.arange(3), recovered.numpy()] += 1
    for position in range(3):
        residual = target[position].double().numpy().copy()
        residual[int(drafts[position])] = 0.0
        residual /= residual.sum()
        assert counts[position, int(drafts[position])] == 0
        keep = residual > 0
        result = chisquare(counts[position, keep], draws * residual[keep])
        assert result.pvalue > 1e-4, (position, counts[position], (draws * residual).round())
