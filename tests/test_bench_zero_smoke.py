"""bench/bench_zero.py end to end in --quick mode: 2 gloo ranks, DDP and zerokern stage 2,
bf16, in a subprocess. Checks that it exits 0 and writes one ok row per policy, and
that the numbers mean something: both policies train the same model on the same data from the
same weights (their last losses agree), and the byte counts match what the algorithms must
move (DDP: one all-reduce of every gradient, 2Ψ by the paper's count, measured from the
profiler; zerokern stage 2: a reduce-scatter plus an all-gather, 2Ψ, from comm_stats)."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_zero import QUICK  # noqa: E402

MB = 1 << 20


@pytest.mark.slow
def test_bench_zero_quick(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "bench_zero.py"),
        "--quick",
        "--device", "cpu",
        "--world-size", "2",
        "--policies", "ddp", "zk_stage2",
        "--precision", "bf16",
        "--steps", "3",
        "--prof-steps", "1",
        "--out", str(tmp_path),
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    psi = QUICK["cfg"].num_params()
    # One precision keeps this a smoke test of the harness (fp32 parity is the parity tests'
    # job): its rows, its loss agreement and its communication accounting.
    for prec, esz, loss_tol in (("bf16", 2, 2e-2),):
        files = list(tmp_path.glob(f"bench_zero_cpu_{prec}_*_quick.csv"))
        assert len(files) == 1, f"no single {prec} CSV in {list(tmp_path.iterdir())}"
        with files[0].open() as f:
            rows = {row["policy"]: row for row in csv.DictReader(f)}
        assert set(rows) == {"ddp", "zk_stage2"}
        for name, row in rows.items():
            assert row["status"] == "ok", f"{prec} {name}: {row['status']}"
            assert float(row["step_ms"]) > 0 and float(row["state_mb"]) > 0
            assert math.isfinite(float(row["loss"]))
        ddp, zk = rows["ddp"], rows["zk_stage2"]
        assert float(zk["loss"]) == pytest.approx(float(ddp["loss"]), rel=loss_tol)
        assert float(ddp["comm_mb"]) * MB == pytest.approx(2 * psi * esz, rel=1e-3)
        # stage 2 pads each bucket to a multiple of the world size: a few elements at most
        assert float(zk["zk_comm_mb"]) * MB == pytest.approx(2 * psi * esz, rel=1e-2)
