"""Small models with awkward shapes for the ZeRO tests (odd sizes, unused and frozen params)."""

from __future__ import annotations

import torch
from torch import nn


class OddNet(nn.Module):
    def __init__(self, vocab: int = 37, dim: int = 13, hidden: int = 29, out: int = 7) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, out)
        self.unused = nn.Linear(5, 3)  # never called: no gradient on any rank
        self.frozen = nn.Parameter(torch.randn(11), requires_grad=False)
        self.sometimes = nn.Linear(hidden, hidden, bias=False)  # used on some steps only

    def forward(self, x: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        h = self.emb(x).mean(1) + self.frozen[:1]
        h = torch.tanh(self.norm(self.fc1(h)))
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.fc2(h)


def batch(step: int, rank: int, n: int = 6, seq: int = 5, vocab: int = 37, out: int = 7):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    y = torch.randint(0, out, (n,), generator=g)
    return x, y


class IntGradNet(nn.Module):
    """Parameters of odd shapes whose loss is linear with small-integer coefficients, so every
    gradient is a small integer: bf16 sums are exact in any order and the bf16 comparison
    with an fp32-master reference is not blurred by reduction order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(37, 13))
        self.b = nn.Parameter(torch.randn(29))
        self.c = nn.Parameter(torch.randn(13, 29))
        self.d = nn.Parameter(torch.randn(7))
        self.unused = nn.Parameter(torch.randn(5, 3))
        self.frozen = nn.Parameter(torch.randn(11), requires_grad=False)

    def forward(self, step: int, rank: int, use_sometimes: bool = True) -> torch.Tensor:
        g = torch.Generator().manual_seed(7919 * step + rank)
        loss = torch.zeros((), dtype=torch.float32)
        for name in ("a", "b", "c", "d"):
            p = getattr(self, name)
            if name == "d" and not use_sometimes:
                continue
            coef = torch.randint(-8, 9, p.shape, generator=g).to(p.dtype)
            loss = loss + (p * coef).sum().float()
        return loss


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.ln(h)
        h = h + self.attn(x).softmax(-1) * x
        return h + self.down(torch.nn.functional.gelu(self.up(self.ln(h))))


class TinyGPT(nn.Module):
    """GPT-like: embedding tied to the output head, odd sizes, optional checkpointing and an
    optional block that is skipped on alternate steps."""

    def __init__(self, vocab: int = 37, dim: int = 13, hidden: int = 27, n_block: int = 3,
                 checkpoint: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(5, dim) * 0.1)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_block))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        for i, blk in enumerate(self.blocks):
            if i == skip:
                continue
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False)
            else:
                h = blk(h)
        return self.head(self.ln_f(h)).mean(1)
