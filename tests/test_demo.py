"""``python -m zerokern demo`` and ``examples/train_gpt.py`` end to end on 2 CPU ranks, plus
the pure pieces they rest on: the paper's formulas, the model's size, the data's batches.

The formulas are checked against the paper's worked example (Ψ = 8 on 4 GPUs: 128, 56, 44,
32 bytes) and against model_state_bytes (what the estimate command uses); the demo's CSV is
checked against the formulas recomputed here, not against its own formula columns only.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zerokern.demo import GPT, VOCAB, config_for, decode, encode, get_batch
from zerokern.formulas import (
    expected_comm_elements,
    expected_model_state_bytes,
    model_state_bytes,
    state_formula_text,
    zerokern_extra_bytes,
)

ROOT = Path(__file__).resolve().parents[1]


def test_formula_paper_tiny_example() -> None:
    # Paper seeds: Ψ = 8 parameters on N = 4 GPUs, 16-bit params and grads, K = 12.
    assert [expected_model_state_bytes(s, 8, 4, 2) for s in range(4)] == [128, 56, 44, 32]
    assert [state_formula_text(s, 2) for s in range(4)] == ["16Ψ", "4Ψ+12Ψ/N", "2Ψ+14Ψ/N", "16Ψ/N"]


@pytest.mark.parametrize("psi,n", [(8, 4), (7_500_000_000, 64), (3_407_872, 2), (1000, 3)])
def test_formula_matches_estimate_for_16bit(psi: int, n: int) -> None:
    for s in range(4):
        assert expected_model_state_bytes(s, psi, n, 2) == pytest.approx(
            model_state_bytes(s, psi, n), rel=1e-12
        )


def test_formula_fp32_params() -> None:
    # fp32 params are their own master: 4 (params) + 4 (grads) + 8 (two moments) bytes.
    assert [expected_model_state_bytes(s, 8, 4, 4) for s in range(4)] == [128, 80, 56, 32]
    assert state_formula_text(1, 4) == "8Ψ+8Ψ/N"
    assert expected_model_state_bytes(3, 10, 4, 4) == 40.0  # not divisible: exact float
    with pytest.raises(ValueError):
        expected_model_state_bytes(4, 8, 4, 2)
    with pytest.raises(ValueError):
        expected_model_state_bytes(0, 8, 4, 8)


def test_comm_and_extras() -> None:
    assert [expected_comm_elements(s, 64, 2) for s in range(4)] == [128, 128, 128, 192]
    assert expected_comm_elements(3, 64, 1) == 0
    assert zerokern_extra_bytes(0, 64, 2, 2) == {}
    assert zerokern_extra_bytes(1, 64, 2, 2) == {}  # in-place reduce-scatter: no extra shard
    assert zerokern_extra_bytes(2, 64, 2, 2) == {}
    assert zerokern_extra_bytes(2, 64, 2, 4) == {}  # fp32 params: updated in place, no master
    assert zerokern_extra_bytes(3, 64, 2, 4) == {}


def test_model_and_data() -> None:
    for size in ("tiny", "small", "base"):
        cfg = config_for(size, VOCAB)
        assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_params()
    # The global batch of a step does not depend on how many ranks share it.
    x1, y1 = get_batch(5, 0, 1, 6, 16)
    parts = [get_batch(5, r, 3, 2, 16) for r in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x1)
    assert torch.equal(torch.cat([p[1] for p in parts]), y1)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next characters
    assert not torch.equal(get_batch(6, 0, 1, 6, 16)[0], x1)
    assert decode(encode("the fox sleeps.\n")) == "the fox sleeps.\n"
    assert int(x1.max()) < VOCAB


def test_demo_defaults_and_model_option() -> None:
    # The default run is the short one the docs time (GPT "small", 50 steps per stage);
    # --model and --model-size name the same preset; the options' defaults are DemoOptions'.
    import argparse

    from zerokern.cli.demo import _options, configure_parser
    from zerokern.demo.train import DemoOptions

    parser = configure_parser(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert (args.steps, args.model_size) == (50, "small")
    assert _options(args) == DemoOptions()
    assert parser.parse_args(["--model", "base"]).model_size == "base"
    assert parser.parse_args(["--model-size", "tiny"]).model_size == "tiny"


# The end-to-end runs: (test name, command; {out} is the run's folder). Each is an import of
# torch, then 2 ranks that import it again, then a report: phases that leave one of 2 cores
# idle. The ones the session selected start together (``runs``) and overlap.
RUNS = {
    "test_demo_end_to_end": [sys.executable, "-m", "zerokern", "demo", *(
        "--steps 3 --model-size tiny --stages 0 1 2 3 --world-size 2 --out {out}".split())],
    **{f"test_example_train_gpt[{stage}]": [
        sys.executable, *"-m torch.distributed.run --nproc-per-node 2 --standalone".split(),
        "examples/train_gpt.py", *f"--steps 3 --stage {stage} --model-size tiny".split()]
       for stage in (2, 3)},
}
RUN_TIMEOUT_S = 480  # from a run's start, which it shares with the others (a hang fails)


class Runs:
    """The RUNS the session selected, started at once; ``result(name)`` waits for one."""

    def __init__(self, names: list[str], root: Path) -> None:
        self.root = root
        self.procs: dict[str, tuple[subprocess.Popen, float]] = {}
        for name in names:
            self._start(name)

    def _start(self, name: str) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        cmd = [a.replace("{out}", str(self.out(name))) for a in RUNS[name]]
        with open(self._log(name, "stdout"), "wb") as so, \
                open(self._log(name, "stderr"), "wb") as se:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=so, stderr=se,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = proc, time.monotonic()

    def _log(self, name: str, stream: str) -> Path:
        return self.root / f"run{list(RUNS).index(name)}.{stream}"

    def out(self, name: str) -> Path:
        return self.root / f"out{list(RUNS).index(name)}"

    def result(self, name: str) -> str:
        """The run's stdout; it must have exited 0."""
        if name not in self.procs:  # not seen as selected at the start: run it now
            self._start(name)
        proc, t0 = self.procs[name]
        try:
            rc = proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            rc = f"none: still running after {RUN_TIMEOUT_S} s"
        out = self._log(name, "stdout").read_text(errors="replace")
        err = self._log(name, "stderr").read_text(errors="replace")
        assert rc == 0, f"exit {rc}\n{out[-4000:]}\n{err[-4000:]}"
        return out

    def close(self) -> None:
        # A failed or interrupted session. torchrun starts its workers in sessions of their
        # own, out of reach of a kill of its group: SIGTERM lets it take them down first.
        live = [proc for proc, _ in self.procs.values() if proc.poll() is None]
        for proc in live:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in live:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    selected = {item.name for item in request.session.items
                if item.module is request.module and item.name in RUNS}
    r = Runs([n for n in RUNS if n in selected], tmp_path_factory.mktemp("runs"))
    try:
        yield r
    finally:
        r.close()


