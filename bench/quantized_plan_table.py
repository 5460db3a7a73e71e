"""The planner table of docs/quantized-comm.md: ZeRO stage 3 on 7B and 70B models over 64 and
512 GPUs (8 per node), flat, hybrid and hpZ, 16-bit against each quantized option, bytes per
step and GPU per link kind, hpZ's secondary copy per GPU and communication time at 25 / 100 /
400 Gb/s across nodes.

    python bench/quantized_plan_table.py [--bucket-numel 200000000]

The numbers are ``python -m zerokern estimate --nodes R --hybrid --hpz --gather-dtype int8
--reduce-dtype int8|int4 --json``'s (zerokern.estimate with the quantized section), run twice
(reduce int8, reduce int4) and merged: nothing is computed here but the table.
"""

from __future__ import annotations

import argparse
import sys

from zerokern.cli.estimate_report import fmt_gb, fmt_seconds
from zerokern.cli.quantized_report import wire_name
from zerokern.estimate import estimate

MODELS = {"7B": 7e9, "70B": 70e9}
GPUS = (64, 512)
PER_NODE = 8
GBITS = (25.0, 100.0, 400.0)


def rows(bucket: int) -> list[dict]:
    out = []
    for mname, psi in MODELS.items():
        for n in GPUS:
            seen = {}
            for red in ("int8", "int4"):
                q = estimate(psi, gpus=[n], nodes=n // PER_NODE, gpus_per_node=PER_NODE,
                             hybrid=True, hpz=True, gather_dtype="int8", reduce_dtype=red,
                             inter_gbits=GBITS, bucket_numel=bucket)["quantized"]
                for layout, items in q["layouts"].items():
                    for r in items:
                        if r["stage"] == 3:
                            seen[(layout, r["gather_dtype"], r["reduce_dtype"])] = r
            order = [(None, None), ("int8", None), (None, "int8"), (None, "int4"),
                     ("int8", "int8"), ("int8", "int4")]
            for layout in ("flat", "hybrid", "hpz"):
                for g, red in order:
                    out.append({"model": mname, "gpus": n, "layout": layout,
                                **seen[(layout, g, red)]})
    return out


def markdown(rs: list[dict]) -> str:
    head = ("| model | GPUs | layout | wire | intra GB/GPU | inter GB/GPU | inter, x Psi "
            "(16-bit el.) | hpZ copy GB/GPU | " + " | ".join(f"t @ {g:g} Gb/s" for g in GBITS)
            + " |")
    lines = [head, "|" + "---|" * 4 + "---:|" * (4 + len(GBITS))]
    for r in rs:
        t = r["seconds_by_inter_gbits"]
        lines.append(f"| {r['model']} | {r['gpus']} | {r['layout']} | "
                     f"{wire_name(r['gather_dtype'], r['reduce_dtype'])} | "
                     f"{fmt_gb(r['intra_bytes'])} | {fmt_gb(r['inter_bytes'])} | "
                     f"{r['inter_vs_psi']:.3f} | "
                     f"{fmt_gb(r['secondary_bytes']) if r['layout'] == 'hpz' else '-'} | "
                     + " | ".join(fmt_seconds(t[f'{g:g}']) for g in GBITS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-numel", type=int, default=200_000_000,
                    help="elements per collective call, for the latency term (default 2e8: "
                    "about one transformer layer of a 7B model, stage 3's unit)")
    args = ap.parse_args(argv)
    print(markdown(rows(args.bucket_numel)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
