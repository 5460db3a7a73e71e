"""What ``python -m zerokern estimate --optimizer muon`` adds: the owner exchange of
``ZeroOptimizer(matrices, torch.optim.Muon)`` (zerokern/zero/muon_step.py) for a GPT-like
model's hidden matrices, per data-parallel size: the exchange buffers a rank holds and the
bytes one step moves. Pure arithmetic on :mod:`zerokern.formulas` and the owners' plan
(:func:`zerokern.optim.muon_plan.plan_muon`, the engine's own), so the numbers are those
``memory_stats()`` and ``comm_stats()`` report for the same matrices.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .formulas import GB, muon_exchange_bytes, muon_exchange_memory_bytes
from .optim.muon_plan import plan_muon

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


def muon_section(layers: int, hidden: int, gpus: Iterable[int]) -> dict[str, Any]:
    """The report's ``"muon"`` entry: per data-parallel size N, the owners' segment S, the
    exchange's buffers per rank (fp32 updates + their bfloat16 results, N S elements each)
    and its bytes per step (stage 0: the results only; stages 1-3: the updates to their
    owners too), as the paper counts them and as each rank sends them (wire)."""
    shapes = gpt_matrices(layers, hidden)
    rows = []
    for n in gpus:
        owned = list(plan_muon(shapes, int(n)).owned_numel)
        mem = muon_exchange_memory_bytes(owned)
        rows.append({
            "gpus": int(n), "segment_numel": max(owned),
            "padding_numel": int(n) * max(owned) - sum(owned),
            "memory_bytes": mem, "memory_total_bytes": sum(mem.values()),
            "bytes_per_step": {f"stage{s}": muon_exchange_bytes(owned, s) for s in (0, 1)},
        })
    return {"matrices": len(shapes), "muon_params": sum(r * c for r, c in shapes),
            "rows": rows}


def format_muon(m: dict[str, Any]) -> list[str]:
    """The text of :func:`muon_section`'s dict."""
    lines = ["", "Muon owner exchange (ZeroOptimizer(..., torch.optim.Muon), --optimizer muon)",
             f"  {m['matrices']} hidden matrices, {m['muon_params']:,} parameters; S = the "
             "largest owner's elements (each rank's segment)",
             "  buffers per GPU: N S fp32 updates + N S bf16 results; per step: stage 0 the "
             "results (all-gather),", "  stages 1-3 the updates (reduce-scatter) too; "
             "GB = 1e9 bytes"]
    head = ["GPUs", "S", "padding", "buffers GB", "stage 0 GB/step", "stages 1-3 GB/step",
            "wire GB/rank"]
    table = [[str(r["gpus"]), f"{r['segment_numel']:,}", f"{r['padding_numel']:,}",
              f"{r['memory_total_bytes'] / GB:.4g}",
              f"{r['bytes_per_step']['stage0']['total'] / GB:.4g}",
              f"{r['bytes_per_step']['stage1']['total'] / GB:.4g}",
              f"{r['bytes_per_step']['stage1']['wire'] / GB:.4g}"] for r in m["rows"]]
    widths = [max(len(x) for x in col) for col in zip(head, *table, strict=True)]
    for cells in [head, ["-" * w for w in widths], *table]:
        lines.append("  " + "   ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return lines
