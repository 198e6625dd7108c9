"""The CUDA-graph decode path on the CPU (engine/cuda_graphs.py): `eager_capture` stands in
for the recording (a replay calls the captured step again over the same buffers), so
replayed decode steps equal eager ones, padding rows write no KV and mixed steps run
eagerly. The gpu tier replays real graphs against eager on a device."""

from __future__ import annotations


import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, bucket, eager_capture


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
