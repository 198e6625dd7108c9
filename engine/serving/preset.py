"""The serving preset: the engine section is an EngineConfig, the service section is ours.

One YAML file picks everything a deployment tunes, so `PAGEDSERVE_CONFIG=config/gpu.yaml`
is the only switch between a laptop and a GPU box. EngineConfig forbids unknown keys,
so the service section is validated here by its own strict model.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import PRESET_DIR, EngineConfig, read_preset
from engine.errors import ParamError
from engine.models import DEFAULT_MODEL_TAG

CONFIG_ENV = "PAGEDSERVE_CONFIG"
DEFAULT_PRESET = PRESET_DIR / "default.yaml"


class TrafficConfig(BaseModel):
    """BentoML traffic settings for the one service (per replica)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout: float = Field(600.0, gt=0, description="seconds until the first response byte")
    concurrency: int | None = Field(64, ge=1, description="requests a replica is meant to hold at once")
    max_concurrency: int | None = Field(None, ge=1, description="beyond this, requests get 429")
    external_queue: bool | None = Field(None, description="BentoCloud: hold requests past concurrency in its "
                                        "queue while it scales out, instead of sending them to a busy replica")


class ResourcesConfig(BaseModel):
    """What one replica asks of its node: BentoCloud picks an instance type from it and
    scripts/k8s_manifest.py turns it into the pod's requests and limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu: str | None = Field(None, description="cores, e.g. \"2\" or \"500m\"")
    memory: str | None = Field(None, description="e.g. \"8Gi\"")
    gpu: int | None = Field(None, ge=1, description="GPUs per replica: tensor_parallel_size x pipeline_parallel_size")
    gpu_type: str | None = Field(None, description="a BentoCloud GPU type, e.g. nvidia-l4 (a hint for the instance)")


class QueueConfig(BaseModel):
    """Bounds on requests waiting for their first token (engine/client/admission.py):
    past either, a request gets 429 with Retry-After instead of an unbounded wait."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_waiting_requests: int | None = Field(256, ge=1, description="None: no bound")
    max_waiting_tokens: int | None = Field(65536, ge=1, description="their prompt tokens; None: no bound")


class CORSConfig(BaseModel):
    """Which browser origins may call the API (Starlette's CORSMiddleware). None by default:
    a browser page on another origin gets no CORS headers and its preflights a 405. Give
    origins (or ["*"]) to open it; preflights never need the API key, the requests they
    announce do."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_origins: list[str] = Field(default_factory=list, description="e.g. [\"https://app.example\"], or [\"*\"]")
    allow_methods: list[str] = Field(default_factory=lambda: ["GET", "POST"])
    allow_headers: list[str] = Field(default_factory=lambda: ["Authorization", "Content-Type", "X-Request-Timeout",
                                                              "traceparent", "tracestate"])
    max_age: int = Field(600, ge=0, description="seconds a browser may cache a preflight's answer")


class ResponsesStoreConfig(BaseModel):
    """Bounds on the Responses API's stored responses (engine/serving/responses/store.py),
    kept in memory per worker and lost on restart; the oldest go first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_responses: int = Field(1000, ge=0, description="responses kept; 0 stores none")
    max_bytes: int = Field(64 << 20, ge=0, description="their JSON, with the conversations they continue")
    max_age_s: float = Field(3600.0, gt=0, description="seconds a stored response lives")
    max_responses_per_key: int | None = Field(250, ge=0, description="responses one API key may keep; past it "
                                              "its own oldest go, never another key's; None: no bound")
    max_bytes_per_key: int | None = Field(16 << 20, ge=0, description="the memory one API key's responses may "
                                          "take; None: no bound")


