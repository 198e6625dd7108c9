"""The folders are the layers, and imports only point down them: the core (engine/, its
models and speculation) never imports the engine client (engine/client/), the client never
imports the HTTP APIs (engine/serving/), and neither uses the serving stack (BentoML,
Starlette, Prometheus, OpenTelemetry). Read from the source, so an import hidden inside a
function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
# The serving stack: what only engine/serving/ (and service.py) may use. The `serve` extra
# installs it; the core and the engine client run without it.
SERVING_STACK = ("bentoml", "starlette", "fastapi", "uvicorn", "prometheus_client", "opentelemetry", "openai")
# a layer, and the packages above it that it must not import
ABOVE = {"core": ("engine.client", "engine.serving", *SERVING_STACK), "client": ("engine.serving", *SERVING_STACK)}


def layer(path: Path) -> str | None:
    parts = path.relative_to(ROOT / "engine").parts
    if parts[0] == "serving":
        return None  # the top: it may import anything below it
    return "client" if parts[0] == "client" else "core"


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        kind = layer(path)
        if kind is None:
            continue
        for name in imported(path):
            if any(name == top or name.startswith(top + ".") for top in ABOVE[kind]):
                upward.append(f"{path.relative_to(ROOT)} ({kind}) imports {name}")
    assert not upward, upward


def test_the_check_sees_an_upward_import(tmp_path):
    fake = ROOT / "engine" / "client" / "x.py"
    assert layer(fake) == "client"
    module = tmp_path / "x.py"
    module.write_text("def f():\n    from engine.serving.app import create_app\n    import prometheus_client\n")
    assert {"engine.serving.app", "prometheus_client"} <= imported(module)


def test_the_http_process_imports_no_torch_and_no_model():
    """`bentoml serve` imports service.py twice (its CLI, then each worker) and the engine
    runs in a process of its own: loading torch and every model there cost each import
    about 3 s, a server's start 17 s instead of 8 (benchmarks/LOG.md, session 26)."""
    import os
    import subprocess
    import sys

    code = ("import sys, service\n"
            "heavy = sorted(m for m in ('torch', 'engine.engine', 'engine.models.registry', 'engine.runner') "
            "if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PAGEDSERVE_CONFIG": str(ROOT / "config/default.yaml")})
    assert out.returncode == 0, out.stderr[-3000:]


def test_every_package_is_listed_for_the_wheel():
    """pyproject.toml lists the packages by hand; one missing there is missing from an
    installed wheel, though the source tree imports it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("engine", "kernels")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
