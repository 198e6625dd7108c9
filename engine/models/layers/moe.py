"""The mixture-of-experts MLP: a router picks each token's top-k experts, and each
expert runs once over the tokens routed to it, so a step reads the weights of the experts
its tokens chose and no others (at batch 1, k experts a layer).

The arithmetic follows transformers' expert loop operation for operation, so fp32 greedy
output matches it: probabilities in fp32, top-k, optional renormalisation, the weights
rounded to the activation dtype where the architecture does so; experts in ascending
order, each over its tokens in (choice, token) order, its weighted output added into
the result with index_add. Under tensor parallelism every rank holds every expert's
slice of the intermediate size (as the dense MLP splits it) and the partial sums are
all-reduced once: routing needs no communication, and no rank idles when the tokens
crowd onto a few experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel
from engine.models.arch import MoESpec
from engine.models.layers.mlp import ACTIVATIONS, MLP


class Fp32Router(nn.Module):
    """A router whose weight (and choice bias) stay fp32 whatever dtype the model is cast
    to, as transformers keeps DeepSeek-V3-style and ERNIE routers: a bf16 copy would move
    near-tied scores and so change which experts a token gets. A cast of the model moves
    it to the new device only (and it is no nn.Linear, so nothing packs or quantizes it)."""

    def __init__(self, hidden: int, experts: int, choice_bias: bool) -> None:
        super().__init__()
        self.in_features = hidden
        self.weight = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)
        # added to the scores for the choice of experts only (e_score_correction_bias)
        self.choice_bias = nn.Parameter(torch.zeros(experts), requires_grad=False) if choice_bias else None

    def _apply(self, fn, recurse: bool = True):
        device = fn(torch.zeros(())).device  # the cast's device; its dtype is not this router's
        for p in self.parameters():
            p.data = p.data.to(device=device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, spec: MoESpec, act: str, tp: parallel.Group) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.act, self.act_name = ACTIVATIONS[act], act
        self.inter_range = parallel.split(spec.inter, tp.size, tp.rank)
        self.inter = self.inter_range[1] - self.inter_range[0]
        if spec.fp32_router:
            self.gate: nn.Module = Fp32Router(hidden, spec.experts, spec.choice_bias)
        else:
            self.gate = nn.Linear(hidden, spec.experts, bias=spec.router_bias)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(spec.experts, 2 * self.inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(spec.experts, hidden, self.inter))
        if spec.expert_bias:  # gpt-oss; the down bias on tensor rank 0 only, as the dense layers'
            self.experts_gate_up_bias = nn.Parameter(torch.empty(spec.experts, 2 * self.inter))
            self.experts_down_bias = nn.Parameter(torch.empty(spec.experts, hidden))
        if spec.shared_inter:
            self.shared_expert = MLP(hidden, spec.shared_inter, act, spec.shared_bias, tp)
            if spec.shared_gated:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # each expert's two projections as prepacked GEMMs, once packed (CPU: engine/models/packed_linear.py)
        self.packed: list[tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = []
        # `quantization: mxfp4`: each expert's checkpoint MXFP4 rows as GGML blocks, by
        # projection, until engine/models/quantize.py computes on them
        self.kept_mxfp4: dict[str, list[torch.Tensor]] = {}
        # every expert's gate/up and down panels stacked, for one native call a layer
        self.native: tuple[torch.Tensor, torch.Tensor] | None = None

    def pack(self) -> None:
        """Prepack every expert's weights for oneDNN or the native GEMM, as the dense
        layers are (a small expert GEMM gains most from it), and drop the 3-D originals.
        Where the native GEMM takes the dtype and the experts are plain silu GLUs, all of
        them run in one call a layer (kernels/csrc/gemm.cpp moe_glu)."""
        from engine.models.packed_linear import PackedLinear
        from kernels import cpu, pages

        w = self.experts_gate_up
        kp = 2 if w.dtype == torch.bfloat16 else 1  # bf16 panels take k in pairs
        if (cpu.gemm_available(w.dtype) and self.act_name == "silu" and not self.spec.expert_bias
                and not self.spec.swiglu_limit and w.shape[2] % kp == 0 and self.inter % kp == 0):
            self.native = (pages.move(torch.stack([cpu.gemm_pack_glu(w[e]) for e in range(self.spec.experts)])),
                           pages.move(torch.stack([cpu.gemm_pack(self.experts_down[e])
                                                   for e in range(self.spec.experts)])))
            self.experts_gate_up = None
            self.experts_down = None
            return
        self.packed = [(PackedLinear(self.experts_gate_up[e], self.expert_bias("gate_up", e)).forward,
                        PackedLinear(self.experts_down[e], self.expert_bias("down", e)).forward)
                       for e in range(self.spec.experts)]
        self.experts_gate_up = None
        self.experts_down = None

    def use_experts(self, experts: list[tuple[nn.Module, nn.Module]]) -> None:
        """Each expert's (gate_up, down) as given modules (engine/models/quantize.py's
        quantized ones), in place of the stacked weights, which are dropped."""
        self.expert_modules = nn.ModuleList(nn.ModuleList(pair) for pair in experts)
        self.packed = [(gate_up.forward, down.forward) for gate_up, down in experts]
        self.experts_gate_up = None
        self.experts_down = None

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's dense gate_up [2 I, hidden] and down [hidden, I], before packing."""
        return self.experts_gate_up[e], self.experts_down[e]

    def expert_bias(self, which: str, e: int) -> torch.Tensor | None:
        """Expert e's gate_up or down bias (gpt-oss), None where experts have none."""
        return getattr(self, f"experts_{which}_bias")[e] if self.spec.expert_bias else None

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, or gpt-oss's clamped SwiGLU, on [gate | up] rows."""
        gate, up = gate_up.chunk(2, dim=-1)
        limit = self.spec.swiglu_limit
        if not limit:
            return self.act(gate) * up
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.spec.swiglu_alpha))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [n, k] and their weights [n, k]."""
        if self.spec.softmax_topk:  # gpt-oss, Granite MoE: the k best logits, softmaxed among themselves
            logits = self.gate(x)
            top, experts = torch.topk(logits.float() if self.spec.router_fp32 else logits, self.spec.top_k, dim=-1)
            return experts, F.softmax(top, dim=1, dtype=top.dtype).to(x.dtype)
        spec = self.spec
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if spec.scoring == "sigmoid" else F.softmax(logits, dim=-1)
        if spec.choice_bias or spec.groups > 1:
            experts = self._choose(scores)
            weights = scores.gather(1, experts)
        else:
            weights, experts = torch.topk(scores, spec.top_k, dim=-1)
        if spec.norm_topk:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total.clamp(min=spec.norm_min) if spec.norm_min else
                                 total + spec.norm_eps if spec.norm_eps else total)
        if spec.routed_scale != 1.0:
            weights = weights * spec.routed_scale
        return experts, (weights.to(x.dtype) if spec.weights_in_dtype else weights)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Each token's top-k experts by their scores plus the choice bias, among the experts
        of its best `topk_groups` groups (a group ranked by its two best such scores):
        DeepSeek-V3's selection, whose top-k transformers takes unsorted."""
        spec = self.spec
        choice = scores + self.gate.choice_bias if spec.choice_bias else scores
        if spec.groups > 1:
            per = spec.experts // spec.groups
            ranked = choice.view(-1, spec.groups, per).topk(2, dim=-1)[0].sum(dim=-1)
            kept = torch.topk(ranked, spec.topk_groups, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(ranked).scatter_(1, kept, 1.0).bool().repeat_interleave(per, dim=1)
            choice = choice.masked_fill(~mask, float("-inf"))
        return torch.topk(choice, spec.top_k, dim=-1, sorted=spec.scoring != "sigmoid")[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        n, k = experts.shape
        if self.native is not None:
            out = self._native(x, experts, weights)
        elif n == 1 and self.packed:
            out = self._one_token(x, experts[0].tolist(), weights[0])
        else:
            out = self._grouped(x, experts, weights)
        out = self.tp.all_reduce(out)
        if self.spec.shared_inter:
            shared = self.shared_expert(x)
            out = out + (torch.sigmoid(self.shared_expert_gate(x)) * shared if self.spec.shared_gated else shared)
        return out

    def _one_token(self, x: torch.Tensor, experts: list[int], weights: torch.Tensor) -> torch.Tensor:
        """A decode step of one sequence: its k experts in ascending order, each output
        weighted and added as _grouped's index_add adds them (the same operations, so the
        same bits), without the sort, the gather and the scatter that a batch needs."""
        out = None
        for j in sorted(range(len(experts)), key=experts.__getitem__):
            gate_up, down = self.packed[experts[j]]
            y = down(self.glu(gate_up(x))) * weights[j]
            out = y if out is None else out.add_(y)
        return out

    def _by_expert(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(choice, token) pairs grouped by expert with a stable sort, transformers' order:
        the pairs' order, each expert's pair count, each pair's token. The gather, the
        weighting and the sum then run once over every pair (_combine)."""
        flat = experts.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        return order, torch.bincount(flat, minlength=self.spec.experts), order % experts.shape[0]

    @staticmethod
    def _combine(x: torch.Tensor, ys: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                 tokens: torch.Tensor) -> torch.Tensor:
        """The pairs' outputs weighted and summed per token: one index_add in the pairs'
        order adds each token's expert outputs in transformers' order."""
        ys = ys * weights.t().reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, ys.to(x.dtype))

    def _native(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """_grouped with every expert's MLP in one native call."""
        from kernels import cpu

        order, counts, tokens = self._by_expert(experts)
        ys = cpu.moe_glu(x[tokens], F.pad(counts.cumsum(0), (1, 0)), *self.native, x.shape[-1])
        return self._combine(x, ys, weights, order, tokens)

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order, counts, tokens = self._by_expert(experts)
        xs = x[tokens]
        ys = torch.empty_like(xs)
        start = 0
        for e, count in enumerate(counts.tolist()):
            if not count:
                continue
            rows = xs[start:start + count]
            if self.packed:
                gate_up, down = self.packed[e]
                ys[start:start + count] = down(self.glu(gate_up(rows)))
            else:
                h = self.glu(F.linear(rows, self.experts_gate_up[e], self.expert_bias("gate_up", e)))
                ys[start:start + count] = F.linear(h, self.experts_down[e], self.expert_bias("down", e))
            start += count
        return self._combine(x, ys, weights, order, tokens)
