"""The CUDA-graph decode path's logic on the CPU (engine/cuda_graphs.py): which steps a
graph takes and at what padded size, the persistent buffers a replay reads, the padding
rows that must write nothing, and the eager fallback. `eager_capture` stands in for the
recording (a replay calls the captured step again over the same buffers); the gpu tier
replays real graphs against eager on a device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, bucket, default_sizes, eager_capture, pool_bytes, wanted
from kernels.backend import NativeBackend, TorchBackend, TritonBackend

DENSE = SimpleNamespace(graph_safe=True)  # a model without expert layers


@pytest.mark.unit
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


@pytest.mark.unit
def test_bad_graph_sizes_are_refused_by_name():
    from engine.errors import ParamError

    for bad in ([], [0], [5000], list(range(1, 300))):
        with pytest.raises(ParamError) as e:
            EngineConfig.create(cuda_graph_sizes=bad)
        assert e.value.param.startswith("cuda_graph_sizes")


@pytest.mark.unit
def test_the_pool_estimate_covers_the_logits_of_the_largest_size():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_key_value_heads=8)
    assert pool_bytes(cfg, 256, torch.bfloat16) > 256 * 32000 * 4
    assert pool_bytes(cfg, 8, torch.bfloat16) < pool_bytes(cfg, 256, torch.bfloat16)


@pytest.fixture(scope="module")
def graphed(tiny_model_factory):
    """A tiny engine on the reference backend, its decode steps through DecodeGraphs of
    sizes 1, 2, 4 and 8; and a counter of replays per size."""
    path = tiny_model_factory("graphs-tiny")
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=128,
              block_size=8, max_num_seqs=16, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    graphs = DecodeGraphs(runner, [1, 2, 4, 8], 128 // 8, capture=eager_capture)
    graphs.capture_all()
    replays: dict[int, int] = {}
    for size, replay in list(graphs.graphs.items()):
        def counted(size=size, replay=replay):
            replays[size] = replays.get(size, 0) + 1
            return replay()
        graphs.graphs[size] = counted
    return llm, runner, graphs, replays


def _greedy(llm, prompts, n=12):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.engine
@pytest.mark.parametrize("count", [1, 3, 5, 8, 11])
def test_replayed_decode_steps_equal_eager_ones(graphed, count):
    """Batches that fill a size, that pad up to one (3 -> 4, 5 -> 8) and that are past the
    largest (11: eager) give the tokens the eager runner gives."""
    llm, runner, graphs, replays = graphed
    prompts = [[(7 * i + j) % 400 + 3 for j in range(5 + 3 * i)] for i in range(count)]
    runner.graphs = None
    want = _greedy(llm, prompts)
    replays.clear()
    runner.graphs = graphs
    try:
        assert _greedy(llm, prompts) == want
    finally:
        runner.graphs = None
    if count <= 8:
        assert replays.get(bucket(count, graphs.sizes), 0) >= 10  # the decode steps went through the graph
    else:
        assert sum(replays.values()) < 12  # the steps with more than 8 sequences did not


@pytest.mark.engine
def test_padding_rows_write_no_kv_and_mixed_steps_run_eagerly(graphed):
    """A replay of 3 sequences at size 4 writes the cache at those 3 slots and nowhere else;
    a step with a prefill in it is not a graph's."""
    from engine.runner import StepTensors

    _, runner, graphs, _ = graphed
    before = [k.clone() for k, _ in runner.kv_slots]
    slots = torch.tensor([17, 42, 63])
    step = StepTensors(torch.tensor([5, 6, 7]), torch.tensor([1, 2, 7]), slots,
                       torch.tensor([[2, 0], [5, 0], [7, 0]]), torch.arange(4), torch.tensor([2, 3, 8]),
                       torch.arange(3), torch.zeros(0, 2, dtype=torch.int64), 3)
    assert graphs.fits(step) == 4
    logits = graphs.run(step)
    assert logits is not None and logits.shape[0] == 3
    for (k, _), old in zip(runner.kv_slots, before):
        changed = (k != old).flatten(0, 1).flatten(1).any(1).nonzero().flatten()  # by cache slot
        assert set(changed.tolist()) <= set(slots.tolist()) and len(changed) > 0
    assert torch.equal(logits, runner.eager(step))

    mixed = StepTensors(torch.tensor([5, 6, 7]), torch.tensor([3, 0, 1]), torch.tensor([3, 8, 9]),
                        torch.tensor([[0], [1], [1]]), torch.tensor([0, 1, 3]), torch.tensor([4, 2]),
                        torch.tensor([0, 2]), torch.zeros(0, 2, dtype=torch.int64), 1)
    assert graphs.fits(mixed) is None and graphs.run(mixed) is None
    wide = StepTensors(torch.tensor([5]), torch.tensor([1]), torch.tensor([3]), torch.zeros(1, 17, dtype=torch.int64),
                       torch.arange(2), torch.tensor([2]), torch.arange(1), torch.zeros(0, 2, dtype=torch.int64), 1)
    assert graphs.fits(wide) is None  # a table wider than the graphs hold
