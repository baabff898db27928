"""A GPT-2-shaped language model in plain PyTorch, for the GPU check where ``transformers`` is not installed.

The shape of GPT-2 small (124 M parameters with the defaults): learned token and position embeddings, pre-norm
blocks of causal self-attention and a GELU MLP, a final LayerNorm and an output head tied to the token embedding,
initialised as GPT-2 is (normal, std 0.02; the residual projections scaled by ``1 / sqrt(2 * layers)``). No
dropout: the GPU check compares runs step by step, and dropout would draw from the generators. What it is for is
the load a transformer puts on gsync (many parameters of mixed sizes, a tied parameter, attention kernels),
not GPT-2's numbers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ("GPT2Shaped",)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Shaped(nn.Module):
    """``model(tokens)`` -> logits of shape ``(batch, length, vocab)``; ``tokens`` are int64 of shape ``(batch, length)``."""

    def __init__(self, vocab: int = 50257, context: int = 1024, width: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif parameter.dim() > 1:
                # GPT-2's scheme: the projections that add into the residual stream shrink with depth.
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(parameter, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
