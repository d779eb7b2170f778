"""Draft trees: alternative branches verified next to the spine in the same forward.

vLLM 0.32's rejection sampler verifies one chain per request, the *spine*
(the draft :class:`~vllm_fafo.proposer.FafoProposer` hands vLLM). FAFO's
Find Out verification (FAFO Sec. 4.3, Alg. 4) checks every candidate under
the matched key at once; here the other candidates ride behind the batch's
real tokens as *branches*: a branch hangs off spine node ``j`` (after the
first ``j`` spine tokens; 0 is the request's current token), sees the
request's KV up to that node (vLLM wrote the spine's KV into the paged cache
in this same forward) and its own earlier tokens, and writes no KV.

Greedy acceptance: the spine's accepted prefix is vLLM's; a branch off node
``j`` (reached when the spine's first ``j`` tokens were accepted) whose tokens
agree with the target's argmax further than the spine did wins, and the
request's sampled row becomes spine[:j] + the branch's accepted tokens + the
target's next token after them. A branch never goes deeper than the spine
it hangs off, so a win is, to vLLM's scheduler, just more accepted drafts:
the slots exist, and the KV the branch computed for its accepted tokens is
copied over the rejected spine tokens' slots (``commit_branch_kv``).

Sampled acceptance (SpecInfer; Lookahead App. B, with one-hot drafts): where
vLLM's rejection sampler rejected the spine's token at node ``n``, the token
it drew instead comes from the residual distribution (the target's, the
spine's token removed). The branch off node ``n`` whose first token is that
token continues: each further branch token is accepted with the target's
probability for it, the first rejected one is replaced by a draw from the
residual without it, and a fully accepted branch gets a draw after its last
token. Trying the distinct children of node ``n`` one after another, each
accepted with its residual probability, picks child ``c`` with exactly the
probability that the residual draw is ``c``, so the output keeps the
target's distribution.

Only requests whose sampling a branch reproduces exactly get branches
(:func:`keeps_exact_with_branches`); the rest verify the spine alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_fafo.drafting.pool import RequestPool, alternatives_in

PLACEHOLDER = -1
"""vLLM's rejection sampler marks unused slots of a sampled row with -1."""

BRANCH_PLAN_ATTRIBUTE = "vllm_fafo_branches"
"""Name of the attribute that carries the branch plan on vLLM's attention metadata."""


@dataclass(frozen=True)
class Branch:
    """An alternative continuation off spine node ``node``."""

    node: int
    tokens: tuple[int, ...]
    rank: int = 0
    """Its place among the branches off the same node, in the order they were found
    (0: the likeliest); the goodput controller learns yields per rank."""


def grow_branches(
    target: RequestPool,
    context: Sequence[int],
    spine: Sequence[int],
    max_branches: int,
    max_tokens: int,
) -> list[Branch]:
    """Up to ``max_branches`` branches of at most ``max_tokens`` tokens in all.

    Node 0 first (the spine's first token is the likeliest to be rejected),
    then deeper nodes; at each node the pool's candidates under the longest
    matching key first (the request's own candidates first, then others'); one branch
    per first token the spine and earlier branches do not already take there. A
    branch is cut to the spine's depth.
    ``context`` is the text before the current token's successor (its last
    ``max_key_len`` tokens suffice).
    """
    branches: list[Branch] = []
    budget = max_tokens
    text = list(context[-target.pool.max_key_len :])
    for node in range(len(spine)):
        room = len(spine) - node
        taken = {spine[node]}
        for candidate in alternatives_in(target, text + list(spine[:node])):
            if len(branches) == max_branches or budget <= 0:
                return branches
            if candidate[0] in taken:
                continue
            tokens = candidate[: min(room, budget)]
            branches.append(Branch(node, tokens, rank=len(taken) - 1))
            taken.add(tokens[0])
            budget -= len(tokens)
    return branches


def keeps_exact_with_branches(params: Any) -> bool:
    """Whether a branch position's distribution is exactly the one vLLM samples from.

    Greedy (the raw logits' argmax) or sampled with temperature, top-k and top-p
    only (:func:`sampling_probs`), and nothing else that rewrites or reports
    logits (min_p, penalties, min_tokens, bad words, logit bias, allowed tokens,
    structured output, logprobs)."""
    return (
        (not is_sampled(params) or params.min_p == 0.0)
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and params.min_tokens == 0
        and not params.bad_words_token_ids
        and not params.logit_bias
        and not params.allowed_token_ids
        and params.structured_outputs is None
    )


