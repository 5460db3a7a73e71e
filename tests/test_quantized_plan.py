"""``python -m zerokern estimate --nodes R [--hybrid] --gather-dtype int8 --reduce-dtype int4``:
the quantized-communication table (zerokern/quantized_plan.py, zerokern/cli/quantized_report.py).

Run in process. Its bytes must equal zerokern.formulas' exactly, composed here from the
collectives the engine runs (the functions comm_stats() is tested against in
test_quantized_engine.py); 16-bit rows equal ``hybrid_wire_elements`` x 2; the seconds are
comm_model.ring_seconds of those bytes; bad arguments are refused naming the argument.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from zerokern import formulas as F
from zerokern.comm_model import DEFAULT_INTRA_BW_GB_S as INTRA_BW
from zerokern.comm_model import DEFAULT_INTRA_LATENCY_S as INTRA_LAT
from zerokern.comm_model import Link, ring_seconds
from zerokern.estimate import estimate
from zerokern.quant.comm_codec import WIRE_BLOCK, payload_nbytes
from zerokern.quantized_plan import quantized_plan, step_counted

BUCKET = 4096
R, S = 3, 4  # nodes x GPUs per node
N = R * S
PSI = 5 * BUCKET + 1000  # five full calls and a shorter last one (padded to the ranks)
CALLS = ((BUCKET, 5), (1000, 1))


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    from zerokern.__main__ import main

    capsys.readouterr()
    try:
        code = main(["estimate", *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return int(code or 0), out.out, out.err


BASE = ["--params", str(PSI), "--gpus", str(N), "--nodes", str(R), "--gpus-per-node", str(S),
        "--bucket-numel", str(BUCKET)]


def _sent(counted: int, p: int) -> Fraction:
    return Fraction(counted * (p - 1), p)


def _flat_expected(stage: int, g: int | None, r: int | None) -> Fraction:
    """Bytes one rank sends per step (on each link kind) with every collective over N."""
    total = Fraction(0)
    for n, c in CALLS:
        k = -(-n // N)
        gather = F.quantized_all_gather_bytes(k, N, g) if g else N * k * 2
        red = F.quantized_reduce_scatter_bytes(k, N, r) if r else N * k * 2
        total += c * ((2 if stage == 3 else 1) * _sent(gather, N) + _sent(red, N))
    return total


def _hybrid_expected(stage: int, g: int | None, r: int | None) -> tuple[Fraction, Fraction]:
    intra = inter = Fraction(0)
    for n, c in CALLS:
        k = -(-n // S)
        gather = F.quantized_all_gather_bytes(k, S, g) if g else S * k * 2
        red = F.quantized_reduce_scatter_bytes(k, S, r) if r else S * k * 2
        intra += c * ((2 if stage == 3 else 1) * _sent(gather, S) + _sent(red, S))
        if r:  # two-hop: formulas.quantized_2hop_bytes' replicate dim, RS + AG over R
            padded = -(-k // R) * R
            inter += c * _sent(F.quantized_2hop_bytes(padded, S, R, r)["replicate"], R)
        else:  # all-reduce of the slice: twice (R-1)/R of it
            inter += c * 2 * _sent(k * 2, R)
    return intra, inter


def test_figures_equal_the_formulas(capsys):
    code, out, err = _cli(capsys, *BASE, "--hybrid", "--gather-dtype", "int8",
                          "--reduce-dtype", "int4", "--json")
    assert code == 0, err
    q = json.loads(out)["quantized"]
    assert q["inter_gbits"] == [25, 100, 400]
    bits = {None: None, "int8": 8, "int4": 4}
    seen = set()
    for layout, rows in q["layouts"].items():
        for row in rows:
            st, g, r = row["stage"], bits[row["gather_dtype"]], bits[row["reduce_dtype"]]
            seen.add((layout, st, g, r))
            if layout == "flat":
                want = _flat_expected(st, g, r)
                assert row["intra_bytes"] == want and row["inter_bytes"] == want, (st, g, r)
            else:
                intra, inter = _hybrid_expected(st, g, r)
                assert (row["intra_bytes"], row["inter_bytes"]) == (intra, inter), (st, g, r)
            # seconds: comm_model's ring model of each collective's counted bytes
            for gbits, secs in row["seconds_by_inter_gbits"].items():
                link = Link(float(gbits) / 8, 5e-6)
                want_s = 0.0
                for c in row["collectives"]:
                    on = (Link(min(INTRA_BW, link.bandwidth_gb_s), 5e-6) if c["group"] == "flat"
                          else link if c["group"] == "replicate" else Link(INTRA_BW, INTRA_LAT))
                    want_s += ring_seconds(c["kind"], c["bytes"], c["ranks"], on, c["calls"])
                assert secs == pytest.approx(want_s, rel=1e-12)
    # 16-bit, gather int8, reduce int4, both; stages 1-2 and 3; flat and hybrid
    assert len(seen) == 16
    # the 16-bit rows are the hybrid formulas' wire elements x 2 bytes (psi padded per call)
    padded = {p: sum(c * -(-n // p) * p for n, c in CALLS) for p in (N, S)}
    for layout, rows in q["layouts"].items():
        for row in rows:
            if row["gather_dtype"] or row["reduce_dtype"]:
                continue
            if layout == "flat":
                w = F.hybrid_wire_elements(row["stage"], padded[N], N, 1)
                assert row["inter_bytes"] == 2 * w["shard"]
            else:
                w = F.hybrid_wire_elements(row["stage"], padded[S], S, R)
                assert (row["intra_bytes"], row["inter_bytes"]) == (2 * w["shard"],
                                                                    2 * w["replicate"])


def test_text_table_and_link_speeds(capsys):
    code, out, err = _cli(capsys, *BASE, "--reduce-dtype", "int8", "--inter-gbits", "25", "50")
    assert code == 0, err
    assert "t @ 25 Gb/s" in out and "t @ 50 Gb/s" in out and "t @ 400" not in out
    lines = [ln for ln in out.splitlines() if ln.startswith("flat ")]
    assert [("reduce int8" if "reduce int8" in ln else "16-bit" in ln) for ln in lines] == [
        True, "reduce int8"] * 2
    assert "hybrid " not in out  # no --hybrid: the flat layout only
    # no quantized option and no speeds: no table (the estimate as before)
    code, out, _ = _cli(capsys, *BASE)
    assert code == 0 and "Quantized communication" not in out


@pytest.mark.parametrize("argv, flag", [
    (["--gather-dtype", "int4"], "--gather-dtype"),
    (["--reduce-dtype", "fp8"], "--reduce-dtype"),
    (["--inter-gbits", "0"], "--inter-gbits"),
    (["--inter-gbits", "100", "-25"], "--inter-gbits"),
    (["--inter-gbits"], "--inter-gbits"),
])
def test_bad_arguments_name_the_argument(argv, flag, capsys):
    code, out, err = _cli(capsys, *BASE, *argv)
    assert code == 2 and out == ""
    assert f"argument {flag}" in err, err


def test_options_need_nodes(capsys):
    for flag, value in (("--gather-dtype", "int8"), ("--reduce-dtype", "int4"),
                        ("--inter-gbits", "100")):
        code, out, err = _cli(capsys, "--params", "7e9", flag, value)
        assert code == 2 and out == ""
        assert f"{flag} needs --nodes" in err, err


def test_api_refusals_name_the_argument():
    with pytest.raises(ValueError, match="gather_dtype"):
        estimate(7e9, gpus=[64], nodes=8, gather_dtype="int4")
    with pytest.raises(ValueError, match="reduce_dtype"):
        estimate(7e9, gpus=[64], nodes=8, reduce_dtype="bf16")
    with pytest.raises(ValueError, match="gather_dtype needs nodes"):
        estimate(7e9, gpus=[64], gather_dtype="int8")
    with pytest.raises(ValueError, match="inter_gbits"):
        estimate(7e9, gpus=[64], nodes=8, inter_gbits=[])
    with pytest.raises(ValueError, match="inter_gbits"):
        quantized_plan(7e9, 8, 8, False, None, "int8", Link(200), 0.0, (float("nan"),))


def _hpz_expected(g: int | None, r: int | None) -> tuple[Fraction, Fraction]:
    """hpZ (stage 3): forward gather and reduce-scatter over all N ranks (both links), the
    backward gather of the secondary's shares over the node's S ranks in 16-bit (intra)."""
    padded = sum(c * -(-n // N) * N for n, c in CALLS)
    by_dim = F.hpz_comm_bytes(padded, S, R, 2)  # 16-bit: world = gather + reduce, shard = bwd
    world = Fraction(0)
    for n, c in CALLS:
        k = -(-n // N)
        gather = F.quantized_all_gather_bytes(k, N, g) if g else N * k * 2
        red = F.quantized_reduce_scatter_bytes(k, N, r) if r else N * k * 2
        world += c * (_sent(gather, N) + _sent(red, N))
    if not (g or r):
        assert world == _sent(by_dim["world"], N)
    return world + _sent(by_dim["shard"], S), world


def test_hpz_rows_equal_the_formulas(capsys):
    code, out, err = _cli(capsys, *BASE, "--hpz", "--gather-dtype", "int8",
                          "--reduce-dtype", "int4", "--json")
    assert code == 0, err
    q = json.loads(out)["quantized"]
    assert list(q["layouts"]) == ["flat", "hpz"]  # hpZ is its own layout, not --hybrid's
    rows = q["layouts"]["hpz"]
    bits = {None: None, "int8": 8, "int4": 4}
    padded = sum(c * -(-n // N) * N for n, c in CALLS)
    assert [(r["stage"], r["gather_dtype"], r["reduce_dtype"]) for r in rows] == [
        (3, None, None), (3, "int8", None), (3, None, "int4"), (3, "int8", "int4")]
    for row in rows:
        intra, inter = _hpz_expected(bits[row["gather_dtype"]], bits[row["reduce_dtype"]])
        assert (row["intra_bytes"], row["inter_bytes"]) == (intra, inter), row["collectives"]
        assert row["secondary_bytes"] == F.hpz_secondary_bytes(padded, S, R, 2)
        bwd = [c for c in row["collectives"] if c["group"] == "shard"]
        assert [(c["ranks"], c["bytes"]) for c in bwd] == [
            (S, F.hpz_comm_bytes(padded, S, R, 2)["shard"])]
    # the flat layout's stage-3 rows carry no secondary; hpZ's saves exactly the backward
    # gather's cross-node bytes against them
    flat3 = {(r["gather_dtype"], r["reduce_dtype"]): r for r in q["layouts"]["flat"]
             if r["stage"] == 3}
    for row in rows:
        f = flat3[(row["gather_dtype"], row["reduce_dtype"])]
        assert f["secondary_bytes"] == 0
        g = bits[row["gather_dtype"]]
        fwd = sum(c * (F.quantized_all_gather_bytes(-(-n // N), N, g) if g
                       else N * -(-n // N) * 2) for n, c in CALLS)
        assert f["inter_bytes"] - row["inter_bytes"] == _sent(fwd, N)


def test_hpz_full_zeropp_row_at_scale():
    """qwZ + hpZ + qgZ on 8 nodes x 8 GPUs: ZeRO++'s 0.75 Psi across nodes, (N-1)/N of
    0.5 + 0.25 plus the fp32 scales: one per 256 elements of the int8 gather (4/256 byte, in
    16-bit elements 1/128), one per 32 of the int4 gradient (1/16)."""
    q = estimate(7e9, gpus=[64], nodes=8, gpus_per_node=8, hpz=True, gather_dtype="int8",
                 reduce_dtype="int4", bucket_numel=200_000_000)["quantized"]
    row = q["layouts"]["hpz"][-1]
    assert (row["gather_dtype"], row["reduce_dtype"]) == ("int8", "int4")
    want = (0.5 + 1 / 128 + 0.25 + 1 / 16) * 63 / 64
    assert want - 1e-3 < row["inter_vs_psi"] < want + 1e-3, row["inter_vs_psi"]
    assert row["secondary_bytes"] == F.hpz_secondary_bytes(7_000_000_000, 8, 8, 2)


def test_hpz_text_column_and_refusals(capsys):
    code, out, err = _cli(capsys, *BASE, "--hpz")
    assert code == 0, err
    assert "hpZ copy GB/GPU" in out and [ln.split()[:3] for ln in out.splitlines()
                                         if ln.startswith("hpz ")] == [["hpz", "3", "16-bit"]]
    code, out, _ = _cli(capsys, *BASE, "--reduce-dtype", "int8")
    assert code == 0 and "hpZ copy GB/GPU" not in out and "\nhpz " not in out
    code, out, err = _cli(capsys, "--params", "7e9", "--hpz")
    assert code == 2 and out == "" and "--hpz needs --nodes" in err, err
    with pytest.raises(ValueError, match="hpz needs nodes"):
        estimate(7e9, gpus=[64], hpz=True)
    with pytest.raises(ValueError, match="hpz must be True or False"):
        estimate(7e9, gpus=[64], nodes=8, hpz="yes")
    with pytest.raises(ValueError, match="hpz must be True or False"):
        quantized_plan(7e9, 8, 8, False, None, None, Link(200), 0.0, hpz=1)
    with pytest.raises(ValueError, match="hpz is a stage-3 layout"):
        step_counted(2, 1 << 20, 8, 8, False, hpz=True)
    with pytest.raises(ValueError, match="hpz is a stage-3 layout"):
        step_counted(3, 1 << 20, 8, 8, True, hpz=True)


def test_int4_travels_in_32_element_blocks():
    """The collectives' block by width (int8 256, int4 32: finer int4 scales for convergence,
    docs/quantized-comm.md#convergence) and the formulas' defaults are the same, byte for
    byte: one fp32 scale per block, then the codes."""
    assert WIRE_BLOCK == F.QUANT_BLOCKS == {8: 256, 4: 32}
    for n in (1, 31, 32, 33, 1001):
        for bits in (8, 4):
            assert F.quantized_payload_bytes(n, bits) == payload_nbytes(n, bits, WIRE_BLOCK[bits])
    assert F.quantized_payload_bytes(1024, 4) == 4 * 32 + 512
    assert F.quantized_reduce_scatter_bytes(1024, 2, 4) == 2 * (4 * 32 + 512)
