"""Append the fumble-lane tail behind the real tokens of a step.

Wraps two methods of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``
(vLLM 0.32.0):

- ``_determine_batch_execution_and_padding(num_tokens, num_reqs, ...)``:
  after vLLM prepared the batch, the FAFO proposer plans this step's tail;
  the batch descriptor grows by the tail, which therefore rides vLLM's own
  padding mechanism (slot mapping -1: lane tokens write no KV; the
  scheduler, the sampler and the logits of real tokens never see them).
- ``_preprocess(scheduler_output, num_input_tokens, ...)``: after vLLM wrote
  ids and positions (and zeroed the padding's positions), the tail's ids and
  positions are written behind the real tokens.
- ``execute_model(scheduler_output, ...)``: the step plan the attention layers
  read is dropped when the forward is over, so no other forward (a dummy run,
  or another engine in the same process) can see it.

Only steps that went through ``_update_states`` (real steps, not warm-up
dummy runs) get a tail; see ``vllm_fafo.patches.model_runner``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_fafo.fumble import BatchView
from vllm_fafo.patches.guard import require_signature
from vllm_fafo.proposer import FafoProposer
from vllm_fafo.step_plan import set_current_plan

PENDING_STEP = "_vllm_fafo_pending_step"
TAIL = "_vllm_fafo_tail"


def _plan(runner: GPUModelRunner, num_tokens: int) -> tuple | None:
    scheduler_output = getattr(runner, PENDING_STEP, None)
    drafter = getattr(runner, "drafter", None)
    if scheduler_output is None or not isinstance(drafter, FafoProposer) or drafter.lanes is None:
        return None
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    spec = scheduler_output.scheduled_spec_decode_tokens
    view = BatchView(
        req_ids=batch.req_ids[:num_reqs],
        query_start_loc=runner.query_start_loc.np[: num_reqs + 1],
        num_computed_tokens=batch.num_computed_tokens_cpu[:num_reqs],
        num_drafts=[len(spec.get(req_id, ())) for req_id in batch.req_ids[:num_reqs]],
        num_tokens=num_tokens,
        capacity=runner.max_num_tokens,
    )
    ids, positions = drafter.plan_tail(view)
    return (ids, positions) if len(ids) else None


def apply() -> None:
    original_determine = require_signature(
        GPUModelRunner,
        "_determine_batch_execution_and_padding",
        ["self", "num_tokens", "num_reqs", "num_scheduled_tokens_np"],
    )
    original_preprocess = require_signature(
        GPUModelRunner, "_preprocess", ["self", "scheduler_output", "num_input_tokens"]
    )

    @functools.wraps(original_determine)
    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, *args, **kwargs):
        result = original_determine(self, num_tokens, num_reqs, *args, **kwargs)
        tail = _plan(self, num_tokens)
        setattr(self, TAIL, tail)
        if tail is None:
            return result
        cudagraph_mode, batch_desc, *rest = result
        if batch_desc.num_tokens != num_tokens:
            raise RuntimeError(
                "vllm-fafo lanes need an unpadded eager batch, but vLLM padded "
                f"{num_tokens} tokens to {batch_desc.num_tokens} (cudagraph mode "
                f"{cudagraph_mode}); run with enforce_eager=True"
            )
        grown = dataclasses.replace(batch_desc, num_tokens=num_tokens + len(tail[0]))
        return (cudagraph_mode, grown, *rest)

    @functools.wraps(original_preprocess)
    def _preprocess(self, scheduler_output, num_input_tokens, *args, **kwargs):
        result = original_preprocess(self, scheduler_output, num_input_tokens, *args, **kwargs)
        tail = getattr(self, TAIL, None)
        setattr(self, PENDING_STEP, None)
        setattr(self, TAIL, None)
        if tail is not None:
            ids, positions = tail
            start = scheduler_output.total_num_scheduled_tokens
            end = start + len(ids)
            self.input_ids.gpu[start:end] = torch.as_tensor(ids, dtype=self.input_ids.gpu.dtype)
            self.positions[start:end] = torch.as_tensor(positions, dtype=self.positions.dtype)
        return result

    original_execute = require_signature(
        GPUModelRunner, "execute_model", ["self", "scheduler_output"]
    )

    @functools.wraps(original_execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        try:
            return original_execute(self, scheduler_output, *args, **kwargs)
        finally:
            set_current_plan(None)

    _determine_batch_execution_and_padding.vllm_fafo_patch = __name__
    _preprocess.vllm_fafo_patch = __name__
    execute_model.vllm_fafo_patch = __name__
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._determine_batch_execution_and_padding = _determine_batch_execution_and_padding
    GPUModelRunner._preprocess = _preprocess
