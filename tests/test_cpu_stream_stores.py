"""The fp32 CPU kernel's streamed bf16 copy (csrc/cpu_stream.h, issue 39): where a step moves
more than the cache holds, it writes ``param_lp`` with non-temporal stores.
``ZEROKERN_STREAM_STORES=1`` forces that path at any size, so here, on a size that splits
between two threads and ends in partial chunks, it must give the bits the kernel gives
unstreamed (held to AdamW within tolerances in tests/test_ops_adamw.py), the copy the
round-to-nearest-even cast of the new param; an unaligned copy (never streamed) too."""

from __future__ import annotations

import pytest
import torch

from zerokern import _native
from zerokern.ops.adamw import fused_adamw_

pytestmark = pytest.mark.skipif(
    not (_native.has_native() and hasattr(_native._C, "adamw")),
    reason="zerokern._C without the cpu adamw kernel",
)
# Above the kernel's OpenMP threshold (2**15), not a multiple of its 16-element chunks.
N = 2**15 + 3 * 256 + 45
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _lp(offset: int) -> torch.Tensor:
    """A zero bf16 copy of N elements starting ``offset`` elements into its storage (torch's
    CPU allocations are 64-byte aligned: offset 0 is aligned, 1 is not)."""
    return torch.zeros(N + offset, dtype=torch.bfloat16)[offset:]


def _grads(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(N, generator=gen) * 1e-2).bfloat16() for _ in range(steps)]


def _adam_steps(backend: str, offset: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(N, generator=gen)
    m, v, lp = torch.zeros(N), torch.zeros(N), _lp(offset)
    for step, g in enumerate(_grads(2), start=1):
        fused_adamw_(p, g, m, v, **HP, step=step, param_lp=lp, backend=backend)
    return [p, m, v, lp]


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"array {k}: {(a != b).sum().item()} elements differ"


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("offset", [0, 1])
def test_streamed_copy_equals_plain_stores(monkeypatch, offset):
    monkeypatch.setenv("ZEROKERN_STREAM_STORES", "0")
    plain = _adam_steps("cpu", offset)
    monkeypatch.setenv("ZEROKERN_STREAM_STORES", "1")
    streamed = _adam_steps("cpu", offset)
    _equal(streamed, plain)
    assert torch.equal(streamed[3], streamed[0].bfloat16())
