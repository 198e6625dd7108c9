"""The MLP of every dense architecture: gated, down(act(gate) * up), or plain, down(act(up))
(Arcee's ReLU², StarCoder2's GELU, Apertus's xIELU, whose parameters each layer learns)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "relu2": lambda x: torch.square(F.relu(x))}


class XIELU(nn.Module):
    """xIELU (Apertus): beta x plus alpha_p x² above zero and alpha_n (expm1(min(x, eps)) - x)
    below, its two alphas learned through softplus; in the model's dtype, as the reference
    computes it. beta and eps are parameters here so that the loader fills them."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.beta = nn.Parameter(torch.zeros(()), requires_grad=False)
        self.eps = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


class MLP(nn.Module):
    """Column-parallel gate/up over this rank's slice of the intermediate size, row-parallel
    down. `gate_up_proj` is the first GEMM: gate and up stacked, or up alone where the MLP
    is not gated, so that every path that packs, quantizes or reads a GGUF's blocks into
    it treats both kinds alike; `pieces` says which checkpoint tensors it holds."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, tp: parallel.Group,
                 gated: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.act_name = act
        if act == "xielu":  # a module: its parameters are the checkpoint's (`act_fn.*`), per layer
            self.act_fn = XIELU()
            self.act = self.act_fn.forward  # a bound method, not the module registered a second time
        else:
            self.act = ACTIVATIONS[act]
        self.gated = gated
        self.pieces = ("gate_proj", "up_proj") if gated else ("up_proj",)
        self.intermediate = intermediate  # every rank's together: where up starts in a fused checkpoint tensor
        self.inter_range = parallel.split(intermediate, tp.size, tp.rank)
        self.inter = self.inter_range[1] - self.inter_range[0]
        self.gate_up_proj = nn.Linear(hidden, len(self.pieces) * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, hidden, bias=bias)

    @property
    def glu(self) -> bool:
        """Whether gate_up_proj returns silu(gate) * up itself (PackedLinear with glu)."""
        return bool(getattr(self.gate_up_proj, "glu", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))
        if self.glu:
            return self.tp.all_reduce(self.down_proj(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act(gate) * up))
