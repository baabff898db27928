"""nanoGPT's model and recipe, character-level, trained by gsync and by a plain PyTorch loop: the same losses.

    python examples/nanogpt_char.py                 # 2 virtual CPU devices, a few seconds
    python examples/nanogpt_char.py --steps 100     # longer

The model is written as nanoGPT's model.py (a tied embedding and head, ``forward(idx, targets)`` returning
``(logits, loss)``) with its ``configure_optimizers`` as it is there: AdamW with weight decay on the matrices
only, grouped over ``named_parameters()``. gsync takes that method as the optimizer in one line,
``optimizer=lambda model: model.configure_optimizers(...)``: a factory whose first parameter is named ``model`` is
given each device's replica. The recipe is nanoGPT's train.py's: linear warmup then cosine decay, gradient
clipping at 1.0, gradient accumulation over 2 batches.

The text is made here (sentences drawn from a small grammar, seeded), so the example needs no download. Both runs
see the same batches; each line prints gsync's loss beside the plain loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
import math
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import gsync


# -- the text, made here ----------------------------------------------------------------------------------------


def make_text(sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the old man", "my sister", "a small bird", "the queen"]
    verbs = ["sees", "chases", "likes", "finds", "follows", "paints"]
    objects = ["the moon", "a red ball", "the river", "an apple", "the garden", "a paper boat"]
    endings = [".", "!", " today.", " at night.", " again."]
    return " ".join(
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}{rng.choice(endings)}" for _ in range(sentences)
    )


# -- the model, as nanoGPT's model.py ---------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(), nn.Linear(4 * n_embd, n_embd, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_embd: int = 32, n_head: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=False),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # type: ignore[union-attr]  # weight tying, as nanoGPT
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # type: ignore[operator]
        for block in self.transformer.h:  # type: ignore[union-attr]
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # type: ignore[operator]
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):  # type: ignore[no-untyped-def]
        # nanoGPT's, as it is there (its prints too: gsync prints them once, not once per device).
        param_dict = {pn: p for pn, p in self.named_parameters()}
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        num_decay_params = sum(p.numel() for p in decay_params)
        num_nodecay_params = sum(p.numel() for p in nodecay_params)
        print(f"num decayed parameter tensors: {len(decay_params)}, with {num_decay_params:,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {num_nodecay_params:,} parameters")
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        print(f"using fused AdamW: {use_fused}")
        return optimizer


# -- the recipe, as nanoGPT's train.py --------------------------------------------------------------------------

LEARNING_RATE, MIN_LR, WEIGHT_DECAY, BETAS, CLIP, ACCUMULATE = 3e-3, 3e-4, 0.1, (0.9, 0.95), 1.0, 2


def lr_factor(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return (MIN_LR + 0.5 * (1.0 + math.cos(math.pi * progress)) * (LEARNING_RATE - MIN_LR)) / LEARNING_RATE
    return factor


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(*batch)[1]


def plain_loop(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> list[float]:
    """The same recipe on one device, as nanoGPT's train.py runs it (its micro-steps and clipping)."""
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS, "cpu")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(steps // 10, steps))
    losses = []
    for step in range(steps):
        total = 0.0
        for batch in batches[step * ACCUMULATE : (step + 1) * ACCUMULATE]:
            loss = loss_fn(model, batch) / ACCUMULATE
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (each of 2 batches)")
    parser.add_argument("--devices", nargs="+", default=["cpu:0", "cpu:1"])
    args = parser.parse_args()

    torch.manual_seed(0)
    text = make_text(2000)
    chars = sorted(set(text))
    tokens = torch.tensor([chars.index(c) for c in text])
    block_size, batch_size = 24, 8
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps * ACCUMULATE):
        starts = torch.randint(len(tokens) - block_size - 1, (batch_size,), generator=generator).tolist()
        x = torch.stack([tokens[s : s + block_size] for s in starts])
        y = torch.stack([tokens[s + 1 : s + 1 + block_size] for s in starts])
        batches.append((x, y))
    model = GPT(len(chars), block_size)

    print("plain PyTorch loop:")
    plain_losses = plain_loop(copy.deepcopy(model), batches, args.steps)

    print(f"gsync on {', '.join(args.devices)}:")
    engine = gsync.Engine(args.devices)
    result = await engine.fit(
        model, batches,
        optimizer=lambda model: model.configure_optimizers(WEIGHT_DECAY, LEARNING_RATE, BETAS, "cpu"),
        loss_fn=loss_fn,
        scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(args.steps // 10, args.steps)),
        clip_grad_norm=CLIP,
        accumulate=ACCUMULATE,
        progress=False,
    )
    for step, (ours, plain) in enumerate(zip(result.losses, plain_losses)):
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}: gsync loss {ours:.5f}, plain loop loss {plain:.5f}")
    difference = max(abs(a - b) for a, b in zip(result.losses, plain_losses))
    print(f"max |gsync - plain| over {args.steps} steps: {difference:.2e}")


if __name__ == "__main__":
    asyncio.run(main())
