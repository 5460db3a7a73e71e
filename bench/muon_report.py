"""bench_muon.py's results: the ranks' per-step phases combined into rows, the bytes beside
zerokern.formulas, the goal of issue 37 checked round by round, and the markdown.

Per step, a phase is the slowest rank's (a collective step ends when its slowest rank does;
Newton-Schulz: the busiest owner's). A round's value is the median of its steps; a row's the
median over rounds, with the spread (min-max of the rounds), and every ratio is taken within
a round (the schedules of one round ran back to back, under the same load).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from gpt import GPT
from muon_schedules import muon_split

from zerokern.formulas import muon_exchange_bytes

MB = 1 << 20
PHASES = ("step", "step_cpu", "fwdbwd", "opt", "muon", "muon_cpu", "exchange", "exchange_cpu",
          "ns", "ns_cpu")


@dataclass
class Context:
    cfg: Any
    world: int
    micro_batch: int
    steps: int
    rounds: int
    threads: int
    meta: dict[str, str]
    command: str
    load: tuple[tuple[float, ...], tuple[float, ...]]
    wall_s: float


def combine_step(rs: list[dict[str, float]]) -> dict[str, float]:
    """One step's phases: every phase the slowest rank's, the loss the ranks' mean."""
    out = {k: max(r[k] for r in rs) for k in PHASES}
    out["loss"] = statistics.fmean(r["loss"] for r in rs)
    return out


def muon_numel(cfg: Any) -> tuple[int, int]:
    """(elements under Muon, all elements) of the GPT ``cfg``."""
    with torch.device("meta"):
        model = GPT(cfg)
    muon, other = muon_split(model)
    m = sum(p.numel() for p in muon)
    return m, m + sum(p.numel() for p in other)