@pytest.mark.slow
def test_demo_end_to_end(runs: Runs) -> None:
    out = runs.out("test_demo_end_to_end")
    stdout = runs.result("test_demo_end_to_end")
    assert "final losses: equal" in stdout
    for name in ("demo_table.csv", "demo_losses.csv", "demo_table.md", "demo.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(out / "demo_table.csv")))
    assert [(int(r["stage"]), r["moments"], r["master"]) for r in rows] == [
        (0, "fp32", "fp32"), (1, "fp32", "fp32"), (2, "fp32", "fp32"), (3, "fp32", "fp32"),
        (3, "int8", "fp32"), (3, "int8", "none")]
    bars, rows = rows[4:], rows[:4]
    psi = config_for("tiny", VOCAB).num_params()
    _check_compressed_bars(bars, rows[3], psi)
    for r in rows:
        stage, world = int(r["stage"]), int(r["world_size"])
        psi_pad = int(r["psi_padded"])
        assert world == 2 and int(r["psi"]) == psi and psi <= psi_pad < psi + _max_pad(stage)
        formula = expected_model_state_bytes(stage, psi_pad, world, 2)  # bf16 by default
        held = int(r["state_measured_bytes"]) + int(r["padding_bytes"])
        parts = sum(
            int(r[f"{k}_bytes"]) for k in ("params", "grads", "master", "exp_avg", "exp_avg_sq")
        )
        assert parts == int(r["state_measured_bytes"])  # fp32 state: no scales, no side
        assert int(r["state_formula_bytes"]) == formula
        assert held == formula, r  # stage 1 included: no gradient shard beside the flat grad
        assert r["state_check"] != "MISMATCH"
        comm = (3 if stage == 3 else 2) * psi_pad
        assert int(r["comm_measured_elements"]) == int(r["comm_formula_elements"]) == comm
        assert float(r["step_ms_median"]) > 0
    finals = {r["final_loss"] for r in rows}
    assert len(finals) == 1, finals  # gloo on CPU: the policies are bit-identical
    losses = list(csv.reader(open(out / "demo_losses.csv")))
    assert len(losses) == 4 and all(
        float(b) < float(a) for a, b in zip(losses[1][1:], losses[-1][1:])
    )


def _max_pad(stage: int) -> int:
    """Bound on the padding zerokern adds to the tiny GPT at 2 ranks: bucket and shard rounding
    (64 elements a unit or bucket), and at stage 3 each parameter of 4,096 elements or more
    starting on a 256-element block."""
    big = sum(p.numel() >= 4096 for p in GPT(config_for("tiny", VOCAB)).parameters())
    return 64 * 8 + 64 + (256 * big if stage == 3 else 0)


# K of the compressed bars by hand: 4 (fp32 master) or 0, + 1 + 1 (int8 codes) + 2 x 4/256.
BAR_K = {"fp32": 4 + 2 + 8 / 256, "none": 2 + 8 / 256}
OPT_KINDS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
             "exp_avg_side", "exp_avg_sq_side")


