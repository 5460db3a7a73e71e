"""bench/bench_sq_norm.py, bench/bench_flatten.py and bench/bench_adam.py on tiny inputs, in
this process: they run, check every provider's result against a reference (the benches assert
it before timing), and write one CSV whose ratios have the documented shape: every provider of
every case, each with one speed-up over the baseline per round, the median within the spread,
and the baseline's own ratio exactly 1. No timing is asserted. bench/bench_convergence.py for
a few steps: what its outputs must say whatever the machine."""

from __future__ import annotations

import csv
import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_adam  # noqa: E402
import bench_convergence  # noqa: E402
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


def test_bench_adam_quick(tmp_path: Path) -> None:
    """bench_adam.py --quick without torchao (its compile takes longer than a smoke test):
    every format's row names the backend that ran it, every provider's first step matched
    AdamW's (the bench asserts it; the CSV records it), the bytes per element are each
    format's reads and writes, and the ratios have the documented shape."""
    argv = ["--quick", "--device", "cpu", "--sizes", "10", "12", "--rounds", str(ROUNDS),
            "--providers", "torch_mixed", "zk", "bnb", "--out", str(tmp_path)]
    assert bench_adam.main(argv) == 0
    rows = [r for r in rows_of(tmp_path, "bench_adam_cpu_*_quick.csv") if r["ms"]]
    assert len(list(tmp_path.glob("bench_adam_cpu_*_quick.md"))) == 1
    absmax = 2 * 2 * 4 / 256  # two fp32 absmax per 256 elements, read and written
    # grad (bf16) + param side + moments, read and written; fp32 AdamW: 4 + 3 x (4 + 4)
    want_bytes = {"torch_fused": 28.0, "torch_mixed": 28.0, "zk_fp32": 2 + 8 + 16 + 2,
                  "zk_bf16": 2 + 8 + 8 + 2, "zk_int8": 2 + 8 + 4 + 2 + absmax,
                  "zk_int8_nomaster": 2 + 4 + 4 + absmax, "bnb_adamw8bit": 8 + 4 + 4 + absmax}
    want_bytes["zk_int8v3"] = want_bytes["zk_int8"]  # format version 3: the same bytes
    want_bytes["zk_int8v3_nomaster"] = want_bytes["zk_int8_nomaster"]
    backends = available_backends(torch.device("cpu"))
    for lg in ("10", "12"):
        sel = {r["provider"]: r for r in rows if r["log2_n"] == lg}
        zk = {name for name in sel if name.startswith("zk_")}
        for fmt in ("fp32", "bf16", "int8", "int8_nomaster", "int8v3", "int8v3_nomaster"):
            ran = [b for b in backends if f"zk_{fmt}_{b}" in zk]
            assert len(ran) == 1, (fmt, sorted(zk))  # the fastest that runs, named
        assert {"torch_fused", "torch_mixed"} <= set(sel)
        for name, row in sel.items():
            key = name if not name.startswith("zk_") else name.rsplit("_", 1)[0]
            assert float(row["bytes_per_elem"]) == pytest.approx(want_bytes[key]), name
            assert float(row["update_cos"]) > 0.95, name
            assert row["baseline"] == "torch_fused"
            check_ratios(row)
            # The limit: the triad's best round, never below torch fused AdamW's best round;
            # each row's GB/s as a percentage of it.
            limit = float(row["limit_gbs"])
            assert limit >= float(row["triad_gbs"]) > 0, name
            assert limit >= float(sel["torch_fused"]["gb_s_best"]), name
            assert row["limit_by"] in ("triad", "torch_fused"), name
            assert float(row["pct_limit"]) == pytest.approx(100 * float(row["gb_s"]) / limit)


def test_bench_convergence_quick(tmp_path: Path) -> None:
    """bench_convergence.py --quick, 4 steps: every config starts from the same weights and
    batch (the same first loss, bit for bit), zerokern's fp32 state and torch's AdamW on fp32
    masters (the same math) end within 0.1%, the compressed formats hold fewer state bytes,
    and the curve CSV has every step of every config; the version-3 config runs version 3
    (its own losses, not version 2's)."""
    configs = ["zk_fp32", "zk_int8", "zk_int8_nomaster", "zk_int8v3", "torch_adamw"]
    argv = ["--quick", "--steps", "4", "--configs", *configs, "--out", str(tmp_path)]
    assert bench_convergence.main(argv) == 0
    rows = {r["config"]: r for r in rows_of(tmp_path, "bench_convergence_cpu_*_summary.csv")}
    assert set(rows) == set(configs) and all(r["status"] == "ok" for r in rows.values())
    assert len({r["first_loss"] for r in rows.values()}) == 1
    fp32 = float(rows["zk_fp32"]["final_loss"])
    assert float(rows["torch_adamw"]["final_loss"]) == pytest.approx(fp32, rel=1e-3)
    assert float(rows["zk_fp32"]["final_vs_fp32_pct"]) == 0.0
    state = {k: int(r["state_bytes"]) for k, r in rows.items()}
    assert state["zk_int8_nomaster"] < state["zk_int8"] < state["zk_fp32"]
    curve = rows_of(tmp_path, "bench_convergence_cpu_*_curve.csv")
    assert [int(r["step"]) for r in curve] == [0, 1, 2, 3]
    assert all(math.isfinite(float(r[c])) for r in curve for c in configs)
    assert math.isclose(float(curve[0]["zk_fp32"]), float(curve[0]["zk_int8"]))
    assert [r["zk_int8v3"] for r in curve[1:]] != [r["zk_int8"] for r in curve[1:]]
    assert "int8_format=3" in rows["zk_int8v3"]["what"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(list(tmp_path.glob("bench_convergence_cpu_*_curve.png"))) == 1


def test_bench_adam_builds_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """Two trees (here the same one twice): every kernel timed in every child, one ratio per
    kernel and tree after the first."""
    import bench_adam_builds

    assert bench_adam_builds.main(["--tree", f"a={ROOT}", "--tree", f"b={ROOT}", "--size", "10",
                                   "--rounds", "1", "--calls", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == set(bench_adam_builds.KERNELS)
    assert all(" a/b " in line for line in rows.values())


def test_divider_floor_compiles_and_reports(tmp_path: Path) -> None:
    """bench/divider_floor.cpp, built with the command docs/benchmarks.md gives: it prints its
    three loops twice, each with a positive ns/elt and the ms at 2^25 that follows from it."""
    import shutil
    import subprocess

    cxx = shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "divider_floor"
    src = ROOT / "bench" / "divider_floor.cpp"
    subprocess.run([cxx, "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    rows = [ln for ln in out.splitlines() if ln.startswith(("sqrt(v)", "m / "))]
    assert [r.rsplit(None, 2)[0] for r in rows] == ["sqrt(v)", "m / v", "m / (sqrt(v) + eps)"] * 2
    for r in rows:
        ns, ms = (float(x) for x in r.rsplit(None, 2)[1:])
        # Both printed rounded (ns to 0.001, ms to 0.01): at most this far apart.
        assert ns > 0 and abs(ms - ns * 2**25 * 1e-6) <= 0.0005 * 2**25 * 1e-6 + 0.005