@dataclass
class BranchPlan:
    """Where this step's branches ride in the forward and how they attend.

    Branch tokens lie back to back behind the real tokens (and the lanes).
    Per request: its row in vLLM's batch, the batch indices of its branch
    tokens, each token's number of visible paged positions and the mask over
    its own branch tokens. ``kv_stash`` collects, layer by layer in forward
    order, the keys and values the branch tokens computed, so the accepted
    ones can be copied into the paged cache once acceptance is known.
    """

    ids: np.ndarray  # token ids, in batch order
    positions: np.ndarray
    requests: tuple[RequestBranches, ...]
    kv_stash: list[tuple[Any, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    kernel_rounds: dict[int, list[Any]] = field(default_factory=dict)
    """The branches as calls of the base backend's kernel, by the block table they
    index (``vllm_fafo.attention.branch_attention.kernel_rounds``), built by the first
    layer that runs them."""

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def first_token(self) -> int:
        return self.requests[0].start if self.requests else 0


@dataclass(frozen=True)
class RequestBranches:
    """One request's branches inside the batch's tail."""

    req_id: str
    batch_row: int
    x_index: int  # batch index of the request's current token (spine node 0)
    x_position: int  # its position
    start: int  # batch index of its first branch token
    branches: tuple[Branch, ...]
    num_paged: int  # paged positions 0..num_paged-1 some branch token sees

    @property
    def num_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.branches)

    @property
    def tokens(self) -> slice:
        return slice(self.start, self.start + self.num_tokens)

    def offsets(self) -> list[int]:
        """Offset of each branch's first token inside the request's tokens."""
        return np.cumsum([0] + [len(b.tokens) for b in self.branches[:-1]]).tolist()


def layout_request(req_id: str, batch_row: int, x_index: int, x_position: int, start: int,
                   branches: Sequence[Branch]) -> RequestBranches:
    """Where one request's branches lie in the batch and which paged positions they see."""
    num_paged = x_position + 1 + max(branch.node for branch in branches) if branches else 0
    return RequestBranches(req_id, batch_row, x_index, x_position, start, tuple(branches), num_paged)


def attention_bias(request: RequestBranches) -> np.ndarray:
    """(T, num_paged + T) float32: 0 where branch token t sees the key (paged positions,
    then its own branch's tokens), -inf elsewhere. What the base kernels compute causally
    over the slots, written out for the dense reference."""
    visible, owner, depth = [], [], []
    for index, branch in enumerate(request.branches):
        for i in range(len(branch.tokens)):
            visible.append(request.x_position + branch.node + 1)
            owner.append(index)
            depth.append(i)
    owner_arr, depth_arr, visible_arr = np.array(owner), np.array(depth), np.array(visible)
    paged = np.arange(request.num_paged)[None, :] < visible_arr[:, None]
    own = (owner_arr[:, None] == owner_arr[None, :]) & (depth_arr[None, :] <= depth_arr[:, None])
    return np.where(np.concatenate([paged, own], axis=1), np.float32(0), np.float32(-np.inf))


def branch_positions(request: RequestBranches) -> np.ndarray:
    return np.concatenate([
        request.x_position + branch.node + 1 + np.arange(len(branch.tokens))
        for branch in request.branches
    ])


def stop_node(sampled_row: np.ndarray) -> int:
    """The spine node where verification stopped: the number of spine tokens vLLM accepted."""
    return int((sampled_row != PLACEHOLDER).sum()) - 1


def greedy_matches(
    sampled_row: np.ndarray,  # (K + 1,) vLLM's greedy output for the spine, -1 padded
    request: RequestBranches,
    branch_argmax: np.ndarray,  # (T,) target argmax after each of the request's branch tokens
) -> np.ndarray:
    """Tokens of each branch the target accepts, in order (0 off a node the spine did
    not reach).

    Under greedy decoding vLLM's row is the target's argmax after each accepted
    spine token, so the target's choice at spine node j is ``sampled_row[j]``
    for every node the spine reached. (A branch off a node before the stop node
    starts with another token than the spine's accepted one there, so only the
    branches off the stop node can match.)"""
    reached = stop_node(sampled_row)
    matches = np.zeros(len(request.branches), dtype=np.int64)
    for index, (branch, offset) in enumerate(zip(request.branches, request.offsets())):
        if branch.node > reached:
            continue
        tokens = np.asarray(branch.tokens)
        # branch token i is accepted when the target's choice before it is that token
        before = np.concatenate([[sampled_row[branch.node]], branch_argmax[offset : offset + len(tokens) - 1]])
        matches[index] = int(np.cumprod(tokens == before).sum())
    return matches


def accept_greedy(
    sampled_row: np.ndarray,  # (K + 1,) vLLM's greedy output for the spine, -1 padded
    request: RequestBranches,
    matches: np.ndarray,  # (branches,) from :func:`greedy_matches`
    branch_argmax: np.ndarray,  # (T,) target argmax after each of the request's branch tokens
) -> tuple[int, int, list[int]] | None:
    """The branch that gets furthest, if it beats the spine: (branch index, its
    accepted tokens, the request's new sampled tokens)."""
    if not matches.any():
        return None
    reach = np.where(matches > 0, np.array([branch.node for branch in request.branches]) + matches, -1)
    index = int(reach.argmax())
    if reach[index] <= stop_node(sampled_row):
        return None
    branch, count = request.branches[index], int(matches[index])
    bonus = int(branch_argmax[request.offsets()[index] + count - 1])
    return index, count, sampled_row[: branch.node].tolist() + list(branch.tokens[:count]) + [bonus]


def is_sampled(params: Any) -> bool:
    from vllm.sampling_params import SamplingType

    return params.sampling_type != SamplingType.GREEDY


def sampling_probs(logits: torch.Tensor, params: Any) -> torch.Tensor:
    """The distribution vLLM's rejection sampler verifies a draft against, for rows
    of one request: float32 logits / temperature, then top-k and top-p by vLLM's
    own ``apply_top_k_top_p`` (``apply_sampling_constraints``), then softmax."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    rows = len(logits)
    logits = logits.to(torch.float32) / params.temperature
    vocab = logits.shape[-1]
    top_k = torch.full((rows,), params.top_k, dtype=torch.int32, device=logits.device) \
        if 0 < params.top_k < vocab else None
    top_p = torch.full((rows,), params.top_p, dtype=torch.float32, device=logits.device) \
        if params.top_p < 1.0 else None
    return apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)


def accept_sampled(
    sampled_row: np.ndarray,  # (K + 1,) vLLM's output for the spine, -1 padded
    request: RequestBranches,
    probs: torch.Tensor,  # (T, vocab) the target's distribution after each of the request's branch tokens
    generator: torch.Generator | None,  # the request's own (seeded requests), else torch's default
) -> tuple[int, int, list[int]] | None:
    """The branch that continues where vLLM rejected the spine, if any: (branch index,
    its accepted tokens, the request's new sampled tokens); see the module docstring.

    Node ``n`` is where the spine stopped: ``sampled_row[n]`` is vLLM's draw from the
    residual there (or, if the whole spine was accepted, its bonus draw, which no
    branch follows: a branch is never deeper than the spine)."""
    node = stop_node(sampled_row)
    drawn = int(sampled_row[node])
    for index, (branch, offset) in enumerate(zip(request.branches, request.offsets())):
        if branch.node != node or branch.tokens[0] != drawn:
            continue
        matches = 1
        while matches < len(branch.tokens):
            target = probs[offset + matches - 1]
            uniform = torch.rand((), generator=generator, device=target.device)
            if uniform >= target[branch.tokens[matches]]:
                break
            matches += 1
        target = probs[offset + matches - 1]
        if matches < len(branch.tokens):  # rejected: draw from the residual without that token
            target = target.clone()
            target[branch.tokens[matches]] = 0.0
        final = int(torch.multinomial(target, 1, generator=generator))
        return index, matches, sampled_row[:node].tolist() + list(branch.tokens[:matches]) + [final]
    return None
