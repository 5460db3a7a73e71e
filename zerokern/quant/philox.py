"""Philox4x32-10 in pure PyTorch: the oracle of the random bits of ``master="none"``.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
Random123 library) maps a 128-bit counter (four 32-bit words c0..c3) and a 64-bit key (k0, k1)
to four 32-bit words. Ten rounds; each multiplies c0 and c2 by two constants, keeps both halves
of the 64-bit products and mixes in the key, which is bumped by two Weyl constants between
rounds. For a fixed key the map is a bijection of the counter, so distinct counters give
distinct outputs, and different keys give independent streams. There is no state: any
element's bits are computed from its own counter, in any order, on any backend.

uint32 arithmetic on int64 tensors: every word is kept in [0, 2**32). A 32x32-bit product
does not fit in int64, so the counter word is split into 16-bit halves; each partial product
is below 2**48 and the high and low words are assembled from them without overflow.

How the generators that kernels can call map onto ``philox4x32``:

* Triton (``triton/language/random.py``, read in Triton 3.8): ``tl.randint4x(seed, offset)``
  is ``philox4x32(c0, c1, 0, 0, k0, k1)`` with ``c0`` the low 32 bits of ``offset`` and ``c1``
  its high 32 bits (``offset >> 32``, arithmetic, then truncated) when ``offset`` is a 64-bit
  integer, 0 when it is 32-bit; the key is the seed cast to uint64 (a negative 32- or 64-bit
  seed is sign-extended first, i.e. taken modulo 2**64): ``k0`` its low word, ``k1`` its high
  word. ``tl.randint(seed, offset)`` is the first of the four words. ``randint4x`` below
  equals it bit for bit (tests/test_philox.py runs both under ``TRITON_INTERPRET=1``).
* cuRAND (``curand_kernel.h``, its documented ``curand_init`` for ``curandStatePhilox4_32_10_t``
  and the header's state layout): ``curand_init(seed, subsequence, offset, &s)`` sets the key
  to (low, high) words of ``seed`` and the counter to (o_lo, o_hi, s_lo, s_hi), where
  ``o = offset // 4`` and ``s = subsequence`` (subsequences are 2**66 values long); the next
  ``curand4(&s)`` with ``offset % 4 == 0`` returns ``philox4x32(o_lo, o_hi, s_lo, s_hi, k0,
  k1)``. So ``tl.randint4x(seed, o)`` is ``curand_init(seed, 0, 4 * o)`` then ``curand4``, for
  ``o < 2**62``. Read from the header, not tested here (no GPU in CI); a CUDA kernel can also
  run the ten rounds itself, which is what this module's tests pin down.

The optimizer's key (``sr_bits``): the element's bits for (seed, step, index) are the first
word of ``philox4x32(index, step, 0, 0, seed_lo, seed_hi)``, i.e. ``tl.randint(seed,
(step.to(tl.int64) << 32) | index)`` with a 64-bit offset (cast both to int64 first: a 32-bit
offset would leave counter word 1 at 0; steps >= 2**31 wrap to negative offsets, which
Triton splits back into the same two words). The index is the element's position in its
whole parameter (not in a shard), so the bits do not depend on world size, stage or layout.
With ``0 <= index < 2**32``, ``0 <= step < 2**32`` and ``0 <= seed < 2**64`` every triple has
its own (counter, key) pair: under one seed the counters differ, and Philox is a bijection of
the counter; different seeds are different keys. Words c2 and c3 stay 0, free for other
streams later.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Random123's philox4x32 constants: round multipliers and the key schedule's Weyl increments.
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10

Word = torch.Tensor | int


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product m * x, m a 32-bit constant and x a
    tensor of words, without overflowing int64."""
    p_lo = x & 0xFFFF
    p_lo = p_lo * m  # < 2**48
    p_hi = (x >> 16) * m  # < 2**48; the full product is p_hi * 2**16 + p_lo
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & MASK32
    return hi, lo


def _word(name: str, w: Word) -> torch.Tensor:
    """w as an int64 tensor, checked to hold 32-bit unsigned values."""
    t = torch.as_tensor(w)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be integer, got {t.dtype}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > MASK32):
        raise ValueError(f"{name} must lie in [0, 2**32)")
    return t.to(torch.int64)


def _as_words(*words: Word) -> list[torch.Tensor]:
    # Python ints become tensors on the device of the tensor words: broadcasting a CPU
    # scalar against CUDA words gives expanded CPU views that CUDA arithmetic refuses (seen
    # on an H200: the torch backend's stochastic rounding failed with a device mismatch).
    dev = next((w.device for w in words if isinstance(w, torch.Tensor)), None)
    ts = [_word("a Philox word", w) for w in words]
    return list(torch.broadcast_tensors(*(t if dev is None else t.to(dev) for t in ts)))


