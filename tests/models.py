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
