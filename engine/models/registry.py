"""Which model class serves which checkpoint: by the config's model_type, the key
transformers itself dispatches on."""

from __future__ import annotations

from engine.errors import ParamError
from engine.models.arch import LinearAttnSpec, ShortConvSpec
from engine.models.apertus import ApertusForCausalLM
from engine.models.arcee import ArceeForCausalLM
from engine.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from engine.models.decoder import DecoderForCausalLM
from engine.models.dots1 import Dots1ForCausalLM
from engine.models.ernie4_5 import Ernie4_5ForCausalLM
from engine.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from engine.models.exaone4 import Exaone4ForCausalLM
from engine.models.gemma import GemmaForCausalLM
from engine.models.gemma2 import Gemma2ForCausalLM, VaultGemmaForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.glm import Glm4ForCausalLM, GlmForCausalLM
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.granite import GraniteForCausalLM, GraniteSwaForCausalLM
from engine.models.granitemoe import GraniteMoeForCausalLM, GraniteMoeSwaForCausalLM
from engine.models.helium import HeliumForCausalLM
from engine.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from engine.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from engine.models.llama import CwmForCausalLM, LlamaForCausalLM
from engine.models.ministral import Ministral3ForCausalLM, MinistralForCausalLM
from engine.models.mistral import MistralForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.nemotron import NemotronForCausalLM
from engine.models.olmo2 import Olmo2ForCausalLM
from engine.models.olmoe import FlexOlmoForCausalLM, OlmoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.seed_oss import SeedOssForCausalLM
from engine.models.smollm3 import SmolLM3ForCausalLM
from engine.models.stablelm import StableLmForCausalLM
from engine.models.starcoder2 import Starcoder2ForCausalLM

ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "internlm3": LlamaForCausalLM,  # transformers runs InternLM3 as Llama (qkv_bias, bias as its two biases)
    "helium": HeliumForCausalLM,
    "hunyuan_v1_dense": HunYuanDenseV1ForCausalLM,
    "mistral": MistralForCausalLM,
    "ministral": MinistralForCausalLM,
    "ministral3": Ministral3ForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma": GemmaForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "olmo3": Olmo2ForCausalLM,  # OLMo 2's layer; its windows and per-type rope come from its config
    "smollm3": SmolLM3ForCausalLM,
    "exaone4": Exaone4ForCausalLM,
    "seed_oss": SeedOssForCausalLM,
    "ernie4_5": Ernie4_5ForCausalLM,
    "glm": GlmForCausalLM,
    "glm4": Glm4ForCausalLM,
    "cohere": CohereForCausalLM,
    "cohere2": Cohere2ForCausalLM,
    "granite": GraniteForCausalLM,
    "arcee": ArceeForCausalLM,
    "apertus": ApertusForCausalLM,
    "starcoder2": Starcoder2ForCausalLM,
    "nemotron": NemotronForCausalLM,
    "stablelm": StableLmForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "granitemoe": GraniteMoeForCausalLM,
    "granitemoeshared": GraniteMoeForCausalLM,  # its shared expert: shared_intermediate_size
    "granite_swa": GraniteSwaForCausalLM,
    "granitemoe_swa": GraniteMoeSwaForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "ernie4_5_moe": Ernie4_5_MoeForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "dots1": Dots1ForCausalLM,
    "vaultgemma": VaultGemmaForCausalLM,
    "cwm": CwmForCausalLM,
    "flex_olmo": FlexOlmoForCausalLM,
    "hunyuan_v1_moe": HunYuanMoEV1ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "lfm2": Lfm2ForCausalLM,
    "lfm2_moe": Lfm2MoeForCausalLM,
}
# Multimodal configs whose language model we serve: their text config is the model's.
TEXT_OF = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def model_class(config) -> type[DecoderForCausalLM]:
    """The class for a (text) config; a ParamError naming the architecture otherwise."""
    cls = ARCHITECTURES.get(config.model_type)
    if cls is None:
        names = ", ".join(getattr(config, "architectures", None) or []) or "?"
        raise ParamError("model", f"model type {config.model_type!r} ({names}) is not supported; "
                         f"supported: {', '.join(sorted(ARCHITECTURES) + sorted(TEXT_OF))}")
    return cls


def layer_windows(config) -> tuple[int, ...]:
    """Each KV layer's sliding window, 0 where it sees the whole sequence (state-keeping
    layers keep no KV, and have none)."""
    spec = model_class(config).spec(config)
    return tuple(spec.windows[i] for i in spec.kv_layers(config.num_hidden_layers))


def state_layers(config) -> LinearAttnSpec | ShortConvSpec | None:
    """The model's layers that keep a state per sequence instead of KV; None for none."""
    return model_class(config).spec(config).stateful


def text_config(config):
    """The config the decoder is built from: a multimodal config's text part, whose
    model_type the registry knows."""
    if config.model_type in TEXT_OF:
        text = config.get_text_config()
        text.architectures = getattr(config, "architectures", None)
        return text
    return model_class(config).engine_config(config)
