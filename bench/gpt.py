"""A small GPT (nanoGPT style) and a deterministic synthetic token stream.

This is the model of the reference end-to-end workload (DESIGN.md §7), shared by the
benchmarks, the demo and the examples. It is a plain module, not part of the zerokern
package; import it by putting its folder on the path:

    sys.path.insert(0, str(Path(__file__).resolve().parent))   # or .../bench
    from gpt import GPT, GPTConfig, batch

Model: token + learned position embedding, ``n_layer`` pre-LN blocks (causal self-attention
through ``F.scaled_dot_product_attention``, then a 4x MLP with GELU, each added to the
residual stream), a final LayerNorm and a linear LM head without bias.

Parameter count: the 13.84M of DESIGN.md §7 for ``GPTConfig()`` (6 blocks, d_model 384,
6 heads, vocab 4096, sequence 128) is the count with an *untied* LM head (13,842,432); tying
the head to the token embedding gives 12,269,568. ``tie_head`` therefore defaults to False so
that the reference workload is the one the design describes; ``GPTConfig(tie_head=True)``
gives the nanoGPT-style tied model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "batch"]


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 6
    n_embd: int = 384
    n_head: int = 6
    vocab: int = 4096
    seq: int = 128
    tie_head: bool = False  # True: LM head shares the token embedding (12.27M for the default)
    bias: bool = True  # biases in the Linear layers and LayerNorms (the LM head has none)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def num_params(self) -> int:
        """Parameter count from the shapes alone (equals sum of p.numel() of GPT(self))."""
        d, b = self.n_embd, int(self.bias)
        ln = d * (1 + b)
        block = (
            ln
            + (d * 3 * d + b * 3 * d)
            + (d * d + b * d)
            + ln
            + (d * 4 * d + b * 4 * d)
            + (4 * d * d + b * d)
        )
        head = 0 if self.tie_head else self.vocab * d
        return self.vocab * d + self.seq * d + self.n_layer * block + ln + head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

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
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``forward(idx, targets=None) -> (logits, loss)``; the loss (mean token cross-entropy)
    is computed in fp32 whatever the parameter dtype, and is None without targets.

    Weights are initialised as in nanoGPT (normal, std 0.02; the two residual projections of
    each block scaled by 1/sqrt(2 n_layer)); seed the global RNG (``torch.manual_seed``)
    before constructing it for a reproducible model."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        if cfg.tie_head:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied weight is counted once

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        if T > self.cfg.seq:
            raise ValueError(f"sequence of {T} tokens is longer than cfg.seq={self.cfg.seq}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
            )
        return logits, loss


def batch(
    step: int, rank: int, micro_batch: int, seq: int, vocab: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each (micro_batch, seq) int64, for one rank and step.

    Deterministic: a CPU ``torch.Generator`` seeded by (step, rank) only, so every run, policy
    and world size sees the same tokens for the same (step, rank), and the global batch of a
    step is the concatenation over ranks. The stream is learnable, so the loss falls below
    ln(vocab) within some tens of steps and a broken optimizer shows: each row walks through the
    vocabulary with its own random stride (x[t+1] = x[t] + stride mod vocab), and one token in
    eight is replaced by a uniformly random one.
    """
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, vocab, (micro_batch, 1), generator=g)
    stride = torch.randint(1, 17, (micro_batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(micro_batch, seq + 1, generator=g) < 0.125
    tokens = torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=g), tokens)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
