"""What the trainer-integration tests share: the torchrun environment of a pooled rank, a tiny
random-init GPT-2 (no download), its data, and the comparisons."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

# The clip threshold the tests train with: below every step's gradient norm, so clipping fires.
MAX_NORM = 0.05
STEPS = 20
ACCUM = 2
SAVE_AT = 10


@contextlib.contextmanager
def torchrun_env(rank: int, world: int) -> Iterator[None]:
    """The variables torchrun sets, which Accelerate reads to pick its multi-process path (the
    process group itself is already formed by the rank pool, through a file rendezvous, so no
    port is used). On exit the environment and Accelerate's process-wide singletons are
    restored, so the pooled rank serves the next case as it was."""
    saved = dict(os.environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def as_launched(fn: Callable[..., None]) -> Callable[..., None]:
    """A rank case ``fn(rank, world, ...)`` run inside torchrun_env."""

    @functools.wraps(fn)
    def case(rank: int, world: int, *args: Any) -> None:
        with torchrun_env(rank, world):
            fn(rank, world, *args)

    return case


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class TokenData(torch.utils.data.Dataset):
    """Deterministic token sequences (labels = inputs, as causal LM training does)."""

    def __init__(self, n: int = 200, seq: int = 12, vocab: int = 61) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def assert_params_close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                        what: str, tol: float = 1e-5) -> None:
    assert ours.keys() == ref.keys(), (what, sorted(set(ours) ^ set(ref)))
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=tol, atol=tol,
                                   msg=lambda m, k=k: f"{what} {k}: {m}")


def assert_one_reduction_per_step(opt: Any) -> None:
    """The last step's gradient reduction moved one gradient's worth of elements: the earlier
    micro-steps of its accumulation ran under ZeroAdamW's no_sync (without it: twice as many).
    The paper counts an all-reduce (stage 0) as 2 elements per element, a reduce-scatter as 1.
    """
    stats = opt.comm_stats()
    kind, per = ("all_reduce", 2) if opt.stage == 0 else ("reduce_scatter", 1)
    moved = stats["per_kind"][kind]["elements"]
    assert per * stats["numel"] <= moved < 1.5 * per * stats["numel"], (stats, kind)
