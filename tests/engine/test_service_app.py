"""Resolving a service config builds no engine and loads no model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


def test_resolving_a_config_builds_nothing(tiny_model_factory, monkeypatch):
    """The attention backend is chosen once, when the config resolves, and built where the
    engine builds its model (AttentionBackend.load), never while resolving a config."""
    from torch.utils import cpp_extension

    from engine.config import EngineConfig, Placement
    from engine.models import loader
    from kernels import cpu

    def no_build(*args, **kwargs):
        raise AssertionError("a build while resolving the config")

    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", no_build)
    hf_config = loader.load_config(loader.resolve(str(tiny_model_factory("dead-tiny"))))
    placement = Placement.resolve(EngineConfig.create(device="cpu", attention_backend="auto"), hf_config)
    assert placement.attention_backend.name == "native" and cpu._state == {}
    monkeypatch.undo()
    assert placement.attention_backend.load().name in ("native", "torch")