def _check_compressed_bars(bars: list[dict], stage3: dict, psi: int) -> None:
    """The demo's compressed bars (stage 3, 2 ranks, bf16, rank 0's columns) against the
    paper's stage-3 formula with the format's K, plus the fp32 side moments of the small
    parameters, whose size is counted here from the model."""
    small = sum(p.numel() for p in GPT(config_for("tiny", VOCAB)).parameters()
                if p.numel() < 4096)
    for r in bars:
        assert r["trained"] == "False" and r["final_loss"] == "" and int(r["steps"]) == 0
        psi_pad = int(r["psi_padded"])
        assert psi <= psi_pad < psi + _max_pad(3)
        kinds = sum(int(r[f"{k}_bytes"]) for k in ("params", "grads", *OPT_KINDS))
        assert kinds == int(r["state_measured_bytes"])
        side = int(r["exp_avg_side_bytes"]) + int(r["exp_avg_sq_side_bytes"])
        assert 0 < side <= 8 * small  # rank 0's share of the 8 bytes per small element
        held = kinds + int(r["padding_bytes"]) - side
        assert held == (4 + BAR_K[r["master"]]) * psi_pad / 2, r
        # one fp32 absmax per 256-element block of the rank's local space
        assert int(r["exp_avg_absmax_bytes"]) >= 4 * -(-int(r["exp_avg_bytes"]) // 256)
        assert r["state_check"] == "= formula + extra" and int(r["state_extra_bytes"]) == side
    # int8 moments hold less than the fp32 state, and less again without the master.
    held = [int(r["state_measured_bytes"]) for r in (stage3, *bars)]
    assert held[0] > held[1] > held[2]


def test_compressed_bar_check_is_independent() -> None:
    # build_rows on records built by hand: the bar passes when every rank's bytes are the
    # formula plus its side moments and the ranks' side moments add up to 8 bytes per small
    # element; a rank that holds one byte more, or side moments that do not add up, fail it.
    from zerokern.demo.report import build_rows, format_table

    psi_pad, small, world = 4096 * 4, 1000, 2
    n = psi_pad // world  # each rank's elements: (2 + 2 + 4 + 1 + 1 + 8/256) bytes each

    def record(sides: list[int]) -> dict:
        mems = [{"params": 2 * n, "grads": 2 * n, "master": 4 * n, "exp_avg": n,
                 "exp_avg_sq": n, "exp_avg_absmax": 4 * n // 256,
                 "exp_avg_sq_absmax": 4 * n // 256, "exp_avg_side": sd // 2,
                 "exp_avg_sq_side": sd // 2, "padding": 0} for sd in sides]
        return {"stage": 3, "moments": "int8", "master": "fp32", "trained": False,
                "world": world, "psi": psi_pad, "psi_padded": psi_pad, "param_bytes": 2,
                "small_numel": small, "losses": [], "memory": mems[0], "memory_by_rank": mems,
                "comm_elements": 0, "comm_by_rank": [0, 0], "step_ms_median": 0.0}

    trained = {"stage": 3, "world": world, "psi": psi_pad, "psi_padded": psi_pad,
               "param_bytes": 2, "losses": [1.0], "step_ms_median": 1.0, "comm_elements":
               3 * psi_pad, "comm_by_rank": [3 * psi_pad] * 2}
    mem3 = {"params": psi_pad, "grads": psi_pad, "master": 2 * psi_pad, "exp_avg": 2 * psi_pad,
            "exp_avg_sq": 2 * psi_pad, "padding": 0}
    trained.update(memory=mem3, memory_by_rank=[mem3, mem3])
    rows, summary = build_rows([trained, record([5000, 3000])], "bf16", 0.02)
    assert summary["ok"] and rows[1]["state_check"] == "= formula + extra", rows[1]
    assert rows[1]["policy"] == "P_os+g+p int8" and rows[1]["state_extra_bytes"] == 5000
    assert "memory only" in format_table(rows, summary)
    _, summary = build_rows([trained, record([5000, 3008])], "bf16", 0.02)
    assert not summary["state_ok"]  # 8 * 1000 side bytes in all, not 8008
    bad = record([5000, 3000])
    bad["memory_by_rank"][1]["padding"] += 1
    _, summary = build_rows([trained, bad], "bf16", 0.02)
    assert not summary["state_ok"]


def test_demo_compressed_options() -> None:
    import argparse

    from zerokern.cli.demo import _options, _validate, configure_parser
    from zerokern.demo.train import DemoOptions, compressed_formats

    parser = configure_parser(argparse.ArgumentParser())
    assert compressed_formats(DemoOptions()) == (("int8", "fp32"), ("int8", "none"))
    assert compressed_formats(DemoOptions(precision="fp32")) == (("int8", "fp32"),)
    args = parser.parse_args(["--compressed", "bf16:none", "int8"])
    assert compressed_formats(_options(args)) == (("bf16", "none"), ("int8", "fp32"))
    assert compressed_formats(_options(parser.parse_args(["--compressed"]))) == ()
    for argv, needle in ((["--compressed", "int4"], "MOMENTS[:MASTER]"),
                         (["--compressed", "int8:none", "--precision", "fp32"], "bf16"),
                         (["--compressed", "int8", "int8:fp32"], "duplicates")):
        err = _validate(parser.parse_args(argv))
        assert err is not None and needle in err, (argv, err)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_example_train_gpt(stage: int, runs: Runs) -> None:
    stdout = runs.result(f"test_example_train_gpt[{stage}]")
    assert f"ZeRO stage {stage}, 2 ranks over gloo" in stdout
    assert "step    2  loss" in stdout and "sample:" in stdout
