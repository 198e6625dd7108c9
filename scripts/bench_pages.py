"""Huge pages against 4 KiB pages for the tensors a CPU step streams (kernels/pages.py): the
packed weights, quantized blocks and stacked expert panels, in one process.

The engine loads once with those tensors on huge pages, as it always does; a second copy
of each is made with torch's own allocator (4 KiB pages where the kernel's THP setting is
`madvise`), and the two take turns under the same workload: every round runs both, in
alternating order, after one untimed run of each. Each round's ratio and both sides'
spreads are printed. The peer is our own engine on the same weights, dtype and knobs, so
the ratio is the pages' share alone.

    python scripts/bench_pages.py --shape qwen3-1.7b --dtype bfloat16 --num-requests 16 --rounds 4
    python scripts/bench_pages.py --model /tmp/q17-q4km.gguf --quantization gguf-a8 --num-requests 1 --rounds 4
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.llm import LLM  # noqa: E402
from engine.models.layers.moe import SparseMoE  # noqa: E402
from engine.models.packed_linear import PackedLinear  # noqa: E402
from engine.models.quantize import QuantLinear  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import pages  # noqa: E402


def huge_kib() -> int:
    """This process's anonymous memory on huge pages, in KiB."""
    return int(Path("/proc/self/smaps_rollup").read_text().split("AnonHugePages:")[1].split()[0])


def placements(llm: LLM) -> tuple[dict[str, Callable[[], None]], int]:
    """A setter for each placement ("huge" as loaded, "4k" a torch copy) and the bytes moved."""
    runner = llm.engine.executor.runner
    setters: list[Callable[[bool], None]] = []
    moved = 0

    def keep(get: Callable[[], torch.Tensor], put: Callable[[torch.Tensor], None]) -> None:
        nonlocal moved
        huge = get()
        small = huge.clone()
        moved += huge.numel() * huge.element_size()
        setters.append(lambda on_huge: put(huge if on_huge else small))

    for mod in runner.model.modules():
        if isinstance(mod, PackedLinear) and mod.panels is not None:
            keep(lambda m=mod: m.panels, lambda t, m=mod: setattr(m, "panels", t))
        elif isinstance(mod, QuantLinear):
            def put(t: torch.Tensor, m: QuantLinear = mod) -> None:
                m.qweight = t
                m._plain()  # forward reads its buffers through this tuple
            keep(lambda m=mod: m.qweight, put)
        elif isinstance(mod, SparseMoE) and mod.native is not None:
            for i in range(2):
                def put_native(t: torch.Tensor, m: SparseMoE = mod, i: int = i) -> None:
                    m.native = (t, m.native[1]) if i == 0 else (m.native[0], t)
                keep(lambda m=mod, i=i: m.native[i], put_native)

    def place(on_huge: bool) -> Callable[[], None]:
        def apply() -> None:
            for setter in setters:
                setter(on_huge)
        return apply

    return {"huge": place(True), "4k": place(False)}, moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or GGUF; default: the embedded SmolLM2-135M")
    ap.add_argument("--shape", default=None, choices=["qwen3-0.6b", "qwen3-1.7b", "qwen3-moe-1.2b"],
                    help="random weights of this shape (scripts/model_shapes.py) instead of --model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="", help="gguf, int8 or mxfp4; an -a8 suffix adds int8_activations")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()

    model, load_format = args.model, "auto"
    if args.shape:
        from model_shapes import write

        model, load_format = str(write(args.shape, Path(tempfile.mkdtemp()) / args.shape)), "dummy"
    if not pages.available():
        sys.exit("this kernel gives no transparent huge pages (kernels/pages.py): nothing to compare")
    mode = args.quantization.removesuffix("-a8")
    llm = LLM(model, dtype=args.dtype, load_format=load_format, quantization=mode or None,
              int8_activations=args.quantization.endswith("-a8"), enable_prefix_caching=False)
    setters, moved = placements(llm)
    print(f"THP: {pages.THP_SETTING.read_text().strip()}; {moved / 1e9:.2f} GB of streamed tensors in each "
          f"placement; {huge_kib() / 1e6:.2f} GB of this process on huge pages")
    rng = random.Random(0)
    vocab = llm.engine.executor.runner.model.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)] * args.num_requests
    produced = args.num_requests * args.new_tokens

    def run(name: str) -> float:
        setters[name]()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rate = produced / (time.perf_counter() - start)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == produced
        return rate

    for name in ("huge", "4k"):
        run(name)  # untimed: each placement's first pass
    rates: dict[str, list[float]] = {"huge": [], "4k": []}
    for r in range(args.rounds):
        order = ("huge", "4k") if r % 2 == 0 else ("4k", "huge")
        got = {name: run(name) for name in order}
        for name, rate in got.items():
            rates[name].append(rate)
        print(f"round {r + 1}: huge {got['huge']:.1f} tok/s, 4k {got['4k']:.1f} tok/s, "
              f"ratio {got['huge'] / got['4k']:.3f}", flush=True)
    for name, got in rates.items():
        print(f"{name:5s} {min(got):.1f}-{max(got):.1f} tok/s, spread {(max(got) - min(got)) / max(got):.1%}")
    ratios = sorted(h / s for h, s in zip(rates["huge"], rates["4k"]))
    print(f"huge / 4k per round: {', '.join(f'{x:.3f}' for x in ratios)}")


if __name__ == "__main__":
    main()
