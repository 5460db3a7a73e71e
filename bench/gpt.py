"""A small GPT (nanoGPT style) and a deterministic synthetic token stream.

This is the benchmarks' reference end-to-end workload (docs/how-it-works/conventions.md): the
model is ``zerokern.demo.gpt.GPT`` (shared with the demo and the examples) with the reference
shape; the token stream is below. Import it by putting its folder on the path:

    sys.path.insert(0, str(Path(__file__).resolve().parent))   # or .../bench
    from gpt import GPT, GPTConfig, batch

Parameter count: the reference workload's 13.84M for ``GPTConfig()`` (6 blocks, d_model 384,
6 heads, vocab 4096, sequence 128) is the count with an *untied* LM head (13,842,432); tying
the head to the token embedding gives 12,269,568. ``tie_head`` therefore defaults to False so
that ``GPTConfig()`` is the reference workload as the docs define it;
``GPTConfig(tie_head=True)`` gives the nanoGPT-style tied model.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from zerokern.demo.gpt import GPT, MLP, Block, CausalSelfAttention
from zerokern.demo.gpt import GPTConfig as _GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "batch"]

# The reference workload's shape; the model itself is zerokern.demo.gpt (one GPT in the repo).
_REFERENCE = _GPTConfig(n_layer=6, n_embd=384, n_head=6, vocab=4096, seq=128, tie_head=False)


def GPTConfig(**overrides: object) -> _GPTConfig:  # noqa: N802 (reads like the dataclass)
    """The reference configuration (13.84M parameters) with ``overrides`` applied."""
    return replace(_REFERENCE, **overrides)


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
