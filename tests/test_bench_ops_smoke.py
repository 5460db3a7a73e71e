"""bench/bench_sq_norm.py and bench/bench_flatten.py on tiny inputs, in this process: they run,
check every provider's result against a reference (the benches assert it before timing), and
write one CSV whose ratios have the documented shape: every provider of every case, each
with one speed-up over the baseline per round, the median within the spread, and the
baseline's own ratio exactly 1. No timing is asserted."""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_flatten  # noqa: E402
import bench_sq_norm  # noqa: E402

from zerokern.ops import available_backends  # noqa: E402

ROUNDS = 2


def rows_of(out: Path, pattern: str) -> list[dict[str, str]]:
    files = list(out.glob(pattern))
    assert len(files) == 1, f"no single {pattern} in {list(out.iterdir())}"
    with files[0].open() as f:
        return list(csv.DictReader(f))


def check_ratios(row: dict[str, str]) -> None:
    per_round = [float(x) for x in row["x_vs_base_rounds"].split()]
    assert len(per_round) == ROUNDS and all(x > 0 for x in per_round), row
    lo, med, hi = (float(row[f"x_vs_base{k}"]) for k in ("_min", "", "_max"))
    assert lo <= med <= hi
    assert med == pytest.approx(statistics.median(per_round), abs=1e-3)
    assert float(row["ms_min"]) <= float(row["ms"]) <= float(row["ms_max"])
    assert row["rounds"] == str(ROUNDS)
    if row["provider"] == row["baseline"]:
        assert float(row["x_vs_base"]) == 1.0 and row["x_vs_base_rounds"] == "1.000 1.000"


def test_bench_sq_norm_quick(tmp_path: Path) -> None:
    argv = ["--quick", "--device", "cpu", "--sizes", "8", "12", "--rounds", str(ROUNDS),
            "--out", str(tmp_path)]
    assert bench_sq_norm.main(argv) == 0
    rows = rows_of(tmp_path, "bench_sq_norm_cpu_*_quick.csv")
    zk = {f"zk_{b}" for b in available_backends(torch.device("cpu"))}
    want = zk | {"torch_vector_norm", "torch_float_norm", "torch_foreach_norm"}
    for dtype in ("fp32", "bf16"):
        for lg in ("8", "12"):
            got = {r["provider"] for r in rows if r["dtype"] == dtype and r["log2_n"] == lg}
            assert got == want, (dtype, lg)
    assert all(r["baseline"] == "torch_vector_norm" for r in rows)
    for row in rows:
        check_ratios(row)


def test_bench_flatten_quick(tmp_path: Path) -> None:
    argv = ["--quick", "--device", "cpu", "--rounds", str(ROUNDS), "--out", str(tmp_path)]
    assert bench_flatten.main(argv) == 0
    rows = rows_of(tmp_path, "bench_flatten_cpu_*_quick.csv")
    zk = {f"zk_{b}" for b in available_backends(torch.device("cpu"))}
    want = {"flatten": zk | {"torch_cat", "torch_copy", "torch_foreach_copy"},
            "unflatten": zk | {"torch_copy", "torch_foreach_copy"}}
    for direction, providers in want.items():
        for dtype in ("fp32", "bf16"):
            for case, shapes in bench_flatten.QUICK_CASES.items():
                sel = [r for r in rows
                       if (r["direction"], r["dtype"], r["case"]) == (direction, dtype, case)]
                assert {r["provider"] for r in sel} == providers, (direction, dtype, case)
                assert all(r["tensors"] == str(len(shapes)) for r in sel)
                assert all(r["baseline"] == bench_flatten.BASE[direction] for r in sel)
    for row in rows:
        check_ratios(row)
