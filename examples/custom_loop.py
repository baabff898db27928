"""Train a small character-level transformer on gsync's own source, with your own loop.

    python examples/custom_loop.py                          # 2 virtual CPU devices (or every GPU)
    python examples/custom_loop.py --epochs 2 --steps 20    # shorter
    torchrun --nproc-per-node 2 examples/custom_loop.py     # one device per process

The recipe of nanoGPT's train.py, in one file: AdamW, linear warmup then
cosine decay, gradient clipping, gradient accumulation, bf16 autocast, a
held-out validation split evaluated every epoch, and a line of generated text
at the end. The loop is yours; gsync only runs each step on every device
(`session.step`) and evaluates across them (`session.evaluate`).

The corpus is this repository's README.md and the source of gsync/, read at
run time, so the example needs no download (`--text FILE ...` trains on yours).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gsync

ROOT = Path(__file__).resolve().parents[1]


# -- data ---------------------------------------------------------------------------


def load_corpus(paths: list[Path] | None = None) -> str:
    files = paths or [ROOT / "README.md", *sorted((ROOT / "gsync").rglob("*.py"))]
    text = "\n\n".join(path.read_text(encoding="utf-8") for path in files)
    # ASCII only: the README's box-drawing characters would be a dozen rare
    # tokens the model never learns, and the sample stays printable anywhere.
    return text.encode("ascii", "ignore").decode("ascii")


class Sampler:
    """Random windows of a token stream, as nanoGPT's get_batch.

    Seeded: under torchrun every rank draws the same global batches, which is
    what gsync expects by default (each rank keeps its own devices' rows).
    """

    def __init__(self, tokens: torch.Tensor, context: int, batch_size: int, seed: int) -> None:
        self.tokens, self.context, self.batch_size = tokens, context, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.context - 1, (self.batch_size,), generator=self.generator)
        rows = torch.stack([self.tokens[s : s + self.context + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


# -- model --------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        # Weight tying, as in GPT-2: one Parameter in two modules, which gsync
        # reduces once (it buckets parameters, not modules).
        self.head.weight = self.embed.weight
        # GPT-2's initialisation: with the tied head, PyTorch's default N(0, 1)
        # embedding would start the logits far too large (an initial loss of 15, not ln(vocab)).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.norm(self.blocks(self.embed(idx) + self.position(positions))))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    # Every row has the same number of tokens, so the token mean of a shard is
    # its row mean: gsync's row weighting then gives the global token mean.
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def warmup_cosine(warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """LambdaLR's multiplier: linear warmup to 1, then cosine decay to ``floor``, as nanoGPT's get_lr."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def generate(model: CharTransformer, prompt: torch.Tensor, max_new: int, stop: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    idx = prompt.unsqueeze(0)
    new: list[int] = []
    for _ in range(max_new):
        logits = model(idx[:, -model.context :])[0, -1]
        token = int(torch.multinomial(F.softmax(logits / 0.8, dim=-1), 1, generator=generator))
        if token == stop:
            break
        new.append(token)
        idx = torch.cat([idx, torch.tensor([[token]])], dim=1)
    return new


# -- the loop -----------------------------------------------------------------------


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=None, help="default: every GPU, else cpu:0 cpu:1")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per epoch")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per global batch")
    parser.add_argument("--accumulate", type=int, default=2, help="global batches per optimizer step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--autocast", choices=["bfloat16", "float16", "none"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default="def ", help="start of the sample (characters of the text)")
    parser.add_argument("--text", type=Path, nargs="+", default=None, help="default: README.md and gsync/**/*.py")
    args = parser.parse_args()

    text = load_corpus(args.text)
    chars = sorted(set(text))
    to_id = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([to_id[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(tokens))
    train = Sampler(tokens[:split], args.context, args.batch_size, seed=args.seed)
    # A fixed validation set, so epochs are compared on the same windows.
    held_out = Sampler(tokens[split:], args.context, args.batch_size, seed=args.seed + 1)
    val_batches = [held_out.batch() for _ in range(8)]

    torch.manual_seed(args.seed)  # the same initial weights on every rank (gsync also starts all from rank 0's)
    model = CharTransformer(len(chars), args.context, args.width, args.heads, args.layers)

    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    devices = args.devices
    if devices is None and not torch.cuda.is_available() and not under_torchrun:
        devices = ["cpu:0", "cpu:1"]
    engine = gsync.Engine(devices)
    main_process = int(os.environ.get("RANK", "0")) == 0
    say = print if main_process else (lambda *_: None)
    say(
        f"training on {[d.name for d in engine.devices]} per process: {sum(p.numel() for p in model.parameters()):,} "
        f"parameters, {len(chars)} characters, {len(tokens):,} tokens of text"
    )

    total_steps = args.epochs * args.steps
    autocast = None if args.autocast == "none" else getattr(torch, args.autocast)
    started = time.perf_counter()
    async with engine.session(
        model,
        # No weight decay on biases, norms and embeddings would be nanoGPT's next
        # refinement; one group keeps the recipe short.
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
        loss_fn=loss_fn,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(total_steps // 10, total_steps)),
        clip_grad_norm=1.0,
        autocast=autocast,
    ) as session:
        for epoch in range(args.epochs):
            losses = []
            for _ in range(args.steps):
                # Every rank draws the batches, in the same order, even the rows
                # it will not train on: the generators must stay in step.
                result = await session.step(*(train.batch() for _ in range(args.accumulate)))
                losses.append(result.loss)
            # A collective across processes: every rank evaluates, at the same point of its loop.
            val = await session.evaluate(val_batches)
            train_loss = sum(losses) / len(losses)
            say(f"epoch {epoch}: train loss {train_loss:.3f}, val loss {val['loss']:.3f}, lr {result.lr:.1e}")
    # Out of the block: `model` now holds the trained weights, as a plain module.
    elapsed = time.perf_counter() - started
    say(f"{total_steps} steps in {elapsed:.1f} s, last grad norm {result.grad_norm:.2f}")

    model.eval()
    prompt = torch.tensor([to_id[c] for c in args.prompt])
    new = generate(model, prompt, max_new=100, stop=to_id.get("\n", -1), seed=args.seed)
    say("sample: " + args.prompt + "".join(chars[i] for i in new))


if __name__ == "__main__":
    asyncio.run(main())
