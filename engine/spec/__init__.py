"""Speculative decoding: proposers of tokens the target then verifies in one pass.

Each step the scheduler gives every decoding sequence up to num_speculative_tokens extra
query positions (and their KV slots); the proposer fills them (`propose`); the target
computes all of them at once and the sampler keeps the verified prefix
(engine/rejection_sampler.py). `finish` tells a proposer a sequence is gone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config import EngineConfig, Placement, SpeculativeConfig
from engine.errors import ParamError
from engine.models import loader
from engine.models.decoder import kv_block_bytes
from engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], allow: list[int], copies: list[tuple[int, int]]) -> None:
        """Set each sequence's spec_token_ids (at most its allowance; fewer, or none, is fine)."""

    def finish(self, seq: Sequence) -> None: ...


@dataclass
class DraftPlan:
    """The draft model as checked before anything is built: what it needs of the KV budget."""

    files: loader.ModelFiles
    hf_config: Any
    dtype: torch.dtype

    def block_bytes(self, block_size: int) -> int:
        return kv_block_bytes(self.hf_config, block_size, self.dtype)


def check(config: EngineConfig, placement: Placement, files: loader.ModelFiles, hf_config: Any,
          tokenizer: Any) -> DraftPlan | None:
    """ParamError naming the key for a speculative setting this engine cannot serve; for the
    draft method, the plan to build it."""
    sc = config.speculative_config
    if sc is None:
        return None
    if config.pipeline_parallel_size > 1:
        raise ParamError("speculative_config", "speculative decoding is not supported with pipeline_parallel_size > 1 "
                         "(a stage would need the verified tokens before the next batch)")
    if sc.method != "draft":
        return None
    from engine.models import quantize

    # The draft runs in this process on whole tensors, so a GGUF's GEMM weights come from its
    # blocks, computed on or dequantized (loader.reads_blocks); the target's own files serve
    # it either way.
    dfiles = _resolve(sc.model, True) if sc.model is not None else files
    dconfig = hf_config if sc.model is None else loader.load_config(dfiles)
    if sc.model is not None:
        if dconfig.vocab_size != hf_config.vocab_size:
            raise ParamError("speculative_config.model", f"the draft's vocabulary ({dconfig.vocab_size} tokens) "
                             f"differs from the target's ({hf_config.vocab_size})")
        if loader.load_tokenizer(dfiles).get_vocab() != tokenizer.get_vocab():
            raise ParamError("speculative_config.model", "the draft's tokenizer differs from the target's")
    if sc.num_layers is not None:
        if sc.num_layers > dconfig.num_hidden_layers:
            raise ParamError("speculative_config.num_layers", f"num_layers ({sc.num_layers}) exceeds the draft's "
                             f"{dconfig.num_hidden_layers} layers")
        dconfig = copy.deepcopy(dconfig)
        dconfig.num_hidden_layers = sc.num_layers
    dtype = torch.float32 if sc.quantization else placement.dtype
    try:
        quantize.check(sc.quantization, placement.device, 1, 1)
    except ParamError as e:
        raise ParamError("speculative_config.quantization", str(e)) from None
    if sc.quantization == "gguf" and not str(dfiles.source).endswith(".gguf"):
        raise ParamError("speculative_config.quantization", "quantization \"gguf\" needs a GGUF draft model; "
                         f"{dfiles.source} is not one")
    return DraftPlan(dfiles, dconfig, dtype)


def _resolve(model: str | None, blocks: bool) -> loader.ModelFiles:
    try:
        return loader.resolve(model, blocks)
    except ValueError as e:
        raise ParamError("speculative_config.model", str(e)) from None


def create(sc: SpeculativeConfig, plan: DraftPlan | None, config: EngineConfig, placement: Placement,
           num_blocks: int, backend: Any, kv_manager: Any, generator: torch.Generator,
           cores: list[int] | None = None) -> Proposer:
    """`cores`: those the target's runner in this process runs on; the draft runs on the same."""
    if sc.method == "ngram":
        from engine.spec.ngram import NgramProposer

        return NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max)
    if sc.method == "suffix":
        from engine.spec.suffix import SuffixProposer

        return SuffixProposer(sc.suffix_max_tree_depth, sc.suffix_max_cached_requests, sc.suffix_min_token_prob)
    from engine.runner import ModelRunner
    from engine.spec.draft import DraftProposer

    assert plan is not None
    dummy = config.load_format == "dummy"
    model = loader.build_model(None if dummy else plan.files, plan.hf_config, plan.dtype, placement.device,
                               max_positions=placement.max_positions, dummy=dummy, seed=config.seed,
                               fused=backend.fused_kernels(), quantization=sc.quantization,
                               int8_activations=config.int8_activations)
    runner = ModelRunner(model, num_blocks, config.block_size, plan.dtype, placement.device, backend, cores)
    return DraftProposer(runner, kv_manager, generator)