def philox4x32(c0: Word, c1: Word, c2: Word, c3: Word, k0: Word, k1: Word
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 of the counter (c0, c1, c2, c3) under the key (k0, k1).

    Args:
        c0: Counter word 0 (tensor or int, each value in [0, 2**32)).
        c1: Counter word 1.
        c2: Counter word 2.
        c3: Counter word 3.
        k0: Key word 0.
        k1: Key word 1.

    Returns:
        The four output words, int64 tensors of the broadcast shape of the inputs, each
        value in [0, 2**32). Equal to Random123's ``philox4x32_10``.
    """
    c0, c1, c2, c3, k0, k1 = _as_words(c0, c1, c2, c3, k0, k1)
    for r in range(ROUNDS):
        if r:  # the key is raised before every round but the first
            k0 = (k0 + _W0) & MASK32
            k1 = (k1 + _W1) & MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _seed_words(seed: int) -> tuple[int, int]:
    if not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
    seed %= 1 << 64  # Triton casts the seed to uint64, sign-extending a negative one
    return seed & MASK32, seed >> 32


def randint4x(seed: int, offset: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton's ``tl.randint4x(seed, offset)``, bit for bit.

    Args:
        seed: The seed, an int in [-2**63, 2**64) (taken modulo 2**64, as Triton's cast to
            uint64 does).
        offset: Integer tensor of offsets. int64: its low and high 32-bit halves are counter
            words 0 and 1 (negative values by their two's complement bits). Narrower integer
            dtypes: counter word 0 is the offset modulo 2**32, word 1 is 0.

    Returns:
        Four int64 tensors shaped like ``offset`` with values in [0, 2**32): Triton's four
        int32 results reinterpreted as unsigned.
    """
    if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
        raise TypeError(f"offset must be an integer tensor, got {offset.dtype}")
    k0, k1 = _seed_words(seed)
    wide = offset.dtype == torch.int64
    offset = offset.to(torch.int64)
    lo = offset & MASK32
    hi = (offset >> 32) & MASK32 if wide else torch.zeros_like(lo)
    zero = torch.zeros_like(lo)
    return philox4x32(lo, hi, zero, zero, k0, k1)


# [Note: stochastic-rounding keys]
# The random bits that round an element of a master="none" parameter are a function of
# (seed, optimizer step, the element's index in its whole parameter) and nothing else: never
# of its offset in a rank's shard or a bucket, of the thread or the backend. So the same bits
# reach the same element at every world size, stage and mesh and on every backend, and a run
# is reproducible bit for bit. A kernel that walks a flat range adds the parameter's first
# global index to its lane's position (sr_index); sr_bits / sr_bits16 below are the oracle,
# and the C++, CUDA and Triton kernels cite this note where they build the counter.
def sr_bits(seed: int, step: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The random word of each element for stochastic rounding at optimizer step ``step``.

    Word 0 of ``philox4x32(index, step, 0, 0, seed_lo, seed_hi)``, the same as Triton's
    ``tl.randint(seed, (step << 32) | index)`` with an int64 offset (see the module
    docstring for why no two (seed, step, index) triples share a counter and key).

    Args:
        seed: The run's seed, an int in [0, 2**64); saved with the optimizer state.
        step: The optimizer step, an int or an integer tensor broadcastable with ``index``,
            in [0, 2**32).
        index: Integer tensor of the elements' indices in their whole parameter (global,
            not in the shard), in [0, 2**32).

    Returns:
        int64 tensor of the broadcast shape, values in [0, 2**32).
    """
    if not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    k0, k1 = _seed_words(seed)
    return philox4x32(_word("index", index), _word("step", step), 0, 0, k0, k1)[0]


def sr_bits16(seed: int, step: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 16 random bits of each element for stochastic rounding, format version 2.

    One Philox4x32-10 call feeds 8 consecutive elements: element ``i`` takes half
    ``i % 2`` (low, then high) of word ``(i // 2) % 4`` of
    ``philox4x32(i // 8, step, 0, 0, seed_lo, seed_hi)``. Eight elements share one counter
    and each takes its own 16 bits of the 128, so every (seed, step, index) still has bits of
    its own, and a kernel evaluates Philox once per 8 elements instead of once per element
    (``sr_bits``, version 1). ``stochastic_round_bf16`` reads only 16 bits.

    Args:
        seed: The run's seed, an int in [0, 2**64); saved with the optimizer state.
        step: The optimizer step, an int or an integer tensor broadcastable with ``index``,
            in [0, 2**32).
        index: Integer tensor of the elements' indices in their whole parameter, in
            [0, 2**32).

    Returns:
        int64 tensor of the broadcast shape, values in [0, 2**16).
    """
    if not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    k0, k1 = _seed_words(seed)
    i = _word("index", index)
    words = philox4x32(i >> 3, _word("step", step), 0, 0, k0, k1)
    pick = (i >> 1) & 3
    w = torch.where(pick == 0, words[0], torch.where(
        pick == 1, words[1], torch.where(pick == 2, words[2], words[3])))
    return (w >> (16 * (i & 1))) & 0xFFFF
