"""The offline API: batch generation and chat over one engine."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import EngineDeadError, ParamError
from engine.outputs import BeamSearchOutput, Collector, EmbeddingOutput, RequestOutput, ScoreOutput
from engine.pooling import PoolingParams
from engine.scoring import pairs, prompt_ids
from engine.prompts import Message, apply_chat_template
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.stats import EngineStats

class LLM:
    """`LLM(model=None)` serves the embedded SmolLM2-135M-Instruct.

    Keyword arguments are EngineConfig fields; `preset` names a YAML file in config/
    whose values they override (a `model` given here wins over the preset's).
    """

    def __init__(self, model: str | None = None, *, preset: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.config = (
            EngineConfig.from_preset(preset, **kwargs) if preset else EngineConfig.create(**kwargs)
        )
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._fault: BaseException | None = None  # what broke the engine in a step, if anything did

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Without `params`,
        the model's own defaults (`get_default_sampling_params()`), as the service gives a
        request that sets nothing."""
        self._check_alive()
        prompts = _as_list(prompts)
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params.validate()] * len(prompts)
        elif len(params) != len(prompts):
            raise ParamError("params", f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [p.validate() for p in params]

        def add(rid: str, token_ids: list[int], i: int) -> None:
            if not self.engine.add_request(rid, token_ids, params[i]):  # its constraint is compiling
                for _, error in self.engine.compiles.poll(wait=True):
                    if error is not None:
                        raise error

        return self._submit([(p if isinstance(p, str) else None, self.engine.tokenize(p)) for p in prompts], add,
                            use_tqdm)

    def embed(self, prompts: str | Sequence[str] | Sequence[list[int]], params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """One vector per prompt, in input order, pooled as the engine's pooler says
        (engine/pooling.py). The prompts run as prefills beside any other work."""
        params = (params or PoolingParams()).validate()
        if params.task != "embed":
            raise ParamError("task", "LLM.embed takes embedding PoolingParams; LLM.score scores")
        given = _as_list(prompts)
        outs = self._pool([(p if isinstance(p, str) else None, self.engine.tokenize(p)) for p in given], params,
                          use_tqdm)
        return [EmbeddingOutput(o.request_id, o.prompt, o.prompt_token_ids, o.pooled or []) for o in outs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = False
              ) -> list[ScoreOutput]:
        """Relevance of each (text_1, text_2) pair, as vLLM pairs them: one text_1 against
        every text_2, or the two lists index by index (engine/scoring.py)."""
        template = self.engine.score_template
        prompts = [(None, prompt_ids(self.tokenizer, a, b, template)) for a, b in pairs(text_1, text_2)]
        outs = self._pool(prompts, PoolingParams(task="score"), use_tqdm)
        return [ScoreOutput(o.request_id, o.prompt_token_ids, o.pooled or []) for o in outs]

    def _pool(self, prompts: list[tuple[str | None, list[int]]], params: PoolingParams, use_tqdm: bool
              ) -> list[RequestOutput]:
        self._check_alive()
        return self._submit(prompts, lambda rid, token_ids, _: self.engine.add_request(
            rid, token_ids, pooling_params=params), use_tqdm)

    def _submit(self, prompts: list[tuple[str | None, list[int]]], add: Callable[[str, list[int], int], object],
                use_tqdm: bool) -> list[RequestOutput]:
        """Queue every prompt (its text if it had one, its token ids) with `add(request_id,
        token_ids, index)`, all or none: a refused one aborts those queued before it. Then
        run them to the end, outputs in input order."""
        ids: list[str] = []
        collector = Collector()
        try:
            for i, (text, token_ids) in enumerate(prompts):
                rid = str(next(self._ids))
                add(rid, token_ids, i)
                collector.expect(rid, text, token_ids)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, collector, use_tqdm)

    def beam_search(self, prompts: str | Sequence[str] | Sequence[list[int]], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt, inside the engine (engine/beam.py): each output
        holds all beam_width finished beams, best first by cum_logprob / len ** length_penalty."""
        return [BeamSearchOutput.of(out) for out in self.generate(prompts, params.sampling_params(), use_tqdm)]

    def get_default_sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams with the model's generation_config.json values (temperature, top_p,
        top_k, min_p, repetition_penalty) for what `fields` leaves out: what the service
        applies to a request's unset fields, so the same request gives the same output
        offline and served (vLLM's `generation_config="auto"`)."""
        return SamplingParams(**{**self.engine.sampling_defaults, **fields}).validate()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.tokenizer, c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def apply_chat_template(self, conversation: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return apply_chat_template(self.tokenizer, conversation, add_generation_prompt)

    def _run(self, ids: list[str], collector: Collector, use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2)
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step().outputs:
                    out = collector.add(delta)
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except Exception as exc:
            # A step that raised left requests half-appended and batches in flight: stepping
            # again would spin on them for ever. The engine is done; say so now and later.
            self._fault = exc
            if isinstance(exc, EngineDeadError):  # a dead parallel worker says so itself
                raise
            raise EngineDeadError(f"the engine failed in a step and cannot go on: {type(exc).__name__}: {exc}"
                                  ) from exc
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def _check_alive(self) -> None:
        if self._fault is not None:
            raise EngineDeadError(f"the engine failed in an earlier step and cannot go on: "
                                  f"{type(self._fault).__name__}: {self._fault}") from self._fault

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (they also go when this process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


def _as_list(prompts: str | Sequence[str] | Sequence[list[int]]) -> list:
    """One prompt (text or token ids) or a list of them, as a list."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