def formula(name: str, row: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """The exchange's bytes per step by zerokern.formulas (the paper's count; the owner
    rows: of the rank whose bytes were measured, rank 0, from every rank's held table)."""
    m, _ = muon_numel(ctx.cfg)
    if name.startswith("owner-s"):
        owned = [int(x) for x in str(row["owned_numel"]).split()]
        held = [[int(x) for x in r.split()] for r in str(row["held"]).split(";")]
        got = muon_exchange_bytes(owned, int(name[len("owner-s")]), held, int(row["rank"]))
        return {"exchange_formula_bytes": got["total"]}
    if name == "redundant":
        return {"exchange_formula_bytes": 2 * m * 4}  # an all-reduce of the fp32 gradients
    if name == "single":
        return {"exchange_formula_bytes": 0}
    return {}


def _rounds_of(res: list[dict[str, Any]]) -> list[dict[str, float]]:
    ranks = res if res[0]["ranks"] == "all" else res[:1]
    out = []
    for ri in range(len(ranks[0]["rounds"])):
        steps = [combine_step(list(rs)) for rs in zip(*(r["rounds"][ri] for r in ranks))]
        out.append({k: statistics.median(s[k] for s in steps) for k in steps[0]})
    return out


def rows(ranks: list[dict[str, Any]], names: list[str],
         ctx: Context) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per schedule, one row per schedule and round)."""
    out, per_round = [], []
    for name in names:
        res = [r[name] for r in ranks]
        if res[0]["status"] != "ok":
            out.append({"schedule": name, "status": res[0]["status"]})
            continue
        rds = _rounds_of(res)
        row: dict[str, Any] = {"schedule": name, "status": "ok", "rounds": len(rds),
                               "world_size": ctx.world if res[0]["ranks"] == "all" else 1}
        for k in PHASES:
            v = [r[k] for r in rds]
            row[f"{k}_ms"] = statistics.median(v)
            row[f"{k}_ms_min"], row[f"{k}_ms_max"] = min(v), max(v)
            row[f"{k}_ms_rounds"] = " ".join(f"{x:.2f}" for x in v)
        row["loss"] = rds[-1]["loss"]
        row["opt_share"] = statistics.median(r["opt"] / r["step"] for r in rds)
        row.update({k: v for k, v in res[0].items() if k not in ("status", "rounds", "ranks")})
        row.update(formula(name, row, ctx))
        out.append(row)
        per_round += [{"schedule": name, "round": i + 1, **r} for i, r in enumerate(rds)]
    return out, per_round


def _per_round(row: dict[str, Any], k: str) -> list[float]:
    return [float(x) for x in row[f"{k}_ms_rounds"].split()]


def _spread(v: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}, {fmt.format(max(v))}]"


def goals(rows_: list[dict[str, Any]], ctx: Context) -> list[str]:
    """Issue 37's goal, round by round, per owner stage: the owner's Muon optimizer step
    against the bound NS_redundant / N + its own exchange, the excess in % of its step;
    Newton-Schulz alone; the bytes against the formulas."""
    by = {r["schedule"]: r for r in rows_ if r.get("status") == "ok"}
    n, lines = ctx.world, []
    red = by.get("redundant")
    for name, own in by.items():
        if not name.startswith("owner-s") or red is None:
            continue
        ns = _per_round(red, "ns")
        ex, mu, st = (_per_round(own, k) for k in ("exchange", "muon", "step"))
        bound = [a / n + b for a, b in zip(ns, ex)]
        ratio = [m / b for m, b in zip(mu, bound)]
        excess = [100 * (m - b) / s for m, b, s in zip(mu, bound, st)]
        ok = statistics.median(excess) <= 3
        lines.append(
            f"{name}: Muon step {own['muon_ms']:.1f} ms vs the bound NS_redundant/N + its "
            f"exchange = {statistics.median(ns):.1f}/{n} + {statistics.median(ex):.1f} = "
            f"{statistics.median(bound):.1f} ms: ratio {_spread(ratio)}; excess over the "
            f"bound in % of its training step {_spread(excess, '{:+.2f}')}% -> within 3%: "
            f"{'yes' if ok else 'NO'}")
        ns_c = _per_round(red, "ns_cpu")
        ex_c, mu_c, st_c = (_per_round(own, k) for k in ("exchange_cpu", "muon_cpu", "step_cpu"))
        bound_c = [a / n + b for a, b in zip(ns_c, ex_c)]
        excess_c = [100 * (m - b) / s for m, b, s in zip(mu_c, bound_c, st_c)]
        lines.append(
            f"{name}, in CPU time (the work, which the other processes' load does not stretch): "
            f"Muon step {statistics.median(mu_c):.1f} ms vs {statistics.median(ns_c):.1f}/{n} "
            f"+ {statistics.median(ex_c):.1f} = {statistics.median(bound_c):.1f} ms: ratio "
            f"{_spread([m / b for m, b in zip(mu_c, bound_c)])}; excess in % of its step's CPU "
            f"time {_spread(excess_c, '{:+.2f}')}% -> within 3%: "
            f"{'yes' if statistics.median(excess_c) <= 3 else 'NO'}")
        frac = [a / b for a, b in zip(_per_round(own, "ns"), ns)]
        frac_cpu = [a / b for a, b in zip(_per_round(own, "ns_cpu"), _per_round(red, "ns_cpu"))]
        lines.append(
            f"{name}: Newton-Schulz alone, busiest owner / redundant (every matrix): wall "
            f"{_spread(frac)}, CPU time {_spread(frac_cpu)} (1/N = {1 / n:.3f}; the plan puts "
            f"{own['owner_ns_share']:.3f} of the NS cost on its busiest rank)")
    for name, sync in by.items():
        over = by.get(name.removesuffix("-sync"))
        if not name.endswith("-sync") or over is None:
            continue
        # Within each round (the two ran back to back under the same load): overlapped /
        # synchronous, the Muon step and the training step, wall and CPU time.
        cells = []
        for k in ("muon", "muon_cpu", "step", "step_cpu"):
            v = [a / b for a, b in zip(_per_round(over, k), _per_round(sync, k))]
            cells.append(f"{k.replace('_cpu', ' CPU')} {_spread(v)}")
        lines.append(f"{over['schedule']} overlapped / synchronous exchange, per round "
                     f"(median [min, max]): " + ", ".join(cells))
    for k, r in by.items():
        if "exchange_formula_bytes" in r:
            good = r["exchange_bytes"] == r["exchange_formula_bytes"]
            lines.append(f"{k}: Muon exchange {r['exchange_bytes'] / MB:.4f} MB/step (formula "
                         f"{r['exchange_formula_bytes'] / MB:.4f}) -> equal: "
                         f"{'yes' if good else 'NO'}")
    shares = [f"{k} {100 * r['opt_share']:.1f}%" for k, r in by.items()]
    if shares:
        lines.append("optimizer step in % of the training step: " + ", ".join(shares))
    for k, r in by.items():
        if k.startswith("ds-") and "comm_bytes" in r:
            lines.append(f"{k}: {r['comm_bytes'] / MB:.3f} MB/step for the whole step "
                         f"(profiler, paper count: {r.get('comm_kinds', '')})")
    return lines


def _cell(r: dict[str, Any], k: str) -> str:
    v = r.get(f"{k}_ms")
    if v is None or math.isnan(v):
        return ""
    return f"{v:.1f} ({r[k + '_ms_min']:.1f}-{r[k + '_ms_max']:.1f})"


def _mb(r: dict[str, Any]) -> str:
    if "exchange_bytes" in r:
        return (f"{r['exchange_bytes'] / MB:.3f} ({r.get('exchange_formula_bytes', 0) / MB:.3f})")
    if "comm_bytes" in r:
        return f"whole step: {r['comm_bytes'] / MB:.3f}"
    return ""


def markdown(rows_: list[dict[str, Any]], lines: list[str], ctx: Context) -> str:
    c, m = ctx.cfg, ctx.meta
    mu, psi = muon_numel(c)
    head = (f"{m['device']}, torch {m['torch']}, {m['date']}: GPT {c.n_layer}x{c.n_embd}, "
            f"{c.n_head} heads, vocab {c.vocab}, seq {c.seq}, {psi:,} params ({mu:,} under "
            f"Muon), fp32, micro-batch {ctx.micro_batch}, {ctx.world} gloo ranks x "
            f"{ctx.threads} thread(s); {ctx.rounds} interleaved rounds of {ctx.steps} steps; "
            f"load average {ctx.load[0][0]:.1f} before, {ctx.load[1][0]:.1f} after; "
            f"{ctx.wall_s:.0f} s. ms: median over rounds (min-max of the rounds' medians); "
            f"MB = 2^20 bytes.  \n`{ctx.command}`")
    cols = ["schedule", "step ms", "step CPU ms", "optimizer ms", "opt / step", "Muon step ms",
            "Muon step CPU ms", "NS ms", "NS CPU ms", "exchange ms", "fwd+bwd ms",
            "Muon exchange MB/step (formula)", "Muon opt MB/step", "AdamW opt MB/step",
            "last loss", "what"]
    out = [head, "", "| " + " | ".join(cols) + " |",
           "|---|" + "---:|" * (len(cols) - 2) + "---|"]
    for r in rows_:
        if r.get("status") != "ok":
            out.append(f"| {r['schedule']} | {r['status']} |" + " |" * (len(cols) - 2))
            continue
        opt_mb = [f"{r[k] / MB:.3f}" if k in r else "" for k in ("muon_opt_bytes",
                                                                 "adamw_opt_bytes")]
        cells = [_cell(r, k) for k in ("step", "step_cpu", "opt")]
        cells.append(f"{100 * r['opt_share']:.1f}%")
        cells += [_cell(r, k) for k in ("muon", "muon_cpu", "ns", "ns_cpu", "exchange",
                                        "fwdbwd")]
        out.append("| " + " | ".join([r["schedule"], *cells, _mb(r), *opt_mb,
                                      f"{r['loss']:.4f}", r["what"]]) + " |")
    return "\n".join(out + [""] + [f"- {x}" for x in lines])
