"""Hook FAFO's step into ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``.

Wraps nine methods of vLLM 0.32.0's V1 runner (``CPUModelRunner`` inherits
them), each calling one hook of the FAFO proposer's step, in the order of
vLLM's own step (``vllm_fafo.proposer`` reads that step top to bottom):

1. ``_update_states(scheduler_output)``, after it: ``begin_step`` frees
   ``finished_req_ids``, learns the new requests' ``cache_salt`` (carried by
   ``vllm_fafo.patches.new_request_data``) and opens the step.
2. ``_determine_batch_execution_and_padding(num_tokens, num_reqs, ...)``,
   after it: ``plan_forward`` plans the lanes and the draft tree's branches
   from vLLM's prepared batch; the batch descriptor grows by the tail, which therefore rides vLLM's own
   padding mechanism (slot mapping -1: lane tokens write no KV; the
   scheduler, the sampler and the logits of real tokens never see them).
   Before it, where the engine has whole graphs for every padded draft length
   (vllm_fafo.patches.cudagraph_dispatcher), a uniform batch of any tier is
   dispatched at its own query length; ``_warmup_and_capture(desc, ...)``
   captures each such graph at its query length.
3. ``_build_attention_metadata(num_tokens, num_reqs, max_query_len, ...)``,
   after it: the step plan (and the branch plan) is attached to this
   forward's attention metadata,
   where every attention layer reads it and which dies with the forward.
4. ``_preprocess(scheduler_output, num_input_tokens, ...)``, after it (vLLM
   wrote ids and positions and zeroed the padding's positions): the tail's
   ids and positions are written behind the real tokens.
5. ``_model_forward(input_ids, positions, ...)``, after it: with draft-tree
   branches in the forward, the step's one ``model.compute_logits`` call (vLLM
   makes it right after) also computes the branch tokens' logits, handed to
   ``take_branch_logits`` with each request's ``sampling_params``;
   ``sample_tokens(grammar_output)``, before it: fails loudly if they were not.
6. ``_sample(logits, spec_decode_metadata)``, after it: ``accept_branches``
   may swap a request's sampled row for a branch that got further than the
   spine, before vLLM's bookkeeping reads the rows (seeded requests draw from
   their own generators, ``input_batch.generators``).
7. ``propose_draft_token_ids(scheduler_output, sampled_token_ids,
   sampling_metadata, hidden_states, ...)``, before it: ``finish_forward``
   gets ``input_batch.req_ids`` (the row order of the ``sampled_token_ids``
   the proposer is about to receive), the requests a branch can serve
   exactly, and the hidden states the lanes read.

Steps 3 to 6 reach the proposer only where its step planned lanes or branches
into the forward. Other drafters pass through untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_fafo.lanes.planner import BatchView
from vllm_fafo.lanes.step_plan import attach_branches, attach_plan
from vllm_fafo.patches.cudagraph_dispatcher import tier_graph_sizes, uniform_query_len
from vllm_fafo.patches.guard import require_signature
from vllm_fafo.patches.new_request_data import cache_salt_of
from vllm_fafo.proposer import FafoProposer
from vllm_fafo.verification.draft_tree import keeps_exact_with_branches


def _fafo_drafter(runner: GPUModelRunner) -> FafoProposer | None:
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, FafoProposer) else None


def _drafter_with_tail(runner: GPUModelRunner) -> FafoProposer | None:
    """The FAFO proposer where its step planned lanes or branches into this forward: its
    hooks between the planning and the drafting (steps 3-6) have nothing to do otherwise
    (every step where lanes are parked), and are not called (each call of a method between
    two forwards costs about a microsecond)."""
    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, FafoProposer):
        return None
    step = drafter.step
    return drafter if step is not None and (step.plan is not None or step.branches is not None) else None


def _batch_view(runner: GPUModelRunner, num_tokens: int) -> BatchView:
    """What the lane planner reads of the runner's prepared batch."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    spec = runner.drafter.step.scheduled_spec_tokens
    req_ids = batch.req_ids[:num_reqs]
    return BatchView(
        req_ids=req_ids,
        query_start_loc=runner.query_start_loc.np[: num_reqs + 1],
        num_computed_tokens=batch.num_computed_tokens_cpu[:num_reqs],
        num_drafts=[len(spec.get(req_id, ())) for req_id in req_ids],
        num_tokens=num_tokens,
        capacity=runner.max_num_tokens,
    )


