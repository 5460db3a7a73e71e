"""Tests for the communication-time model (zerokern/comm_model.py) and the across-nodes section
of ``python -m zerokern estimate`` (--nodes, --gpus-per-node, --hybrid, the links' bandwidths
and latencies).

References are worked by hand from the ring algorithms: over p ranks an all-gather or a
reduce-scatter takes p-1 steps and an all-reduce 2(p-1), each step moving 1/p of the tensor
per rank; hybrid sharding reduce-scatters within a node and all-reduces each rank's 1/S slice
across the R nodes (issue 28: stage 2 moves 2Psi(S-1)/S inside a node and 2Psi(R-1)/(R*S)
across).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from zerokern import comm_model as cm
from zerokern import formulas
from zerokern.cli import estimate_report as report
from zerokern.estimate import estimate

REPO = Path(__file__).resolve().parents[1]


def _main(argv):
    from zerokern.__main__ import main

    return main(argv)


def _cluster(nodes=3, gpus=4, intra=(100.0, 1e-6), inter=(10.0, 10e-6)):
    return cm.Cluster(nodes, gpus, cm.Link(*intra), cm.Link(*inter))


# --------------------------------------------------------------------------------------------
# Ring collectives
# --------------------------------------------------------------------------------------------


def test_ring_costs_by_hand():
    link = cm.Link(2.0, 10e-6)  # 2 GB/s, 10 us per step
    # all-gather of 8 MB over 4 ranks: 3 steps of 2 MB -> 3 x 10 us + 3 x 2e6 / 2e9 s
    assert cm.ring_seconds("all_gather", 8e6, 4, link) == pytest.approx(3e-5 + 3e-3)
    assert cm.ring_seconds("reduce_scatter", 8e6, 4, link) == pytest.approx(3e-5 + 3e-3)
    # all-reduce: 6 steps
    assert cm.ring_seconds("all_reduce", 8e6, 4, link) == pytest.approx(6e-5 + 6e-3)
    # the same bytes in 5 calls: 5 times the latency, the same bandwidth term
    assert cm.ring_seconds("all_gather", 8e6, 4, link, calls=5) == pytest.approx(15e-5 + 3e-3)
    # one rank: nothing moves
    assert cm.ring_seconds("all_reduce", 8e6, 1, link) == 0
    assert [cm.ring_steps(k, 5) for k in cm.KINDS] == [4, 4, 8]
    assert cm.ring_sent("all_reduce", 1200, 4) == 1800  # 2 x 3/4
    assert cm.ring_sent("all_gather", 1200, 4) == 900


@pytest.mark.parametrize("call, needle", [
    (lambda: cm.ring_steps("broadcast", 4), "kind must be one of"),
    (lambda: cm.ring_steps("all_gather", 0), "ranks must be a positive integer"),
    (lambda: cm.ring_seconds("all_gather", -1, 2, cm.Link(1)), "nbytes"),
    (lambda: cm.ring_seconds("all_gather", 8, 2, cm.Link(1), calls=0), "calls"),
    (lambda: cm.Link(0), "bandwidth_gb_s"),
    (lambda: cm.Link(float("inf")), "bandwidth_gb_s"),
    (lambda: cm.Link(1, -1e-6), "latency_s"),
    (lambda: cm.Link(1, float("nan")), "latency_s"),
    (lambda: _cluster(nodes=0), "nodes must be a positive integer"),
    (lambda: _cluster(gpus=True), "gpus_per_node must be a positive integer"),
    (lambda: _cluster(gpus=2.0), "gpus_per_node must be a positive integer"),
    (lambda: cm.step_collectives(4, 10, _cluster(), False), "stage must be"),
    (lambda: cm.step_collectives(2, 0, _cluster(), False), "psi"),
    (lambda: cm.step_collectives(2, 10, _cluster(), False, grad_bytes=0), "grad_bytes"),
    (lambda: cm.step_collectives(2, 10, _cluster(), False, bucket_numel=0), "bucket_numel"),
])
def test_refusals_name_the_argument(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_ring_link_is_the_slowest_hop():
    c = _cluster(intra=(100.0, 1e-6), inter=(10.0, 10e-6))
    assert c.world == 12
    assert c.ring_link() == cm.Link(10.0, 10e-6)
    # an intra-node link slower than the network still bounds the ring
    assert _cluster(intra=(5.0, 20e-6), inter=(10.0, 10e-6)).ring_link() == cm.Link(5.0, 20e-6)
    assert _cluster(nodes=1).ring_link() == cm.Link(100.0, 1e-6)  # one node: no network


# --------------------------------------------------------------------------------------------
# A step's collectives and the traffic per link (Psi = 1200, R = 3 nodes x S = 4 GPUs)
# --------------------------------------------------------------------------------------------

PSI, R, S = 1200, 3, 4


def _shape(cols):
    return [(c.kind, c.group, c.ranks, c.elements) for c in cols]


def test_flat_and_hybrid_collectives_per_stage():
    c = _cluster(R, S)
    flat = {s: _shape(cm.step_collectives(s, PSI, c, False)) for s in formulas.STAGES}
    assert flat[0] == [("all_reduce", "flat", 12, PSI)]
    assert flat[1] == flat[2] == [("reduce_scatter", "flat", 12, PSI),
                                  ("all_gather", "flat", 12, PSI)]
    assert flat[3] == [("all_gather", "flat", 12, PSI), ("all_gather", "flat", 12, PSI),
                       ("reduce_scatter", "flat", 12, PSI)]
    hyb = {s: _shape(cm.step_collectives(s, PSI, c, True)) for s in formulas.STAGES}
    reduce = [("reduce_scatter", "shard", S, PSI), ("all_reduce", "replicate", R, PSI / S)]
    assert hyb[0] == [*reduce, ("all_gather", "shard", S, PSI)]
    assert hyb[1] == hyb[2] == [*reduce, ("all_gather", "shard", S, PSI)]
    assert hyb[3] == [("all_gather", "shard", S, PSI), ("all_gather", "shard", S, PSI), *reduce]
    # gradients and parameters keep their own widths (an fp32 reduction: 4-byte gradients)
    cols = cm.step_collectives(2, PSI, c, True, param_bytes=2, grad_bytes=4)
    assert [col.bytes_per_element for col in cols] == [4, 4, 2]
    assert cols[1].nbytes == 4 * PSI / S


def test_traffic_per_link_by_hand():
    c = _cluster(R, S)

    def traffic(stage, hybrid):
        t = cm.link_traffic(cm.step_collectives(stage, PSI, c, hybrid), c)
        return t["intra"]["elements"], t["inter"]["elements"], t["inter"]["bytes"]

    # flat: a ring over 12 ranks; every hop (in a node or across) carries what a rank sends:
    # 2 x 1200 x 11/12 = 2200 (stages 0-2), 3 x 1200 x 11/12 = 3300 (stage 3)
    assert traffic(2, False) == pytest.approx((2200, 2200, 4400))
    assert traffic(0, False) == pytest.approx((2200, 2200, 4400))
    assert traffic(3, False) == pytest.approx((3300, 3300, 6600))
    # hybrid, issue 28: 2 Psi (S-1)/S = 1800 inside, 2 Psi (R-1)/(R S) = 400 across
    assert traffic(2, True) == pytest.approx((1800, 400, 800))
    assert traffic(0, True) == pytest.approx((1800, 400, 800))
    assert 2 * PSI * (R - 1) / (R * S) == 400
    assert traffic(3, True) == pytest.approx((2700, 400, 800))  # 3 Psi (S-1)/S inside
    # one node: nothing crosses the network; one GPU per node: no intra-node hop
    one = _cluster(1, S)
    t = cm.link_traffic(cm.step_collectives(2, PSI, one, False), one)
    assert t["inter"]["elements"] == 0 and t["intra"]["elements"] == pytest.approx(1800)
    solo = _cluster(R, 1)
    t = cm.link_traffic(cm.step_collectives(2, PSI, solo, False), solo)
    assert t["intra"]["elements"] == 0 and t["inter"]["elements"] == pytest.approx(1600)
    t = cm.link_traffic(cm.step_collectives(2, PSI, solo, True), solo)  # hybrid = DDP across
    assert t["intra"]["elements"] == 0 and t["inter"]["elements"] == pytest.approx(1600)


def test_step_seconds_by_hand():
    # buckets of 500 elements: 3 calls per collective; 2-byte elements
    c = _cluster(R, S, intra=(100.0, 1e-6), inter=(10.0, 10e-6))
    flat = cm.step_seconds(cm.step_collectives(2, PSI, c, False, bucket_numel=500), c)
    # ring over 12 ranks at 10 GB/s, 10 us: 3 calls x 11 steps x 10 us + 11 x (2400/12) B / 1e10
    one = 3 * 11 * 10e-6 + 11 * 200 / 10e9
    assert flat == pytest.approx({"total": 2 * one, "intra": 0.0, "inter": 2 * one})
    hyb = cm.step_seconds(cm.step_collectives(2, PSI, c, True, bucket_numel=500), c)
    rs = 3 * 3 * 1e-6 + 3 * (2400 / 4) / 100e9  # reduce-scatter (and all-gather) in a node
    ar = 3 * 4 * 10e-6 + 4 * (600 / 3) / 10e9  # all-reduce of the 300-element slice, 3 nodes
    assert hyb == pytest.approx({"total": 2 * rs + ar, "intra": 2 * rs, "inter": ar})
    assert cm.collective_link(cm.step_collectives(2, PSI, c, True)[1], c) == c.inter


# --------------------------------------------------------------------------------------------
# The alpha-beta fit
# --------------------------------------------------------------------------------------------


def _samples(alpha, bw, factor=1.0):
    out = []
    for kind in cm.KINDS:
        for w in (2, 4):
            for nbytes in (4096 * 4**i for i in range(7)):
                t = cm.ring_seconds(kind, nbytes, w, cm.Link(bw, alpha))
                out += [(kind, w, nbytes, t * factor), (kind, w, nbytes, t / factor)]
    return out


def test_fit_recovers_the_link():
    got = cm.fit_alpha_beta(_samples(150e-6, 0.5))
    assert got.latency_s == pytest.approx(150e-6, rel=1e-9)
    assert got.bandwidth_gb_s == pytest.approx(0.5, rel=1e-9)
    # every point measured 1.3x too slow and 1.3x too fast: errors in log space cancel
    got = cm.fit_alpha_beta(_samples(150e-6, 0.5, factor=1.3))
    assert got.latency_s == pytest.approx(150e-6, rel=1e-6)
    assert got.bandwidth_gb_s == pytest.approx(0.5, rel=1e-6)


def test_fit_clamps_a_negative_latency():
    # times a little below pure bandwidth at small sizes: the free fit wants alpha < 0
    pts = [("all_gather", 2, n, n / 2 / 1e9 - 2e-7) for n in (1e3, 1e4, 1e5, 1e6)]
    got = cm.fit_alpha_beta(pts)
    assert got.latency_s == 0
    x2 = [n / 2 for _, _, n, _ in pts]
    want_b = math.exp(sum(math.log(t / x) for (_, _, _, t), x in zip(pts, x2, strict=True)) / 4)
    assert got.bandwidth_gb_s == pytest.approx(1 / (want_b * 1e9))


@pytest.mark.parametrize("pts, needle", [
    ([("all_gather", 2, 1e6, 1e-3)], "at least two samples"),
    ([("all_gather", 1, 1e6, 1e-3), ("all_gather", 2, 1e5, 1e-4)], "ranks > 1"),
    ([("all_gather", 2, 1e6, 0.0), ("all_gather", 2, 1e5, 1e-4)], "seconds > 0"),
    ([("all_gather", 2, 1e6, 1e-3), ("all_gather", 2, 1e6, 2e-3)], "cannot separate"),
    ([("all_gather", 2, 1e3, 1e-3), ("all_gather", 2, 1e6, 1e-4)], "no positive bandwidth"),
])
def test_fit_refusals(pts, needle):
    with pytest.raises(ValueError, match=needle):
        cm.fit_alpha_beta(pts)


# --------------------------------------------------------------------------------------------
# estimate(): the across-nodes section
# --------------------------------------------------------------------------------------------


def test_estimate_cluster_section_by_hand():
    psi = 7.5e9
    r = estimate(psi, gpus=[64], nodes=4, gpus_per_node=8, hybrid=True, gpu_mem_gb=32)
    c = r["cluster"]
    assert (c["nodes"], c["gpus_per_node"], c["world"], c["hybrid"]) == (4, 8, 32, True)
    assert c["intra"] == {"bandwidth_gb_s": 200.0, "latency_s": 2e-6}
    assert c["inter"] == {"bandwidth_gb_s": 25.0, "latency_s": 5e-6}
    calls = math.ceil(psi / 2**21)
    assert c["calls_per_collective"] == calls == 3577
    flat, hyb = c["layouts"]["flat"], c["layouts"]["hybrid"]
    assert (flat["shard_ranks"], hyb["shard_ranks"], hyb["replicate_ranks"]) == (32, 8, 4)
    for s in formulas.STAGES:  # memory: the state divided over all 32 ranks, or a node's 8
        assert flat["stages"][f"stage{s}"]["memory_bytes"] == formulas.model_state_bytes(
            s, psi, 32)
        assert hyb["stages"][f"stage{s}"]["memory_bytes"] == formulas.model_state_bytes(
            s, psi, 8)
    assert hyb["stages"]["stage3"]["memory_gb"] == pytest.approx(15.0)  # 16 x 7.5 / 8
    assert flat["stages"]["stage3"]["fits"] is True and hyb["stages"]["stage1"]["fits"] is False
    f2, h2 = flat["stages"]["stage2"], hyb["stages"]["stage2"]
    # flat: 2 x 7.5e9 x 31/32 elements per link, 2 bytes each
    assert f2["traffic"]["inter"]["bytes"] == pytest.approx(2 * 2 * psi * 31 / 32)
    assert f2["traffic"]["intra"]["bytes"] == pytest.approx(2 * 2 * psi * 31 / 32)
    # hybrid: 2 Psi 7/8 inside, 2 Psi 3/(4 x 8) across
    assert h2["traffic"]["intra"]["elements"] == pytest.approx(2 * psi * 7 / 8)
    assert h2["traffic"]["inter"]["elements"] == pytest.approx(2 * psi * 3 / 32)
    # flat ring at 25 GB/s, 5 us per step, 31 steps per call, two collectives
    one = calls * 31 * 5e-6 + 31 * (2 * psi / 32) / 25e9
    assert f2["seconds"] == pytest.approx(2 * one)
    rs = calls * 7 * 2e-6 + 7 * (2 * psi / 8) / 200e9
    ar = calls * 6 * 5e-6 + 6 * (2 * psi / 8 / 4) / 25e9
    assert h2["seconds"] == pytest.approx(2 * rs + ar)
    assert h2["seconds_by_link"] == pytest.approx({"intra": 2 * rs, "inter": ar})
    assert [x["kind"] for x in h2["collectives"]] == ["reduce_scatter", "all_reduce",
                                                       "all_gather"]
    assert sum(x["seconds"] for x in h2["collectives"]) == pytest.approx(h2["seconds"])
    assert "slowest link" in c["model"]
    # without hybrid only the flat layout; without nodes no section
    assert list(estimate(psi, nodes=2)["cluster"]["layouts"]) == ["flat"]
    assert estimate(psi)["cluster"] is None


@pytest.mark.parametrize("kwargs, needle", [
    ({"hybrid": True}, "hybrid needs nodes"),
    ({"inter_bw_gb_s": 50}, "inter_bw_gb_s needs nodes"),
    ({"nodes": 0}, "nodes must be a positive integer"),
    ({"nodes": 2, "gpus_per_node": 0}, "gpus_per_node must be a positive integer"),
    ({"nodes": 2, "bucket_numel": 1.5}, "bucket_numel must be a positive integer"),
    ({"nodes": 2, "intra_bw_gb_s": 0}, "intra_bw_gb_s must be a positive number"),
    ({"nodes": 2, "inter_bw_gb_s": float("nan")}, "inter_bw_gb_s must be a positive number"),
    ({"nodes": 2, "inter_latency_s": -1e-6}, "inter_latency_s must be a number >= 0"),
])
def test_estimate_cluster_refusals(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        estimate(7.5e9, **kwargs)


def test_cluster_text_report():
    text = report.format_report(estimate(7.5e9, gpus=[64], nodes=4, hybrid=True, gpu_mem_gb=32))
    section = text.split("Across nodes:")[1]
    assert "4 nodes x 8 GPUs = 32 ranks" in section
    lines = section.splitlines()
    flat3 = next(line for line in lines if line.strip().startswith("P_os+g+p (3)"))
    assert flat3.split()[2:7] == ["flat,", "N=32", "3.75", "*", "21.8B"]
    hyb2 = lines[lines.index(next(x for x in lines if x.strip().startswith("P_os+g (2)"))) + 1]
    assert hyb2.split()[:5] == ["hybrid,", "N=8", "x4", "28.1", "*"]
    assert "1.41B / 2.81" in hyb2  # 2 x 7.5e9 x 3/32 elements across, 2.81 GB
    assert all(len(line) <= 100 for line in section.splitlines())
    assert all(line == line.rstrip() for line in text.splitlines())
    assert "Across nodes" not in report.format_report(estimate(7.5e9))


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------


def test_cli_cluster_json(capsys):
    argv = ["estimate", "--params", "1e9", "--gpus", "8", "--nodes", "2", "--gpus-per-node",
            "4", "--hybrid", "--intra-bw", "100", "--inter-bw", "10", "--intra-latency", "1",
            "--inter-latency", "10", "--bucket-numel", "500000000", "--json"]
    assert _main(argv) == 0
    c = json.loads(capsys.readouterr().out)["cluster"]
    assert c["intra"] == {"bandwidth_gb_s": 100.0, "latency_s": 1e-6}
    assert c["inter"] == {"bandwidth_gb_s": 10.0, "latency_s": 1e-5}
    assert c["calls_per_collective"] == 2
    h3 = c["layouts"]["hybrid"]["stages"]["stage3"]
    # 2 all-gathers + a reduce-scatter of 1e9 over 4 GPUs, then the 2.5e8 slice over 2 nodes
    intra = 3 * (2 * 3 * 1e-6 + 3 * (2e9 / 4) / 100e9)
    inter = 2 * 2 * 1e-5 + 2 * (5e8 / 2) / 10e9
    assert h3["seconds"] == pytest.approx(intra + inter)
    assert h3["traffic"]["inter"]["elements"] == pytest.approx(2 * 1e9 / 4 / 2)


def test_cli_cluster_table(capsys):
    argv = ["estimate", "--params", "7.5e9", "--gpus", "64", "--nodes", "4", "--hybrid"]
    assert _main(argv) == 0
    out = capsys.readouterr().out
    assert "Across nodes: 4 nodes x 8 GPUs = 32 ranks" in out
    assert "intra-node 200 GB/s, 2 us; inter-node 25 GB/s, 5 us" in out


@pytest.mark.parametrize("argv, needle", [
    (["--nodes", "0"], "argument --nodes"),
    (["--nodes", "2", "--gpus-per-node", "0"], "argument --gpus-per-node"),
    (["--nodes", "2", "--inter-bw", "0"], "argument --inter-bw"),
    (["--nodes", "2", "--intra-bw", "fast"], "argument --intra-bw"),
    (["--nodes", "2", "--intra-latency", "-1"], "argument --intra-latency"),
    (["--nodes", "2", "--bucket-numel", "0"], "argument --bucket-numel"),
])
def test_cli_bad_cluster_values(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        _main(["estimate", "--params", "1e9", *argv])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--hybrid"], ["--gpus-per-node", "4"], ["--inter-bw", "50"],
                                  ["--intra-latency", "3"], ["--bucket-numel", "1024"]])
def test_cli_cluster_flags_need_nodes(flag, capsys):
    assert _main(["estimate", "--params", "1e9", *flag]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{flag[0]} needs --nodes" in captured.err


def test_comm_model_does_not_import_torch():
    # A bare package object stands in for zerokern (whose __init__ imports torch).
    code = ("import importlib, sys, types\n"
            f"pkg = types.ModuleType('zerokern'); pkg.__path__ = [{str(REPO / 'zerokern')!r}]\n"
            "sys.modules['zerokern'] = pkg\n"
            "m = importlib.import_module('zerokern.comm_model')\n"
            "assert 'torch' not in sys.modules\n"
            "print(m.ring_sent('all_reduce', 8, 4))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "12.0"


# --------------------------------------------------------------------------------------------
# The step plan against zerokern.formulas' hybrid formulas (what comm_stats() is checked with)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes, gpus", [(1, 4), (2, 2), (3, 4), (4, 1), (2, 8)])
def test_plan_matches_the_hybrid_formulas(nodes, gpus):
    psi = 4096 * gpus
    c = _cluster(nodes, gpus)
    dim = {"shard": "shard", "replicate": "replicate", "intra": "shard", "inter": "replicate"}
    for stage in formulas.STAGES:
        cols = cm.step_collectives(stage, psi, c, True, param_bytes=2, grad_bytes=4)
        # paper count per mesh dim: a reduce-scatter or all-gather once, an all-reduce twice
        paper = {"shard": 0.0, "replicate": 0.0}
        nbytes = {"shard": 0.0, "replicate": 0.0}
        for col in cols:
            if col.ranks > 1:
                times = 2 if col.kind == "all_reduce" else 1
                paper[dim[col.group]] += times * col.elements
                nbytes[dim[col.group]] += times * col.nbytes
        assert paper == pytest.approx(formulas.hybrid_comm_elements(stage, psi, gpus, nodes))
        assert nbytes == pytest.approx(formulas.hybrid_comm_bytes(stage, psi, gpus, nodes, 2, 4))
        # what each link carries (ring-exact) is the formulas' wire count
        wire = {dim[k]: v["elements"] for k, v in cm.link_traffic(cols, c).items()}
        assert wire == pytest.approx(formulas.hybrid_wire_elements(stage, psi, gpus, nodes))
