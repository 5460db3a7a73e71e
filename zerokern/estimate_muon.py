"""What ``python -m zerokern estimate --optimizer muon`` adds: the owner exchange of
``ZeroOptimizer(matrices, torch.optim.Muon)`` (zerokern/zero/muon_step.py) for a GPT-like
model's hidden matrices, per data-parallel size: the exchange buffers a rank holds and the
bytes one step moves. Pure arithmetic on :mod:`zerokern.formulas`, the owners' plan
(:func:`zerokern.optim.muon_plan.plan_muon`) and the layouts (stages 1-2: the flat one,
:func:`zerokern.zero.layout.build_layout`; stage 3: ``shard_model``'s units,
:func:`zerokern.zero.plan.plan_units`, and the optimizer's compact state over them,
:func:`zerokern.zero.layout.build_stage3_layout`), the engine's own, so the numbers are those
``memory_stats()`` and ``comm_stats()`` report for the same matrices.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from .formulas import GB, muon_exchange_bytes, muon_exchange_memory_bytes
from .optim.muon_plan import plan_muon
from .zero.layout import STATE_ALIGN_ELEMS, build_layout, build_stage3_layout
from .zero.plan import plan_units
from .zero.state_format import QUANT_ALIGN, quant_align

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


def gpt_block_numels(hidden: int) -> list[int]:
    """The parameters of one GPT-like block in registration order (the demo GPT's ``Block``:
    ln1, attention's qkv and proj, ln2, the MLP's fc and proj; weights then biases), the
    matrices of :func:`gpt_matrices` at positions :data:`BLOCK_MATRICES`.

    >>> gpt_block_numels(2)
    [2, 2, 12, 6, 4, 2, 2, 2, 16, 8, 16, 2]
    """
    h = hidden
    return [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]


BLOCK_MATRICES = (2, 4, 8, 10)  # where gpt_matrices' four are in gpt_block_numels


def muon_stage3(layers: int, hidden: int, n: int) -> tuple[list[list[int]], list[int]]:
    """Stage 3 (``shard_model(model, unit_classes=(Block,))``: one unit per block, each split
    1/N over the ranks, its biases and norms beside the matrices, every parameter large enough
    starting on a ``QUANT_ALIGN`` block) for ``ZeroOptimizer`` over the blocks' matrices:
    ``held[r][o]``, the elements of owner o's matrices in rank r's slices, and per rank the
    elements of its compact Muon momentum (its own elements of the matrices, each run where
    the state's alignment puts it). Both from the engine's own functions on a stand-in of the
    runtime (its units' plans and slice starts: all build_stage3_layout reads), so a change
    to how shard_model splits units shows here."""
    shapes = gpt_matrices(layers, hidden)
    plan = plan_muon(shapes, n)
    numels = gpt_block_numels(hidden)
    plans = plan_units([numels] * layers, n, QUANT_ALIGN, [[quant_align(x) for x in numels]]
                       * layers)
    starts = [sum(pl.shard_numel for pl in plans[:u]) for u in range(layers + 1)]
    params = [[object() for _ in numels] for _ in range(layers)]  # identities only
    muon = [params[u][i] for u in range(layers) for i in BLOCK_MATRICES]
    held = [[0] * n for _ in range(n)]
    momentum = []
    for r in range(n):
        units = [SimpleNamespace(plan=pl, params=ps, shard_start=st)
                 for pl, ps, st in zip(plans, params, starts, strict=False)]
        rt = SimpleNamespace(units=units, comm=SimpleNamespace(rank=r, world_size=n),
                             local_numel=starts[-1])
        layout = build_stage3_layout(rt, muon, [{"params": muon}], STATE_ALIGN_ELEMS)
        for pc in layout.pieces:
            if pc.param >= 0:
                held[r][plan.units[pc.param].owner] += pc.numel
        momentum.append(layout.local_numel)
    return held, momentum


def muon_section(layers: int, hidden: int, gpus: Iterable[int]) -> dict[str, Any]:
    """The report's ``"muon"`` entry: per data-parallel size N, the owners' segment S and,
    per rank, the exchange's buffers (``memory_bytes``) and its bytes per step
    (``bytes_per_step``) at stage 0 (``"stage0"``: N S fp32 updates + N S bfloat16 results
    held, the results all-gathered), at stages 1-2 (``"stage1"``: the owned segment and the
    all-to-alls' buffers held, what crosses ranks sent) and at stage 3 (``"stage3"``: the
    same exchange over ``shard_model``'s per-block split, :func:`muon_stage3`), with each
    stage's largest rank total (``max_memory_bytes``, ``max_bytes_per_step``); and at stage 3
    each rank's fp32 Muon momentum (``momentum_bytes["stage3"]``, its own elements of the
    matrices: ``memory_stats()["momentum_buffer"]``)."""
    shapes = gpt_matrices(layers, hidden)
    rows = []
    for n in (int(g) for g in gpus):
        owned = list(plan_muon(shapes, n).owned_numel)
        held = {0: None, 1: muon_held(shapes, n)}
        held[3], momentum = muon_stage3(layers, hidden, n)
        mem = {f"stage{s}": [muon_exchange_memory_bytes(owned, s, h, r) for r in range(n)]
               for s, h in held.items()}
        moved = {f"stage{s}": [muon_exchange_bytes(owned, s, h, r) for r in range(n)]
                 for s, h in held.items()}
        rows.append({
            "gpus": n, "segment_numel": max(owned), "padding_numel": n * max(owned) - sum(owned),
            "memory_bytes": mem, "bytes_per_step": moved,
            "momentum_bytes": {"stage3": [4 * m for m in momentum]},
            "max_memory_bytes": {k: max(sum(d.values()) for d in v) for k, v in mem.items()},
            "max_bytes_per_step": {k: max(d["total"] for d in v) for k, v in moved.items()},
            "max_momentum_bytes": {"stage3": 4 * max(momentum)},
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
             "ranks sent;",
             "  stage 3: the same over shard_model's split (a unit per block), beside the "
             "rank's fp32 momentum", "  (per GPU, the largest rank; GB = 1e9 bytes)"]
    head = ["GPUs", "S", "padding", "stage 0 GB held", "GB/step", "stages 1-2 GB held",
            "GB/step", "stage 3 GB held", "GB/step", "momentum GB"]
    table = [[str(r["gpus"]), f"{r['segment_numel']:,}", f"{r['padding_numel']:,}",
              *(f"{r[k][s] / GB:.4g}" for s in ("stage0", "stage1", "stage3")
                for k in ("max_memory_bytes", "max_bytes_per_step")),
              f"{r['max_momentum_bytes']['stage3'] / GB:.4g}"] for r in m["rows"]]
    widths = [max(len(x) for x in col) for col in zip(head, *table, strict=True)]
    for cells in [head, ["-" * w for w in widths], *table]:
        lines.append("  " + "   ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return lines