def _logits_with_branches(runner: GPUModelRunner, drafter: FafoProposer, branch_states: torch.Tensor) -> None:
    """Have vLLM's next ``model.compute_logits`` call (the step's, right after the
    forward) compute the branch tokens' logits with the real tokens' in one pass over
    the output embedding, and hand them to the proposer; vLLM gets its own rows.

    A second call would read the whole embedding matrix again: on the 2-core CPU
    (SmolLM2, 49,152 x 576 in float32) about 7 ms, a third of a decoding step. The
    override lives on the model instance for that one call."""
    model = runner.model
    vllm_compute_logits = model.compute_logits

    def compute_logits(sample_hidden_states: torch.Tensor) -> torch.Tensor:
        del model.compute_logits  # vLLM's own again from the next call on
        logits = vllm_compute_logits(torch.cat([sample_hidden_states, branch_states]))
        real = len(sample_hidden_states)
        drafter.take_branch_logits(logits[real:], lambda req_id: runner.requests[req_id].sampling_params)
        return logits[:real]

    model.compute_logits = compute_logits


def apply() -> None:
    original_update = require_signature(GPUModelRunner, "_update_states", ["self", "scheduler_output"])
    original_determine = require_signature(
        GPUModelRunner,
        "_determine_batch_execution_and_padding",
        ["self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens"],
    )
    original_warmup_and_capture = require_signature(
        GPUModelRunner, "_warmup_and_capture", ["self", "desc", "cudagraph_runtime_mode"])
    original_build_metadata = require_signature(
        GPUModelRunner, "_build_attention_metadata", ["self", "num_tokens", "num_reqs", "max_query_len"]
    )
    original_preprocess = require_signature(
        GPUModelRunner, "_preprocess", ["self", "scheduler_output", "num_input_tokens"]
    )
    original_model_forward = require_signature(
        GPUModelRunner, "_model_forward", ["self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds"]
    )
    original_sample_tokens = require_signature(GPUModelRunner, "sample_tokens", ["self", "grammar_output"])
    original_sample = require_signature(GPUModelRunner, "_sample", ["self", "logits", "spec_decode_metadata"])
    original_propose = require_signature(
        GPUModelRunner,
        "propose_draft_token_ids",
        ["self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states"],
    )

    @functools.wraps(original_update)
    def _update_states(self, scheduler_output):
        result = original_update(self, scheduler_output)
        drafter = _fafo_drafter(self)
        if drafter is not None:
            new_requests = scheduler_output.scheduled_new_reqs
            drafter.begin_step(scheduler_output.finished_req_ids,
                               scheduler_output.total_num_scheduled_tokens,
                               scheduler_output.scheduled_spec_decode_tokens,
                               {new.req_id: cache_salt_of(new) for new in new_requests} if new_requests else {})
        return result

    @functools.wraps(original_determine)
    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, *args, **kwargs):
        query_len = max_num_scheduled_tokens
        tier_batch = query_len in tier_graph_sizes(self.cudagraph_dispatcher) and num_tokens == query_len * num_reqs
        if tier_batch and kwargs.get("force_uniform_decode") is None:  # a padded tier's uniform batch, not only vLLM's
            kwargs["force_uniform_decode"] = True
        with uniform_query_len(self, query_len) if tier_batch else contextlib.nullcontext():
            result = original_determine(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                                        *args, **kwargs)
        drafter = _fafo_drafter(self)
        if drafter is None or drafter.step is None or not drafter.plans_forward:
            return result
        tail_tokens = drafter.plan_forward(_batch_view(self, num_tokens))
        if not tail_tokens:
            return result
        cudagraph_mode, batch_desc, *rest = result
        if batch_desc.num_tokens != num_tokens:
            raise RuntimeError(
                "vllm-fafo lanes and draft trees need an unpadded eager batch, but vLLM padded "
                f"{num_tokens} tokens to {batch_desc.num_tokens} (cudagraph mode "
                f"{cudagraph_mode}); run with enforce_eager=True"
            )
        grown = dataclasses.replace(batch_desc, num_tokens=num_tokens + tail_tokens)
        return (cudagraph_mode, grown, *rest)

    @functools.wraps(original_warmup_and_capture)
    def _warmup_and_capture(self, desc, cudagraph_runtime_mode, *args, **kwargs):
        if not (desc.uniform and desc.num_reqs and tier_graph_sizes(self.cudagraph_dispatcher)):
            return original_warmup_and_capture(self, desc, cudagraph_runtime_mode, *args, **kwargs)
        with uniform_query_len(self, desc.num_tokens // desc.num_reqs):  # the tier this graph replays
            return original_warmup_and_capture(self, desc, cudagraph_runtime_mode, *args, **kwargs)

    @functools.wraps(original_build_metadata)
    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, *rest = original_build_metadata(self, *args, **kwargs)
        drafter = _drafter_with_tail(self)
        if drafter is None:
            return (attn_metadata, *rest)
        plan = drafter.attention_plan()
        if plan is not None:
            attach_plan(attn_metadata, plan)
        branches = drafter.branch_plan()
        if branches is not None:
            attach_branches(attn_metadata, branches)
        return (attn_metadata, *rest)

    @functools.wraps(original_preprocess)
    def _preprocess(self, scheduler_output, num_input_tokens, *args, **kwargs):
        result = original_preprocess(self, scheduler_output, num_input_tokens, *args, **kwargs)
        drafter = _drafter_with_tail(self)
        tail = drafter.tail_inputs() if drafter is not None else None
        if tail is not None:
            ids, positions = tail
            start = scheduler_output.total_num_scheduled_tokens
            end = start + len(ids)
            self.input_ids.gpu[start:end] = torch.as_tensor(ids, dtype=self.input_ids.gpu.dtype)
            self.positions[start:end] = torch.as_tensor(positions, dtype=self.positions.dtype)
        return result

    @functools.wraps(original_model_forward)
    def _model_forward(self, *args, **kwargs):
        output = original_model_forward(self, *args, **kwargs)
        drafter = _drafter_with_tail(self)
        if drafter is not None and isinstance(output, torch.Tensor):
            branch_states = drafter.branch_hidden_states(output)
            if branch_states is not None:
                _logits_with_branches(self, drafter, branch_states)
        return output

    @functools.wraps(original_sample_tokens)
    def sample_tokens(self, grammar_output, *args, **kwargs):
        drafter = _drafter_with_tail(self)
        state = self.execute_model_state
        if drafter is not None and state is not None and drafter.branch_hidden_states(state.hidden_states) is not None:
            raise RuntimeError(
                "vllm-fafo: the step's logits were not computed through model.compute_logits, "
                "so the draft tree's branches have none; vLLM's GPUModelRunner.execute_model "
                "changed under this release of vllm-fafo (written against vLLM 0.32.0)"
            )
        return original_sample_tokens(self, grammar_output, *args, **kwargs)

    @functools.wraps(original_sample)
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        drafter = _drafter_with_tail(self)
        sampler_output = original_sample(self, logits, spec_decode_metadata, *args, **kwargs)
        if drafter is not None and spec_decode_metadata is not None:
            drafter.accept_branches(sampler_output.sampled_token_ids, self.input_batch.generators)
        return sampler_output

    @functools.wraps(original_propose)
    def propose_draft_token_ids(
        self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, *args, **kwargs,
    ):
        drafter = _fafo_drafter(self)
        if drafter is not None:
            req_ids = list(self.input_batch.req_ids)
            eligible = [
                req_id for req_id in req_ids
                if keeps_exact_with_branches(self.requests[req_id].sampling_params)
            ] if drafter.tree_enabled else ()
            drafter.finish_forward(req_ids, hidden_states, eligible)
        return original_propose(
            self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, *args, **kwargs,
        )

    wrappers = {
        "_update_states": _update_states,
        "_determine_batch_execution_and_padding": _determine_batch_execution_and_padding,
        "_warmup_and_capture": _warmup_and_capture,
        "_build_attention_metadata": _build_attention_metadata,
        "_preprocess": _preprocess,
        "_model_forward": _model_forward,
        "sample_tokens": sample_tokens,
        "_sample": _sample,
        "propose_draft_token_ids": propose_draft_token_ids,
    }
    for name, wrapper in wrappers.items():
        wrapper.vllm_fafo_patch = __name__
        setattr(GPUModelRunner, name, wrapper)
