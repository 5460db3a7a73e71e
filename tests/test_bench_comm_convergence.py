"""bench/bench_comm_convergence.py --report (issue 38), without ranks: the tables and the goal
lines from the configs' JSON files (synthetic losses whose distances to the baseline are
known), so the report's arithmetic is checked without a training run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_comm_convergence as B  # noqa: E402


def test_report_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import _harness as H
    import torch

    steps, tail = 8, 4
    date = H.machine(torch.device("cpu"))["date"]
    stem = f"bench_comm_convergence_cpu_{date}_t"
    # base: loss 2.0 over the last 4 steps; the others a known factor of it
    factor = {"base": 1.0, "base_s1": 1.002, "g8": 1.004, "r8": 0.999, "r4": 1.02}
    for name, f in factor.items():
        losses = [3.0] * (steps - tail) + [2.0 * f] * tail
        (tmp_path / f"{stem}_{name}.json").write_text(json.dumps({
            "config": name, "options": B.CONFIGS[name][0], "seed": B.CONFIGS[name][1],
            "steps": steps, "losses": losses, "eval_loss": 1.5 * f, "step_ms": 10.0,
            "train_s": 1.0, "comm_bytes_per_step": 1000, "lr": 1e-3}))
    assert B.main(["--report", "--steps", str(steps), "--tail", str(tail), "--tag", "t",
                   "--out", str(tmp_path)]) == 0
    md = (tmp_path / f"{stem}.md").read_text()
    assert "| g8 | gather_dtype='int8' | 2.0080 | +0.400% |" in md
    assert "noise floor (seed 1 vs seed 0, both 16-bit): final loss +0.200%" in md
    assert "- g8: final loss +0.400% vs base (goal: within 0.5%) -> met; outside the noise" in md
    assert "- r8: final loss -0.100% vs base (goal: within 0.5%) -> met; within the noise" in md
    assert "- r4: final loss +2.000% vs base (goal: within 1.0%) -> NOT met" in md
    assert "g8r8" not in md  # not run: no row, no goal line
    curve = (tmp_path / f"{stem}_curve.csv").read_text().splitlines()
    assert len(curve) == steps + 1 and curve[0].startswith("step,lr,base,base_s1,g8,r8,r4")
    assert capsys.readouterr().out.count("| base |") == 1


def test_bad_steps_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        B.main(["--steps", "0"])
    assert "--steps" in capsys.readouterr().err


def test_fp32_linear_mode_rounds_fp32_results_once() -> None:
    """--fp32-linear: a bf16 linear / attention inside the mode equals the fp32 computation
    from the same bf16 inputs rounded once to bf16, forward and backward (bf16 gradients);
    other dtypes and functions pass through."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(24, 16, generator=g).bfloat16().requires_grad_()
    b = torch.randn(24, generator=g).bfloat16().requires_grad_()
    with B._Fp32Linear():
        y = F.linear(x, w, b)
        q, k, v = y.reshape(4, 8, 3, 8).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        z = F.linear(x.float(), w.float())  # fp32: untouched
    (a.float().square().sum()).backward()
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    yr = F.linear(xr, wr, br).bfloat16()
    qr, kr, vr = yr.reshape(4, 8, 3, 8).unbind(2)
    ar = F.scaled_dot_product_attention(qr.float(), kr.float(), vr.float(),
                                        is_causal=True).bfloat16()
    (ar.float().square().sum()).backward()
    assert y.dtype == a.dtype == torch.bfloat16 and z.dtype == torch.float32
    assert torch.equal(y, yr) and torch.equal(a, ar)
    for t, r in ((x, xr), (w, wr), (b, br)):
        assert t.grad.dtype == torch.bfloat16 and torch.equal(t.grad, r.grad.bfloat16())
