"""The CUDA-graph decode path's sizing (engine/cuda_graphs.py): which steps a graph takes
and at what padded size, the sizes refused by name, and the memory pool estimate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import bucket, default_sizes, pool_bytes, wanted
from kernels.backend import NativeBackend, TorchBackend, TritonBackend

DENSE = SimpleNamespace(graph_safe=True)  # a model without expert layers


def test_sizes_buckets_and_when_graphs_are_wanted():
    assert default_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_sizes(5) == [1, 2, 4, 5] and default_sizes(1) == [1]
    assert default_sizes(1000)[-1] == 256
    sizes = default_sizes(20)
    assert [bucket(n, sizes) for n in (1, 3, 5, 8, 9, 17, 20, 21)] == [1, 4, 8, 8, 16, 20, 20, None]

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    base = EngineConfig(max_num_seqs=16)
    assert wanted(base, cuda, TritonBackend(), DENSE) == [1, 2, 4, 8, 16]
    assert wanted(base, cpu, TritonBackend(), DENSE) == []
    assert wanted(base, cuda, TorchBackend(), DENSE) == []  # its store asks the host about padding
    assert wanted(base, cpu, NativeBackend(), DENSE) == []
    assert wanted(base.model_copy(update={"enforce_eager": True}), cuda, TritonBackend(), DENSE) == []
    assert wanted(base.model_copy(update={"tensor_parallel_size": 2}), cuda, TritonBackend(), DENSE) == []
    assert wanted(EngineConfig(cuda_graph_sizes=[8, 1, 8, 3]), cuda, TritonBackend(), DENSE) == [1, 3, 8]
    assert wanted(base, cuda, TritonBackend(), SimpleNamespace(graph_safe=False)) == []  # an expert layer


def test_bad_graph_sizes_are_refused_by_name():
    from engine.errors import ParamError

    for bad in ([], [0], [5000], list(range(1, 300))):
        with pytest.raises(ParamError) as e:
            EngineConfig.create(cuda_graph_sizes=bad)
        assert e.value.param.startswith("cuda_graph_sizes")


def test_the_pool_estimate_covers_the_logits_of_the_largest_size():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_key_value_heads=8)
    assert pool_bytes(cfg, 256, torch.bfloat16) > 256 * 32000 * 4
    assert pool_bytes(cfg, 8, torch.bfloat16) < pool_bytes(cfg, 256, torch.bfloat16)
