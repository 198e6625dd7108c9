"""The gpu tier: what only a CUDA device shows. Skipped where torch sees none;
scripts/gpu_check.sh runs it on a lent GPU, with the Triton kernels' own tests on the
device (tests/unit/test_kernels.py under KERNELS_NATIVE=1).

The models are tiny random checkpoints built here with transformers and a word-level
tokenizer, so nothing beyond the repository has to reach the device: greedy fp32 equal to
transformers on the same device, bf16 within the usual tolerance, CUDA-graph replay equal
to eager, and prefix caching, preemption and speculative decoding unchanged there.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.support import arch_models

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

VOCAB = 512
PROMPTS = [[(11 * i + 7 * j) % (VOCAB - 3) + 3 for j in range(20 + 9 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model_type -> a tiny checkpoint: Llama-shaped Mistral without a window, Qwen3 (q/k
    norms, head size 128) and Gemma 2 (a window shorter than the prompts, soft-capping)."""
    root = tmp_path_factory.mktemp("gpu-models")
    tok = arch_models.word_tokenizer(root / "tok", VOCAB)
    over = {"mistral": dict(sliding_window=None), "qwen3": dict(head_dim=128, rope_scaling=None,
                                                                use_sliding_window=False), "gemma2": {}}
    return {t: arch_models.build(t, root / t, tok, vocab_size=VOCAB, **o) for t, o in over.items()}


def _ours(path, n: int = 16, prompts=PROMPTS, **kw) -> list[list[int]]:
    """Greedy tokens from a fresh engine on the device, whose memory goes back after it."""
    from engine import LLM, SamplingParams

    kw.setdefault("kv_cache_memory_bytes", 1 << 28)  # not 0.9 of the device, engine after engine
    with LLM(str(path), device="cuda", attention_backend="triton", max_model_len=256, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def _hf(path, dtype: torch.dtype, n: int = 16) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    tokens, tops = [], []
    for p in PROMPTS:
        # eos_token_id=None: no stop and no suppression, as ignore_eos on our side
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        tokens.append(out.sequences[0, len(p):].tolist())
        tops.append([s[0].topk(5).indices.cpu() for s in out.scores])
    return tokens, tops


@pytest.mark.parametrize("model_type", ["mistral", "qwen3", "gemma2"])
def test_greedy_fp32_on_cuda_is_transformers(models, model_type):
    want, _ = _hf(models[model_type], torch.float32)
    assert _ours(models[model_type], dtype="float32", enforce_eager=True) == want
    assert _ours(models[model_type], dtype="float32") == want  # through the decode graphs


@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
def test_bf16_on_cuda_departs_from_transformers_only_at_near_ties(models, model_type):
    """As vLLM checks bf16: where the two greedy paths first differ, each token is among
    the other's top five, and the sequences are not compared past that point."""
    want, tops = _hf(models[model_type], torch.bfloat16)
    got = _ours(models[model_type], dtype="bfloat16")
    for ours, theirs, top in zip(got, want, tops):
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if i is not None:
            assert ours[i] in top[i].tolist(), (i, ours[i], theirs[i])


def test_graph_replay_equals_eager_at_every_batch_size(models):
    """1, 3 (padded to 4), 5 (to 8) and 11 sequences over sizes 1, 2, 4, 8 (11 runs eagerly)."""
    from engine import LLM

    prompts = [[(5 * i + j) % (VOCAB - 3) + 3 for j in range(9 + 4 * i)] for i in range(11)]
    for count in (1, 3, 5, 11):
        eager = _ours(models["qwen3"], prompts=prompts[:count], dtype="bfloat16", enforce_eager=True)
        graphed = _ours(models["qwen3"], prompts=prompts[:count], dtype="bfloat16", cuda_graph_sizes=[1, 2, 4, 8])
        assert graphed == eager, count
    with LLM(str(models["qwen3"]), device="cuda", attention_backend="triton", max_model_len=256,
             kv_cache_memory_bytes=1 << 28) as llm:
        assert llm.engine.executor.runner.graphs is not None


def test_prefix_caching_preemption_and_speculation_change_nothing_on_cuda(models):
    path, shared = models["mistral"], [list(range(3, 60))]
    prompts = [shared[0] + p for p in PROMPTS]
    base = _ours(path, prompts=prompts, dtype="float32", enable_prefix_caching=False)
    assert _ours(path, prompts=prompts, dtype="float32", enable_prefix_caching=True) == base
    # 24 blocks of 16: five sequences of up to 160 tokens cannot all stay resident
    assert _ours(path, prompts=prompts, dtype="float32", kv_cache_memory_bytes=24 * 16 * 4 * 2 * 2 * 16 * 3) == base
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert _ours(path, prompts=prompts, dtype="float32", speculative_config=spec) == base
