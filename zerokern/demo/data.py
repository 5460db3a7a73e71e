"""A text corpus generated locally (nothing downloads) and a character-level tokenizer.

The "language" is a small probabilistic grammar: sentences such as "the old fox sees a small
bird near the river." built from a few dozen words, subject-verb agreement, optional adjectives
and prepositional phrases, a few sentences per line. It is deterministic (one seeded
``random.Random``), has real structure at several scales (spelling, word order, agreement) and
a loss floor well above zero, so the training loss visibly falls from ln(vocab) as a model
learns characters, then words, then grammar.

``get_batch(step, rank, world, micro_batch, seq)`` gives rank ``rank`` its rows of step
``step``'s global batch of ``world * micro_batch`` rows. Row ``i`` of a step depends only on
(step, i), so the global batch, and hence training, is the same whatever the world size.
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch

__all__ = ["ALPHABET", "VOCAB", "corpus_text", "corpus_tokens", "encode", "decode", "get_batch"]

# Token ids: index in ALPHABET. 30 symbols, padded to a vocabulary of 32.
ALPHABET = "\n .,abcdefghijklmnopqrstuvwxyz"
VOCAB = 32
_IDS = {c: i for i, c in enumerate(ALPHABET)}

_SEED = 1910_02054  # the ZeRO paper's arXiv number
_CORPUS_CHARS = 1 << 18

# fmt: off
_NOUNS = [  # (singular, plural)
    ("cat", "cats"), ("dog", "dogs"), ("fox", "foxes"), ("bird", "birds"), ("child", "children"),
    ("farmer", "farmers"), ("teacher", "teachers"), ("horse", "horses"), ("mouse", "mice"),
    ("king", "kings"), ("river", "rivers"), ("tree", "trees"), ("house", "houses"),
    ("garden", "gardens"), ("boat", "boats"), ("hill", "hills"),
]
_VERBS = [  # (third person singular, plural)
    ("sees", "see"), ("likes", "like"), ("follows", "follow"), ("finds", "find"),
    ("watches", "watch"), ("helps", "help"), ("chases", "chase"), ("visits", "visit"),
]
_INTRANSITIVE = [("sleeps", "sleep"), ("runs", "run"), ("waits", "wait"), ("sings", "sing")]
_ADJS = ["old", "small", "quick", "quiet", "red", "happy", "tall", "lazy"]
_PREPS = ["near", "under", "behind", "beside", "over"]
_ADVS = ["slowly", "often", "today", "again"]
# fmt: on


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    plural = rng.random() < 0.3
    noun = rng.choice(_NOUNS)[plural]
    det = rng.choice(["the", "some", "many"] if plural else ["the", "a", "the", "one"])
    words = [det]
    if rng.random() < 0.4:
        words.append(rng.choice(_ADJS))
    words.append(noun)
    return " ".join(words), plural


def _sentence(rng: random.Random) -> str:
    subj, plural = _noun_phrase(rng)
    if rng.random() < 0.7:
        obj, _ = _noun_phrase(rng)
        parts = [subj, rng.choice(_VERBS)[plural], obj]
    else:
        parts = [subj, rng.choice(_INTRANSITIVE)[plural]]
    if rng.random() < 0.35:
        place, _ = _noun_phrase(rng)
        parts += [rng.choice(_PREPS), place]
    if rng.random() < 0.2:
        parts.append(rng.choice(_ADVS))
    text = " ".join(parts)
    if rng.random() < 0.15:  # a compound sentence
        text += ", and " + _sentence(rng)[:-1]
    return text + "."


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """About 262 thousand characters of the synthetic language (the same on every call/rank)."""
    rng = random.Random(_SEED)
    lines: list[str] = []
    n = 0
    while n < _CORPUS_CHARS:
        line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)[:_CORPUS_CHARS]


def encode(text: str) -> torch.Tensor:
    return torch.tensor([_IDS[c] for c in text], dtype=torch.long)


def decode(ids) -> str:
    return "".join(ALPHABET[i] if i < len(ALPHABET) else "?" for i in torch.as_tensor(ids).tolist())


@lru_cache(maxsize=1)
def corpus_tokens() -> torch.Tensor:
    lut = torch.zeros(128, dtype=torch.long)
    for c, i in _IDS.items():
        lut[ord(c)] = i
    raw = torch.frombuffer(bytearray(corpus_text().encode("ascii")), dtype=torch.uint8)
    return lut[raw.long()]


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit hash, so row offsets need no RNG state."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def get_batch(
    step: int, rank: int, world: int, micro_batch: int, seq: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each ``(micro_batch, seq)`` int64: rows
    ``rank * micro_batch ... (rank + 1) * micro_batch - 1`` of step ``step``'s global batch."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    data = corpus_tokens()
    span = data.numel() - seq - 1
    rows = range(rank * micro_batch, (rank + 1) * micro_batch)
    starts = torch.tensor([_mix(_mix(_SEED + step) + i) % span for i in rows])
    window = data[starts[:, None] + torch.arange(seq + 1)]
    return window[:, :-1].contiguous().to(device), window[:, 1:].contiguous().to(device)
