"""gpt-oss as OpenAI ships it: experts in MXFP4, dequantized at load or (`quantization:
mxfp4`) computed on as blocks. The engine's greedy output equals transformers' own on the
weights transformers' MXFP4 code dequantizes from the same bytes; damaged MXFP4 tensors
and checkpoint formats the engine does not read are refused by name. (The unquantized architecture, sinks and windows included, is checked
with the others in tests/engine/test_architectures.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine import LLM, SamplingParams
from engine.errors import ParamError
from kernels import quant
from tests.support import arch_models
from tests.support.oracle import departs_only_at_near_ties, engine_greedy, hf_greedy

PROJECTIONS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory, default_model_dir):
    """A tiny gpt-oss whose experts are random MXFP4 bytes (every nibble, scales 2^-6..2^-2),
    with the config's quantization_config as OpenAI's checkpoints carry it."""
    # MXFP4 blocks run along rows of 32: an intermediate size of 64, the hidden size 64.
    path = arch_models.build("gpt_oss", tmp_path_factory.mktemp("gpt_oss_mxfp4"), default_model_dir,
                             intermediate_size=64)
    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    for name in [n for n in weights if n.endswith(PROJECTIONS)]:
        e, k, n = weights.pop(name).shape  # stored [E, in, out]: MXFP4 holds [E, out, in / 32, 16]
        weights[f"{name}_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        weights[f"{name}_scales"] = torch.randint(121, 126, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    save_file(weights, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference(path) -> torch.nn.Module:
    """transformers' gpt-oss on the experts its MXFP4 code dequantizes from the checkpoint."""
    weights = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    plain = path.parent / "reference"
    shutil.copytree(path, plain, dirs_exist_ok=True)
    (plain / "config.json").write_text(json.dumps(config))
    for name in [n.removesuffix("_blocks") for n in weights if n.endswith("_blocks")]:
        weights[name] = convert_moe_packed_tensors(weights.pop(f"{name}_blocks"), weights.pop(f"{name}_scales"),
                                                   dtype=torch.float32)
    save_file(weights, plain / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()


def test_mxfp4_experts_match_transformers_dequantized(mxfp4_dir):
    hf = reference(mxfp4_dir)
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(3, 49152, (4, 30), generator=gen).tolist()  # 30 > the 12-token window
    with LLM(str(mxfp4_dir), dtype="float32", max_model_len=64, block_size=8) as llm:
        assert engine_greedy(llm, prompts, 12, ignore_eos=True) == hf_greedy(hf, prompts, 12, None)
        stats = llm.stats()
        assert stats.blocks_free == stats.blocks_total


def test_mxfp4_experts_compute_on_their_own_blocks(mxfp4_dir):
    """`quantization: mxfp4` keeps the experts as MXFP4 blocks (GGML's layout, which the
    kernels read) and never writes them dense: transformers' tokens on the same values,
    biases included; `auto` picks it in fp32; a checkpoint without MXFP4 experts is refused."""
    hf = reference(mxfp4_dir)
    prompts = torch.randint(3, 49152, (4, 30), generator=torch.Generator().manual_seed(11)).tolist()
    with LLM(str(mxfp4_dir), dtype="float32", max_model_len=64, block_size=8, quantization="mxfp4") as llm:
        moe = llm.engine.executor.runner.model.layers[0].mlp
        assert moe.experts_gate_up is None and moe.experts_down is None
        gate_up, down = moe.expert_modules[0]
        assert (gate_up.qtype, down.qtype) == (quant.MXFP4, quant.MXFP4) and gate_up.bias is not None
        assert gate_up.qweight.shape == (2 * 64, 64 // 32 * 17)  # [2 I, hidden / 32 blocks of 17 bytes]
        assert engine_greedy(llm, prompts, 12, ignore_eos=True) == hf_greedy(hf, prompts, 12, None)
    with LLM(str(mxfp4_dir), dtype="float32", max_model_len=64, quantization="auto") as llm:
        assert llm.engine.config.quantization == "mxfp4"
    # A bf16 model over the same blocks parts from the dense bf16 one only at near-ties.
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    runs = []
    for quantization in (None, "mxfp4"):
        with LLM(str(mxfp4_dir), dtype="bfloat16", max_model_len=64, block_size=8, quantization=quantization) as llm:
            runs.append([o.outputs[0] for o in llm.generate(prompts, p, use_tqdm=False)])
    departs_only_at_near_ties(*runs)
    with pytest.raises(ParamError) as e:  # reference() wrote the same model with dense experts
        LLM(str(mxfp4_dir.parent / "reference"), dtype="float32", max_model_len=64, quantization="mxfp4")
    assert e.value.param == "quantization" and "has none" in str(e.value)


def damaged(src, tmp_path, change) -> str:
    path = tmp_path / "damaged"
    shutil.copytree(src, path)
    weights = load_file(path / "model.safetensors")
    change(weights)
    save_file(weights, path / "model.safetensors")
    return str(path)


def test_damaged_mxfp4_tensors_are_refused_by_name(mxfp4_dir, tmp_path):
    name = "model.layers.1.mlp.experts.gate_up_proj"

    def nan_scale(w):  # 255 is NaN in E8M0
        w[f"{name}_scales"][0, 3, 0] = 255

    def overflowing(w):  # 2^127 times a 6 overflows fp32
        w[f"{name}_scales"][2, 0, 1] = 254
        w[f"{name}_blocks"][2, 0, 1] = 0x77

    def unpaired(w):
        del w[f"{name}_scales"]

    for change, words in ((nan_scale, "NaN in E8M0"), (overflowing, "out of range"), (unpaired, "missing")):
        path = damaged(mxfp4_dir, tmp_path / change.__name__, change)
        for quantization in (None, "mxfp4"):  # dequantized, or kept as blocks
            with pytest.raises(ParamError) as e:
                LLM(path, dtype="float32", max_model_len=64, quantization=quantization)
            assert e.value.param == "model" and "layers.1.mlp.experts.gate_up_proj" in str(e.value), str(e.value)
            assert words in str(e.value), str(e.value)


def test_a_checkpoint_format_not_read_and_a_bad_top_k_are_refused(mxfp4_dir, tmp_path):
    path = tmp_path / "gptq"
    shutil.copytree(mxfp4_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_model_len=64)
    assert e.value.param == "model" and "'gptq'" in str(e.value) and "mxfp4" in str(e.value)
    config["quantization_config"] = json.loads((mxfp4_dir / "config.json").read_text())["quantization_config"]
    config["num_experts_per_tok"] = 5  # of 4 experts
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_model_len=64)
    assert e.value.param == "model" and "num_experts_per_tok (5)" in str(e.value)