class ServiceConfig(BaseModel):
    """What the HTTP layer needs that the engine does not."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str | None = Field(
        None, description="the `model` clients send; None = the stored model's name, else the engine's"
    )
    model_tag: str = Field(DEFAULT_MODEL_TAG, description="BentoML model store tag to serve when present")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="larger request bodies get 413")
    protect_ops_routes: bool = Field(False, description="/stats and /metrics need the API key too")
    drain_timeout: float = Field(60.0, ge=0, description="on SIGTERM, seconds running requests get to finish")
    max_sequences_per_request: int = Field(256, ge=1, description="prompts x n in one request: past it, 400, "
                                           "so one request cannot fill the waiting queue for everyone")
    max_in_flight_per_key: int | None = Field(None, ge=1, description="requests one API key may have running "
                                              "at once (429 past it); None: no bound per key")
    prefix_cache_scope: Literal["per_key", "shared"] = Field(
        "per_key", description="per_key: each API key's prompts hit only its own prefix-cache blocks, so "
        "cached_tokens tells nothing of another key's prompts; shared: one cache for all keys (one party)")
    core_stall_timeout_s: float | None = Field(
        60.0, gt=0, description="/livez and /health answer 503 once the engine core has been silent this long "
        "(stuck inside one step; it speaks at least every second otherwise); None: never")
    request_timeout: float | None = Field(None, gt=0, description="seconds before a request is aborted (408); "
                                          "a client's X-Request-Timeout header may shorten it")
    unknown_fields: Literal["reject", "warn"] = Field(
        "warn", description="a request field this server does not know: `reject` answers 400 naming it (as "
        "OpenAI does); `warn` drops it, logs it and names it in the X-Ignored-Fields header (as vLLM does), "
        "so clients that send their own extras (LangChain, LlamaIndex, Open WebUI) work unchanged")
    responses_store: ResponsesStoreConfig = ResponsesStoreConfig()
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "granite", "command_r", "pythonic", "qwen3_xml",
                              "glm45"] | None = Field(
        None, description="the format the model writes tool calls in; None: the one its chat template teaches "
        "(hermes when it says nothing)")
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None, description="split a <think> block into reasoning_content (chat) and a reasoning item (responses): "
        "qwen3 when the model opens the block itself, deepseek_r1 when the chat template opens it")
    metrics_prefix: str = Field("vllm", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the /metrics series' "
                                "prefix: vLLM's by default, so its dashboards and the Gateway API inference "
                                "extension read them unchanged")
    traffic: TrafficConfig = TrafficConfig()
    queue: QueueConfig = QueueConfig()
    cors: CORSConfig = CORSConfig()
    # Engines per replica: each BentoML worker runs its own engine and KV cache; on the CPU
    # each takes an equal share of the cores. On GPUs keep 1 (BentoML hands every worker the
    # same GPUs) and scale with replicas, or split a model with tensor_parallel_size.
    workers: int = Field(1, ge=1)
    resources: ResourcesConfig = ResourcesConfig()


class ServingPreset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig
    service: ServiceConfig = ServiceConfig()

    @model_validator(mode="after")
    def _gpus_cover_the_ranks(self) -> "ServingPreset":
        ranks = self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size
        gpus = self.service.resources.gpu
        if self.engine.device == "cuda" and gpus is not None and gpus < ranks:
            raise ValueError(f"service.resources.gpu ({gpus}) is less than tensor_parallel_size x "
                             f"pipeline_parallel_size ({ranks}): each rank needs its own GPU")
        return self


def load_preset(name_or_path: str | os.PathLike | None = None) -> ServingPreset:
    """An explicit preset, else $PAGEDSERVE_CONFIG, else config/default.yaml; a bad key or
    value raises ParamError naming it."""
    raw = name_or_path or os.environ.get(CONFIG_ENV) or DEFAULT_PRESET
    data = read_preset(raw)
    engine = EngineConfig.create(**(data.get("engine") or {}))
    try:
        return ServingPreset(engine=engine, service=data.get("service") or {},
                             **{k: v for k, v in data.items() if k not in ("engine", "service")})
    except ValidationError as e:
        errs = e.errors()
        msgs = [f"{'.'.join(str(p) for p in err['loc']) or 'preset'}: {err['msg']}" for err in errs]
        where = ".".join(str(p) for p in errs[0]["loc"]) or "preset"
        raise ParamError(where, f"invalid serving preset {raw}: " + "; ".join(msgs)) from None
