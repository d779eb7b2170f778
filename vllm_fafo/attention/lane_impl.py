"""The part of the attention wrapper that does not depend on the base backend.

Each wrapper (``cpu.py`` over ``CPU_ATTN``, ``cuda.py`` over ``FLASH_ATTN``)
is this mixin placed before vLLM's impl class: the base impl computes the
real tokens (the tail is padding to it: beyond ``num_actual_tokens``, slot
mapping -1), then this maintains the layer's compressed region and writes
the lane tokens' outputs, and runs the draft tree's branches
(:mod:`vllm_fafo.attention.branch_attention`). A wrapper only says how to
read its base's paged KV cache, how to call its base's kernel for the
branches, and which of its layers' settings that call does not cover.
Without a step plan on the forward's attention metadata (no lanes
configured, warm-up, profiling) the wrapper is exactly the base backend.

The region is allocated when vLLM builds the layer (inside its
``set_current_vllm_config`` context, during model loading), from the engine's
:class:`~vllm_fafo.config.RegionSpec`: before vLLM sizes the KV cache, so the
memory it takes is memory vLLM knows is used.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionType

from vllm_fafo.attention.branch_attention import BranchKernel, kernel_rounds, run_branches_in_kernel
from vllm_fafo.attention.paged_kv import PagedKVReader
from vllm_fafo.attention.region import CompressedRegion
from vllm_fafo.config import RegionSpec, fafo_settings
from vllm_fafo.lanes.compression.base import LayerShape
from vllm_fafo.lanes.step_plan import StepPlan, branches_of, plan_of


class LaneAttentionMixin(ABC):
    """Runs the base impl, then maintains the region and runs the lanes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.region: CompressedRegion | None = None
        self._layout_checked = False
        vllm_config = get_current_vllm_config_or_none()
        spec = RegionSpec.from_vllm_config(vllm_config) if vllm_config is not None else None
        if spec is not None and self.attn_type == AttentionType.DECODER:
            self.allocate_region(spec, vllm_config.model_config.dtype, vllm_config.device_config.device)
        settings = fafo_settings(vllm_config) if vllm_config is not None else None
        if settings is not None and settings["num_candidates"] > 1 and self.attn_type == AttentionType.DECODER:
            self.refuse_branches_here()

    @abstractmethod
    def refuse_branches_here(self) -> None:
        """Raise :class:`~vllm_fafo.errors.FafoConfigError` for a layer whose settings this
        wrapper's branch kernel does not reproduce; called when the layer is built with
        draft trees on."""

    def allocate_region(self, spec: RegionSpec, dtype: torch.dtype, device: torch.device) -> None:
        """This layer's region, staging and policy state, for the whole engine life."""
        shape = LayerShape(
            rows=spec.rows,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            max_model_len=spec.max_model_len,
            dtype=dtype,
            device=torch.device(device),
        )
        self.region = CompressedRegion.allocate(spec.policy, spec.staged_slots, shape)

    @abstractmethod
    def paged_kv(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> PagedKVReader:
        """A reader of this layer's paged cache in the base backend's layout."""

    @abstractmethod
    def branch_kernel(self, layer: torch.nn.Module, kv_cache: torch.Tensor, attn_metadata) -> BranchKernel:
        """The base backend's own kernel, for this step's draft-tree branches in this layer."""

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        output = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output,
            output_scale, output_block_scale,
        )
        if self.attn_type != AttentionType.DECODER:
            return output
        branches = branches_of(attn_metadata)
        if branches is not None and branches.requests:
            reader = self.paged_kv(layer, kv_cache, attn_metadata)
            if not self._layout_checked:
                first = branches.requests[0]
                x = slice(first.x_index, first.x_index + 1)
                reader.check(first.batch_row, torch.tensor([first.x_position], device=key.device), key[x], value[x])
                self._layout_checked = True
            kernel = self.branch_kernel(layer, kv_cache, attn_metadata)
            rounds = kernel_rounds(branches, attn_metadata.block_table, kernel.block_size)
            run_branches_in_kernel(branches, rounds, query, key, value, output, kernel, reader)
        plan = plan_of(attn_metadata)
        if plan is None:
            return output
        region = self.region
        if region is None or key.dtype != region.dtype:
            raise RuntimeError(
                f"vllm-fafo: a step plan reached an attention layer whose lane region is "
                f"{'missing' if region is None else f'{region.dtype}, not {key.dtype}'}; the "
                "region is built from vllm_config when vLLM builds the layer"
            )
        reader = None  # streaming reads the cache only to catch up: no reader per layer and step
        if region.policy.reads_paged_kv or plan.catch_up:
            reader = self.paged_kv(layer, kv_cache, attn_metadata)
            if not self._layout_checked and plan.tails:
                self._check_layout(plan, reader, key, value)
        region.run_step(plan, query, key, value, output, self.scale, reader)
        return output

    def _check_layout(self, plan: StepPlan, reader: PagedKVReader, key, value) -> None:
        """Read this step's input token back from the cache: it must be what was written."""
        tail = plan.tails[0]
        x = slice(tail.x_index, tail.x_index + 1)
        position = torch.tensor([tail.num_final - 1], device=key.device)
        reader.check(tail.batch_row, position, key[x], value[x])
        self._layout_checked = True
