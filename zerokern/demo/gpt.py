"""A small GPT in the nanoGPT style, for the demo and ``examples/train_gpt.py``.

Token + learned position embeddings, ``n_layer`` pre-LN blocks (causal self-attention through
``F.scaled_dot_product_attention``, then a 4x GELU MLP, each added to the residual stream), a
final LayerNorm and an LM head tied to the token embedding (``tie_head=False`` unties it: the
benchmarks' reference workload, 13.84M parameters, is the untied 6 x 384 model:
docs/how-it-works/conventions.md). Seed the global RNG (``torch.manual_seed``) before building
it for reproducible weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS", "config_for"]


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    vocab: int = 32
    seq: int = 64
    tie_head: bool = True  # the LM head shares the token embedding (GPT-2)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def num_params(self) -> int:
        """Parameter count from the shapes alone (a tied head counted once)."""
        d = self.n_embd
        attn = (3 * d * d + 3 * d) + (d * d + d)  # qkv and output projection
        mlp = (4 * d * d + 4 * d) + (4 * d * d + d)
        block = 2 * 2 * d + attn + mlp  # + two LayerNorms
        head = 0 if self.tie_head else self.vocab * d
        return self.vocab * d + self.seq * d + self.n_layer * block + 2 * d + head


# --model presets. "small" (the demo's default) trains 4 policies x 50 steps in about half a
# minute on two idle CPU cores; "tiny" is for tests; "base" is the benchmarks'
# reference shape (6 x 384; docs/how-it-works/conventions.md).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_embd=64, n_head=2, seq=32),
    "small": GPTConfig(n_layer=4, n_embd=256, n_head=4, seq=64),
    "base": GPTConfig(n_layer=6, n_embd=384, n_head=6, seq=128),
}


def config_for(size: str, vocab: int) -> GPTConfig:
    if size not in PRESETS:
        raise ValueError(f"model size must be one of {', '.join(PRESETS)}, got {size!r}")
    return replace(PRESETS[size], vocab=vocab)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One transformer block; also the unit of ZeRO stage 3 (``shard_model(unit_classes=...)``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``forward(idx, targets=None) -> (logits, loss)``; the loss (mean token cross-entropy) is
    computed in fp32 whatever the parameter dtype."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        if cfg.tie_head:
            self.head.weight = self.tok_emb.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections: GPT-2's scaled init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied weight counted once

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        if T > self.cfg.seq:
            raise ValueError(f"sequence of {T} tokens is longer than cfg.seq={self.cfg.seq}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss
