"""What ``python -m zerokern estimate --optimizer muon`` adds: the owner exchange of
``ZeroOptimizer(matrices, torch.optim.Muon)`` (zerokern/zero/muon_step.py) for a GPT-like
model's hidden matrices, per data-parallel size: the exchange buffers a rank holds and the
bytes one step moves. Pure arithmetic on :mod:`zerokern.formulas`, the owners' plan
(:func:`zerokern.optim.muon_plan.plan_muon`) and the flat layout
(:func:`zerokern.zero.layout.build_layout`), the engine's own, so the numbers are those
``memory_stats()`` and ``comm_stats()`` report for the same matrices.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .formulas import GB, muon_exchange_bytes, muon_exchange_memory_bytes
from .optim.muon_plan import plan_muon
from .zero.layout import build_layout

OPTIMIZERS = ("adamw", "muon")


def gpt_matrices(layers: int, hidden: int) -> list[tuple[int, int]]:
    """The hidden matrices Muon takes in a GPT-like block, as ``nn.Linear`` weights (out, in):
    attention's fused QKV (3H x H) and output (H x H), the MLP's (4H x H) and (H x 4H); 12
    H^2 per layer (zerokern.formulas ``gpt_params``).

    >>> gpt_matrices(1, 2)
    [(6, 2), (2, 2), (8, 2), (2, 8)]
    """
    if layers < 1 or hidden < 1:
        raise ValueError(f"layers and hidden must be >= 1, got {layers!r}, {hidden!r}")
    block = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)]
    return block * layers


def muon_held(shapes: list[tuple[int, int]], n: int,
              bucket_numel: int | None = None) -> list[list[int]]:
    """``held[r][o]``: the elements of owner o's matrices in rank r's shard at stages 1-2,
    for ``ZeroOptimizer`` over these matrices alone (one param group, laid out in reverse
    registration order in buckets of ``bucket_numel``, the engine's default if None), owners
    by :func:`~zerokern.optim.muon_plan.plan_muon`: the table of zerokern.formulas
    ``muon_exchange_bytes`` and ``muon_exchange_memory_bytes``.

    Shards start on 32-element boundaries, so two small matrices both lie in rank 0's shard
    (rank 1 owns the first, rank 0 the second):

    >>> muon_held([(6, 2), (2, 8)], 2)
    [[16, 12], [0, 0]]
    """
    plan = plan_muon(shapes, n)
    held = [[0] * n for _ in range(n)]
    for r in range(n):
        layout = build_layout([[rows * cols for rows, cols in shapes]], stage=1, world_size=n,
                              rank=r, bucket_numel=bucket_numel)
        for pc in layout.pieces:
            held[r][plan.units[pc.param].owner] += pc.numel
    return held


def muon_section(layers: int, hidden: int, gpus: Iterable[int]) -> dict[str, Any]:
    """The report's ``"muon"`` entry: per data-parallel size N, the owners' segment S and,
    per rank, the exchange's buffers (``memory_bytes``) and its bytes per step
    (``bytes_per_step``) at stage 0 (``"stage0"``: N S fp32 updates + N S bfloat16 results
    held, the results all-gathered) and at stages 1-2 (``"stage1"``: the owned segment and
    the all-to-alls' buffers held, what crosses ranks sent), with each stage's largest rank
    total (``max_memory_bytes``, ``max_bytes_per_step``). Stage 3 shards per
    ``shard_model`` unit, so its split differs from stages 1-2's."""
    shapes = gpt_matrices(layers, hidden)
    rows = []
    for n in (int(g) for g in gpus):
        owned = list(plan_muon(shapes, n).owned_numel)
        held = muon_held(shapes, n)
        mem = {f"stage{s}": [muon_exchange_memory_bytes(owned, s, held, r) for r in range(n)]
               for s in (0, 1)}
        moved = {f"stage{s}": [muon_exchange_bytes(owned, s, held, r) for r in range(n)]
                 for s in (0, 1)}
        rows.append({
            "gpus": n, "segment_numel": max(owned), "padding_numel": n * max(owned) - sum(owned),
            "memory_bytes": mem, "bytes_per_step": moved,
            "max_memory_bytes": {k: max(sum(d.values()) for d in v) for k, v in mem.items()},
            "max_bytes_per_step": {k: max(d["total"] for d in v) for k, v in moved.items()},
        })
    return {"matrices": len(shapes), "muon_params": sum(r * c for r, c in shapes),
            "rows": rows}


def format_muon(m: dict[str, Any]) -> list[str]:
    """The text of :func:`muon_section`'s dict."""
    lines = ["", "Muon owner exchange (ZeroOptimizer(..., torch.optim.Muon), --optimizer muon)",
             f"  {m['matrices']} hidden matrices, {m['muon_params']:,} parameters; S = the "
             "largest owner's elements (each rank's segment)",
             "  stage 0: N S fp32 updates + N S bf16 results held, the results all-gathered;",
             "  stages 1-2: the owned segment + all-to-all buffers held, only what crosses "
             "ranks sent", "  (per GPU, the largest rank; GB = 1e9 bytes)"]
    head = ["GPUs", "S", "padding", "stage 0 GB held", "GB/step", "stages 1-2 GB held",
            "GB/step"]
    table = [[str(r["gpus"]), f"{r['segment_numel']:,}", f"{r['padding_numel']:,}",
              f"{r['max_memory_bytes']['stage0'] / GB:.4g}",
              f"{r['max_bytes_per_step']['stage0'] / GB:.4g}",
              f"{r['max_memory_bytes']['stage1'] / GB:.4g}",
              f"{r['max_bytes_per_step']['stage1'] / GB:.4g}"] for r in m["rows"]]
    widths = [max(len(x) for x in col) for col in zip(head, *table, strict=True)]
    for cells in [head, ["-" * w for w in widths], *table]:
        lines.append("  " + "   ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return lines
