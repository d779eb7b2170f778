"""Draw the rejection sampler's noise only where it is read, and fast, on CPU.

Replaces ``vllm.v1.sample.rejection_sampler.sample_recovered_tokens(max_spec_len,
num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
target_probs, sampling_metadata, device, use_fp64_gumbel)`` of vLLM 0.32.0 on
CPU. For every sampled (non-greedy) step with drafts, vLLM's version fills a
``[batch_size, vocab_size]`` tensor with ``Tensor.exponential_()`` (the noise of
the exponential race that picks a recovered token) for every request of the
batch, drafts or not. On CPU ``exponential_`` is slow (about 15 ms for 16 x
49,152 values on 2 cores, against 5 ms for ``-log`` of float64 uniforms), and
the kernel that follows only reads the rows of requests that have drafts: in a
batch of 16 with a few drafting requests the step spent more on this noise
than on sampling itself.

The replacement draws the same distribution, Exp(1) per entry, only for rows
with drafts: ``-log(U)`` with ``U`` uniform in float64 (cast to vLLM's
``q`` dtype) for requests without a generator, and exactly vLLM's seeded
``q[i].exponential_(generator=...)`` for requests with one, so seeded
requests draw what they draw under vLLM. Rows without drafts hold 1.0 and
are never read (the kernel stops at each request's draft count). Unseeded
requests draw fewer values from the global generator than under vLLM's
version: the same distribution, not the same stream. Then vLLM's own kernel
(``_sample_recovered_tokens``) runs unchanged.

Applied on CPU only; CUDA keeps vLLM's version.
"""

from __future__ import annotations

import torch
from vllm.platforms import current_platform

from vllm_fafo.patches.guard import require_signature

PARAMS = [
    "max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids", "draft_probs",
    "target_probs", "sampling_metadata", "device", "use_fp64_gumbel",
]


def exponential_noise(num_draft_tokens: list[int], generators: dict[int, torch.Generator], vocab_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[batch_size, vocab_size]`` Exp(1) noise in the rows of requests with drafts
    (seeded rows as vLLM draws them), 1.0 elsewhere."""
    q = torch.ones((len(num_draft_tokens), vocab_size), dtype=dtype, device=device)
    rows = [i for i, n in enumerate(num_draft_tokens) if n > 0 and i not in generators]
    if rows:
        uniform = torch.rand((len(rows), vocab_size), dtype=torch.float64, device=device)
        q[rows] = uniform.log_().neg_().to(dtype)
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            q[i].exponential_(generator=generator)
    return q


def apply() -> None:
    if not current_platform.is_cpu():
        return
    from vllm.v1.sample import rejection_sampler

    original = require_signature(rejection_sampler, "sample_recovered_tokens", PARAMS)
    require_signature(rejection_sampler, "_sample_recovered_tokens",
                      ["output_token_ids", "cu_num_draft_tokens", "draft_token_ids", "draft_probs",
                       "target_probs", "inv_q"])

    def sample_recovered_tokens(
        max_spec_len: int,
        num_draft_tokens: list[int],
        cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        sampling_metadata,
        device: torch.device,
        use_fp64_gumbel: bool = False,
    ) -> torch.Tensor:
        q = exponential_noise(num_draft_tokens, sampling_metadata.generators, target_probs.shape[-1],
                              torch.float64 if use_fp64_gumbel else torch.float32, device)
        recovered_token_ids = torch.empty_like(draft_token_ids)
        rejection_sampler._sample_recovered_tokens(
            recovered_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
            q.reciprocal(), max_spec_len=max_spec_len,
        )
        return recovered_token_ids

    sample_recovered_tokens.__wrapped__ = original
    sample_recovered_tokens.vllm_fafo_patch = __name__
    rejection_sampler.sample_recovered_tokens = sample_recovered_tokens
