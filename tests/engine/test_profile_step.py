"""scripts/profile_step.py's StepProfile, which every `--profile` benchmark reports through:
it must keep up with the engine's internals (it broke silently once the sampler's entry
point became `verify`)."""

from __future__ import annotations


from engine import LLM, SamplingParams
from tests.support.server import ROOT


def test_step_profile_times_every_share_of_a_step(tiny_model_factory, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from profile_step import StepProfile

    llm = LLM(str(tiny_model_factory("profile-tiny")), dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=64 * 8192)
    eng = llm.engine
    eng.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with StepProfile(llm) as prof:
        while eng.has_unfinished():
            eng.step()
    s = prof.spent
    for share in ("step", "model forward", "gemm", "attention", "sampler", "input preparation"):
        assert s[share] > 0, share
    assert s["model forward"] < s["step"] and s["gemm"] + s["attention"] < s["model forward"]
    assert "sampler" in prof.report()
    sampler = eng.sampler.verify  # the wrappers are gone after the block
    assert getattr(sampler, "__func__", None) is type(eng.sampler).verify
