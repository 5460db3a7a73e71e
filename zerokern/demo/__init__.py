"""The demo's model and data: a small nanoGPT-style GPT and a locally generated text corpus.

Used by ``python -m zerokern demo`` and ``examples/train_gpt.py``; nothing here depends on ZeRO.
"""

from .data import VOCAB, decode, encode, get_batch
from .gpt import GPT, PRESETS, Block, GPTConfig, config_for

__all__ = [
    "GPT",
    "GPTConfig",
    "Block",
    "PRESETS",
    "config_for",
    "VOCAB",
    "get_batch",
    "encode",
    "decode",
]
