"""Tiny random checkpoints of every supported architecture, built offline with
transformers: a few layers, windows shorter than the test prompts, and every norm weight
and bias moved away from its initial value, so that a norm or bias the engine forgot, or
applied in the wrong place, changes the output."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
WINDOW = 12

# model_type -> config overrides: each architecture's own features switched on.
ARCHS: dict[str, dict] = {
    "mistral": dict(sliding_window=WINDOW, tie_word_embeddings=False),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, head_dim=32,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "gemma": dict(head_dim=16, hidden_act="gelu_pytorch_tanh"),
    "gemma2": dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=24, rope_local_base_freq=100.0,
                        rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "phi3": dict(sliding_window=WINDOW, partial_rotary_factor=0.5, original_max_position_embeddings=128,
                 rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(4)],
                               "long_factor": [2.0 + i for i in range(4)]}, tie_word_embeddings=False),
    "olmo2": dict(tie_word_embeddings=False),
    # OLMo 2's layer with a window on the local layers, and YaRN on the global ones only.
    "olmo3": dict(tie_word_embeddings=False, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                                      "original_max_position_embeddings": 64}}),
    "ministral": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      tie_word_embeddings=False),
    "seed_oss": dict(attention_bias=True, attention_out_bias=True, head_dim=32, tie_word_embeddings=False),
    # Rotary on adjacent pairs of dims (GLM's partial, on half of each head); GLM-4-0414's four norms.
    "ernie4_5": dict(use_bias=True, tie_word_embeddings=True),
    "glm": dict(attention_bias=True, head_dim=16, partial_rotary_factor=0.5, tie_word_embeddings=False),
    "glm4": dict(attention_bias=True, head_dim=16, partial_rotary_factor=0.5, tie_word_embeddings=False),
    # One LayerNorm read by attention and MLP side by side, a logit scale; Command R7B's
    # local layers windowed and turned, its global one neither.
    "cohere": dict(logit_scale=0.5, layer_norm_eps=1e-5),
    "cohere2": dict(logit_scale=0.5, layer_norm_eps=1e-5, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # A NoPE layer (no_rope_layers 0), windowed as use_sliding_window makes it.
    "smollm3": dict(no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=WINDOW,
                    tie_word_embeddings=True),
    # Local layers windowed and rotated, the global one neither (NoPE); q/k norms, post norms.
    "exaone4": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    tie_word_embeddings=False),
    # Plain MLPs (no gate): Arcee's ReLU² with biases, StarCoder2's GELU with LayerNorm biases
    # and a window on every layer.
    "arcee": dict(hidden_act="relu2", mlp_bias=True, attention_bias=True, tie_word_embeddings=False),
    "starcoder2": dict(hidden_act="gelu_pytorch_tanh", use_bias=True, norm_epsilon=1e-5, sliding_window=WINDOW,
                       tie_word_embeddings=True),
    # Nemotron's LayerNorm1P (bias, 1 + w), ReLU² without a gate, rotary on half of each head.
    "nemotron": dict(hidden_act="relu2", norm_eps=1e-5, partial_rotary_factor=0.5, attention_bias=True,
                     tie_word_embeddings=False),
    # torch's LayerNorm with a bias under a SiLU-gated MLP, q/k/v biases, rotary on a quarter of each head.
    "stablelm": dict(use_qkv_bias=True, partial_rotary_factor=0.25, layer_norm_eps=1e-5, tie_word_embeddings=False),
    # InternLM3 is Llama's layer, its qkv_bias and bias read as Llama's two biases.
    "internlm3": dict(qkv_bias=True, bias=True, tie_word_embeddings=False),
    # Helium: adjacent-pair rotary, norms multiplying in fp32, q/k/v and MLP biases.
    "helium": dict(attention_bias=True, mlp_bias=True, head_dim=16, tie_word_embeddings=False),
    # HunYuan: per-head q/k norms after the rotary, NTK rotary with a fixed alpha, biases.
    "hunyuan_v1_dense": dict(attention_bias=True, head_dim=16, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                              "rope_theta": 10000.0}),
    # Apertus: a plain MLP through xIELU, whose per-layer parameters are moved too (below).
    "apertus": dict(hidden_act="xielu", tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05,
                    logits_scaling=8.0, attention_bias=True),
    # Mixtures of experts: 4 experts, top 2; a dense layer among Qwen3-MoE's; Qwen2-MoE's shared expert.
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, tie_word_embeddings=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
                      shared_expert_intermediate_size=96, tie_word_embeddings=False),
    # OLMo 2's all-head q/k norms under a pre-norm layer, experts on every layer, top-k not renormalised.
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=48, norm_topk_prob=False,
                  tie_word_embeddings=False),
    # Granite's multipliers over experts routed by their top-k logits, softmaxed among themselves.
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                       residual_multiplier=0.22, attention_multiplier=0.05, logits_scaling=8.0,
                       tie_word_embeddings=False),
    # ERNIE 4.5's fp32 router choosing by its probabilities plus a correction bias, a
    # biased shared expert, a dense first layer.
    "ernie4_5_moe": dict(use_bias=True, moe_num_experts=4, moe_k=2, moe_intermediate_size=48,
                         moe_num_shared_experts=1, moe_layer_start_index=1, tie_word_embeddings=True),
    # DeepSeek-V3's routing: sigmoid scores, a correction bias, the best of two groups
    # (GLM-4.5, with q/k norms and a partial rotary) or no groups (dots.llm1, windowed),
    # scaled weights, a shared expert, a dense first layer.
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
                     n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True, use_qk_norm=True, attention_bias=True, head_dim=16,
                     partial_rotary_factor=0.5, tie_word_embeddings=False),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
                  n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                  norm_topk_prob=False, sliding_window=WINDOW, max_window_layers=1, attention_bias=True,
                  tie_word_embeddings=False),
    # Granite SWA: Granite's multipliers, windowed layers, a sink per head, a rope base per
    # layer and a layer without rotary (base 0); its MoE with a shared expert, with and
    # without the SWA attention.
    "granite_swa": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05,
                        logits_scaling=8.0, sliding_window=WINDOW, tie_word_embeddings=True,
                        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                        layer_rope_theta=[10000.0, 0, 500.0]),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
                             embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05,
                             logits_scaling=8.0, tie_word_embeddings=False),
    "granitemoe_swa": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
                           embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05,
                           logits_scaling=8.0, sliding_window=WINDOW, tie_word_embeddings=False,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           layer_rope_theta=[500.0, 10000.0, 0]),
    # Ministral 3: Llama 4's attention temperature past an original context shorter than the
    # prompts (so that it scales most positions), YaRN, the window on every layer.
    "ministral3": dict(sliding_window=WINDOW, head_dim=16, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                        "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.5,
                                        "rope_theta": 10000.0}),
    # HunYuan MoE: HunYuan's attention over renormalised experts and an ungated shared MLP.
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, attention_bias=True, head_dim=16, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                            "rope_theta": 10000.0}),
    # VaultGemma: Gemma 2 without its norms after attention and MLP.
    "vaultgemma": dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                       final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
    # CWM: Llama's layer, llama3 rope scaling, a window on three layers of four.
    "cwm": dict(sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                head_dim=16, tie_word_embeddings=False),
    # FlexOlmo: OLMo 2's norms over OLMoE's experts, renormalised.
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=48, norm_topk_prob=True,
                      tie_word_embeddings=False),
    # Sliding and full layers alternating, attention sinks, biased router and experts, a SwiGLU
    # clamp the scaled experts reach, YaRN.
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=WINDOW,
                    head_dim=16, swiglu_limit=2.0, tie_word_embeddings=False,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention", "linear_attention"], head_dim=32,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "linear_attention", "full_attention"], head_dim=32,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=48, shared_expert_intermediate_size=64,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                              "mrope_interleaved": True}),
    # LFM2: a short convolution first, its MLP size derived (2/3 of 192, to a multiple of 32)
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, intermediate_size=192,
                 block_multiple_of=32, block_ffn_dim_multiplier=1.0, norm_eps=1e-5, tie_word_embeddings=True),
    # LFM2-MoE: a dense first layer, then experts chosen with a bias on their sigmoid scores
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, intermediate_size=96,
                     moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                     routed_scaling_factor=1.5, norm_eps=1e-5, tie_word_embeddings=True),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention", "linear_attention"], head_dim=32,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=48, shared_expert_intermediate_size=64, norm_topk_prob=False,
                       decoder_sparse_step=1, mlp_only_layers=[1], partial_rotary_factor=0.5),
}

# Attention projections scaled up, so that the scores are far from uniform: gpt-oss's sinks,
# SmolLM3's NoPE layer, the adjacent-pair rotary of GLM, ERNIE and Helium, a norm off by one
# (Gemma, Nemotron) or left out (StarCoder2), HunYuan's q/k norms after the rotary, Granite
# SWA's sinks and per-layer bases, and Granite's, Granite MoE's and Arcee's GGUF q/k rows left as llama.cpp
# interleaves them change the tokens if the engine gets them wrong (at the initial scale every position
# weighs about the same, and the embeddings outweigh the layers).
SHARP = ("gpt_oss", "smollm3", "ernie4_5", "glm", "glm4", "cohere", "cohere2", "gemma", "nemotron", "helium",
         "starcoder2", "hunyuan_v1_dense", "granite_swa", "granitemoe_swa", "granite", "granitemoe", "granitemoeshared",
         "arcee", "hunyuan_v1_moe")


def build(model_type: str, path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**BASE, **ARCHS.get(model_type, {}), **overrides}  # llama: BASE is one
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb(model, model_type)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def perturb(model, model_type: str) -> None:
    """Every norm weight and bias moved off its initial value, and the parts whose slips
    would otherwise hide scaled up (see SHARP)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                # an LM head's bias (ERNIE 4.5 MoE) at the logits' own scale: at the others' it
                # would pick every token alone
                p.add_(torch.randn_like(p) * (0.02 if name == "lm_head.bias" else 0.3))
            if ".act_fn." in name:  # xIELU's learned shape (its alphas through softplus) off its initial one
                p.add_(torch.randn_like(p) * 0.5 if p.dim() else torch.tensor(0.0))
            if name.endswith("sinks"):  # sinks away from zero, some above the scores, some below
                p.copy_(torch.randn_like(p) * 3.0 + 3.0)
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "moe.router.weight", "feed_forward.gate.weight")):
                # a decisive router: no near tie
                p.mul_(8.0)
            expert = ".experts." in name or ".shared_expert" in name or ".shared_mlp." in name
            if expert and not name.endswith("bias"):
                p.mul_(6.0)  # experts that move the output: a routing or weighting slip shows
            if model_type in SHARP and ".self_attn." in name and name.endswith("weight"):
                p.mul_(8.0)  # attention sharp enough that what sets its positions apart shows
            if (".linear_attn." in name or ".conv." in name) and "_proj" in name:
                p.mul_(4.0)  # state-keeping layers loud enough that a state carried wrong shows
            if name.endswith(".conv.conv.weight"):
                p.mul_(16.0)  # LFM2's taps at transformers' 0.02 leave its convolution a whisper
        for name, b in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("e_score_correction_bias", "feed_forward.expert_bias")):
                # a choice bias large enough to move the choice
                b.copy_(torch.randn_like(b) * 0.5)


def word_tokenizer(out: Path, vocab_size: int) -> Path:
    """A word-level tokenizer of ids t0..t<vocab_size - 1>, saved to `out`: for checkpoints
    built where the embedded model's tokenizer is not (the gpu tier on a lent device)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(out)
    return out
