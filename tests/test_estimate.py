"""Tests for ``python -m zerokern estimate``: the formulas (zerokern/formulas.py), the report
dict (zerokern/estimate.py), its text (zerokern/cli/estimate_report.py) and the CLI
(zerokern/cli/estimate.py).

Reference numbers come from the ZeRO paper (Rajbhandari et al., arXiv:1910.02054v3) as quoted
in the annotated copy in the project's seeds: §3.1-3.2, §5.1-5.4 and Table 1, §6.1, §7, §10-11.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerokern import formulas
from zerokern.cli import estimate_report as report
from zerokern.estimate import estimate

REPO = Path(__file__).resolve().parents[1]
GB = 1e9


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "zerokern", "estimate", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _main(argv):
    from zerokern.__main__ import main

    return main(argv)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m zerokern estimate ARGS`` in this process (test_cli_json_subprocess runs the
    real command line once): its exit status, stdout and stderr."""
    capsys.readouterr()
    try:
        code = _main(["estimate", *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return int(code or 0), out.out, out.err


# --------------------------------------------------------------------------------------------
# Memory formulas (§5.1-5.4)
# --------------------------------------------------------------------------------------------


def test_tiny_model_bytes():
    # §1 / §5: Psi = 8 parameters on 4 GPUs -> 128, 56, 44, 32 bytes per GPU.
    got = [formulas.model_state_bytes(s, 8, 4) for s in formulas.STAGES]
    assert got == [128, 56, 44, 32]
    assert formulas.mem_dp(8, 4) == 128
    assert formulas.mem_os(8, 4) == 56
    assert formulas.mem_os_g(8, 4) == 44
    assert formulas.mem_os_g_p(8, 4) == 32


def test_paper_model_on_64_gpus():
    # Figure 1 / Table 1: 7.5B parameters on 64 GPUs -> 120, 31.4, 16.6, 1.88 GB.
    psi, n = 7.5e9, 64
    got = [formulas.model_state_bytes(s, psi, n) / GB for s in formulas.STAGES]
    assert got == pytest.approx([120, 31.40625, 16.640625, 1.875])
    assert [report.fmt_gb(formulas.model_state_bytes(s, psi, n)) for s in formulas.STAGES] == [
        "120",
        "31.4",
        "16.6",
        "1.88",
    ]


# Table 1 of the paper: GB per GPU for stages 1, 2, 3 (DP is 16 Psi in every row).
# Cells quoted in the seeds: 7.5B at N=4 (52.5, 41.3, 30) and N=64 (31.4, 16.6, 1.88),
# 128B at N=64 stage 3 (32, "fits"), 1T at N=1024 stage 3 (15.6). The other cells are the
# paper's printed values, some truncated rather than rounded (4187 for 4187.5), so each cell is
# checked to within one unit of its last printed digit.
TABLE1 = {
    7.5e9: {
        1: ("120", "120", "120"),
        4: ("52.5", "41.3", "30"),
        16: ("35.6", "21.6", "7.5"),
        64: ("31.4", "16.6", "1.88"),
        256: ("30.4", "15.4", "0.47"),
        1024: ("30.1", "15.1", "0.12"),
    },
    128e9: {
        1: ("2048", "2048", "2048"),
        4: ("896", "704", "512"),
        16: ("608", "368", "128"),
        64: ("536", "284", "32"),
        256: ("518", "263", "8"),
        1024: ("513", "257", "2"),
    },
    1e12: {
        1: ("16000", "16000", "16000"),
        4: ("7000", "5500", "4000"),
        16: ("4750", "2875", "1000"),
        64: ("4187", "2218", "250"),
        256: ("4046", "2054", "62.5"),
        1024: ("4011", "2013", "15.6"),
    },
}


@pytest.mark.parametrize("psi", sorted(TABLE1))
def test_table1(psi):
    for n, cells in TABLE1[psi].items():
        assert formulas.mem_dp(psi, n) / GB == pytest.approx(16 * psi / GB)
        for stage, printed in zip((1, 2, 3), cells, strict=True):
            got = formulas.model_state_bytes(stage, psi, n) / GB
            unit = 10.0 ** -(len(printed.split(".")[1]) if "." in printed else 0)
            assert abs(got - float(printed)) < unit, (psi, n, stage, got, printed)


def test_table1_formatting_rounds_half_up():
    # 41.25 GB is printed 41.3 in the paper (round half up, not half to even).
    assert report.fmt_gb(formulas.mem_os_g(7.5e9, 4)) == "41.3"
    assert report.fmt_gb(formulas.mem_os(7.5e9, 4)) == "52.5"
    assert report.fmt_gb(formulas.mem_os_g_p(1e12, 1024)) == "15.6"


def test_other_paper_numbers():
    # §3.1: GPT-2 1.5B needs 24 GB of model states; §10.4: 1.4B under DP = 22.4 GB.
    assert formulas.mem_dp(1.5e9) / GB == pytest.approx(24.0)
    assert formulas.mem_dp(1.4e9) / GB == pytest.approx(22.4)
    # §10.4: 13B with stage 2 on 128 GPUs -> 27.4 GB.
    assert round(formulas.mem_os_g(13e9, 128) / GB, 1) == 27.4
    # §10.3: 60B with 16-way MP = 3.75B per slice; stage 2 on N_d = 4 and 25 -> 20.6, 9.6 GB.
    assert round(formulas.mem_os_g(3.75e9, 4) / GB, 1) == 20.6
    assert round(formulas.mem_os_g(3.75e9, 25) / GB, 1) == 9.6
    # §11: bytes per parameter at N_d = 25: stage 2 2.56, stage 3 0.64.
    assert formulas.mem_os_g(1, 25) == pytest.approx(2.56)
    assert formulas.mem_os_g_p(1, 25) == pytest.approx(0.64)
    # §5.4: a 32 GB GPU holds 2B parameters under DP; stage 3 on 64 GPUs holds 128B.
    assert formulas.mem_dp(2e9) == pytest.approx(32 * GB)
    assert formulas.mem_os_g_p(128e9, 64) == pytest.approx(32 * GB)


def test_k_is_a_parameter():
    assert formulas.mem_dp(10, 1, k=8) == 120
    assert formulas.mem_os(10, 2, k=8) == 40 + 40
    assert formulas.mem_os_g(10, 2, k=8) == 20 + 50
    assert formulas.mem_os_g_p(10, 2, k=8) == 60


def test_bad_inputs_to_functions():
    with pytest.raises(ValueError):
        formulas.mem_os(-1, 4)
    with pytest.raises(ValueError):
        formulas.mem_os(8, 0)
    with pytest.raises(ValueError):
        formulas.model_state_bytes(4, 8, 4)


def test_min_gpus_to_fit():
    cap = 32 * GB
    got = [formulas.min_gpus_to_fit(s, 7.5e9, cap) for s in formulas.STAGES]
    # DP needs 120 GB whatever N; stage 1: 30 + 90/N <= 32 -> N >= 45; stage 2: 15 + 105/N
    # <= 32 -> N >= 7; stage 3: 120/N <= 32 -> N >= 4.
    assert got == [None, 45, 7, 4]
    # exact tie: 128B on 64 GPUs is exactly 32 GB (Table 1 marks it as fitting)
    assert formulas.min_gpus_to_fit(3, 128e9, cap) == 64
    # §5.4: for 1T only stage 3 ever fits; Table 1's columns jump from 256 GPUs (62.5 GB) to
    # 1,024 (15.6 GB), and the exact threshold is 16e12 / 32e9 = 500 GPUs
    assert formulas.min_gpus_to_fit(1, 1e12, cap) is None
    assert formulas.min_gpus_to_fit(2, 1e12, cap) is None
    assert formulas.min_gpus_to_fit(3, 1e12, cap) == 500
    for s in (1, 2, 3):
        for psi in (1e9, 3.3e9, 7.5e9):
            n = formulas.min_gpus_to_fit(s, psi, cap)
            if n is not None:
                assert formulas.model_state_bytes(s, psi, n) <= cap
                assert n == 1 or formulas.model_state_bytes(s, psi, n - 1) > cap


# --------------------------------------------------------------------------------------------
# Communication (§7), model size, activations (§3.2, §6.1)
# --------------------------------------------------------------------------------------------


def test_comm_volumes():
    psi = 7.5e9
    assert [formulas.comm_elements(psi, s) for s in formulas.STAGES] == [2 * psi] * 3 + [3 * psi]
    # §7: 15 billion vs 22.5 billion numbers per step for the 7.5B model: 1.5x
    assert formulas.comm_elements(psi, 0) == 15e9
    assert formulas.comm_elements(psi, 3) == 22.5e9
    assert formulas.comm_bytes(psi, 3) == 45e9  # 2 bytes per fp16/bf16 element
    assert formulas.comm_seconds(psi, 0, 100) == pytest.approx(0.3)
    assert formulas.comm_seconds(psi, 3, 100) == pytest.approx(0.45)
    assert formulas.comm_elements(8, 0) == 16 and formulas.comm_elements(8, 3) == 24


def test_gpt_param_count():
    # §10.1: 125 layers of width 8192 -> about 100.7B parameters.
    assert formulas.gpt_params(125, 8192) == 12 * 125 * 8192**2
    assert round(formulas.gpt_params(125, 8192) / 1e9, 1) == 100.7
    # GPT-2 1.5B: h = 1600, L = 48 -> 1.47B by the 12 L H^2 rule
    assert formulas.gpt_params(48, 1600) == 1_474_560_000


def test_activations():
    # §3.2 footnote: 12 * h * b * s * L values; toy h=2, b=1, s=3, L=1 -> 72 values, 144 bytes
    assert formulas.activation_values(2, 1, 3, 1) == 72
    assert formulas.activation_bytes(2, 1, 3, 1) == 144
    # GPT-2 1.5B at b=32, s=1024: 30.2e9 values, "about 60 GB" (60.4) in fp16
    assert round(formulas.activation_values(1600, 32, 1024, 48) / 1e9, 1) == 30.2
    assert round(formulas.activation_bytes(1600, 32, 1024, 48) / GB, 1) == 60.4
    # §6.1: checkpoints of the 100B model (L=125, h=8192, b=32, s=1024): 33.6e9 values
    assert round(formulas.checkpoint_values(8192, 32, 1024, 125) / 1e9, 1) == 33.6
    assert formulas.checkpoint_bytes(8192, 32, 1024, 125) == 2 * 8192 * 32 * 1024 * 125


def test_activations_count_against_gpu_mem():
    r = estimate(1.5e9, gpus=[1], gpu_mem_gb=32, layers=48, hidden=1600, batch=32, seq=1024)
    assert r["activations"]["counted_in_fit_bytes"] == formulas.activation_bytes(1600, 32, 1024, 48)
    assert r["rows"][0]["fits"] == {f"stage{s}": False for s in formulas.STAGES}
    r = estimate(
        1.5e9,
        gpus=[1],
        gpu_mem_gb=32,
        layers=48,
        hidden=1600,
        batch=32,
        seq=1024,
        checkpointing=True,
    )
    assert r["rows"][0]["fits"]["stage0"] is True  # 24 GB + 5.03 GB checkpoints <= 32 GB


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------


def test_module_does_not_import_torch():
    # Load the CLI, its report, the estimate and the formulas without running the zerokern
    # package's __init__ (which imports torch): a bare package object stands in for it. None
    # of these modules may pull in torch or matplotlib.
    code = (
        "import importlib, sys, types\n"
        f"pkg = types.ModuleType('zerokern'); pkg.__path__ = [{str(REPO / 'zerokern')!r}]\n"
        "sys.modules['zerokern'] = pkg\n"
        "for name in ('zerokern.cli.estimate', 'zerokern.cli.estimate_report',\n"
        "             'zerokern.estimate', 'zerokern.formulas'):\n"
        "    m = importlib.import_module(name)\n"
        "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules\n"
        "print(m.mem_os_g_p(8, 4))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "32.0"


def test_cli_json_subprocess():
    p = _run_cli(
        "--params", "7.5e9", "--gpus", "1", "4", "64", "--gpu-mem", "32", "--bandwidth", "100",
        "--json",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["params"] == 7.5e9 and r["k"] == 12 and r["gpus"] == [1, 4, 64]
    rows = {row["gpus"]: row for row in r["rows"]}
    assert [rows[64]["gb"][f"stage{s}"] for s in formulas.STAGES] == pytest.approx(
        [120, 31.40625, 16.640625, 1.875]
    )
    assert [rows[4]["gb"][f"stage{s}"] for s in formulas.STAGES] == pytest.approx(
        [120, 52.5, 41.25, 30]
    )
    assert rows[64]["bytes"]["stage3"] == formulas.mem_os_g_p(7.5e9, 64)
    assert rows[64]["fits"] == {"stage0": False, "stage1": True, "stage2": True, "stage3": True}
    assert rows[4]["fits"] == {"stage0": False, "stage1": False, "stage2": False, "stage3": True}
    assert r["min_gpus_to_fit"] == {"stage0": None, "stage1": 45, "stage2": 7, "stage3": 4}
    comm = r["communication"]["stages"]
    assert [comm[f"stage{s}"]["elements"] for s in formulas.STAGES] == [15e9, 15e9, 15e9, 22.5e9]
    assert comm["stage3"]["bytes"] == 45e9
    assert comm["stage0"]["seconds"] == pytest.approx(0.3)
    assert comm["stage3"]["seconds"] == pytest.approx(0.45)
    assert "ring" in r["communication"]["counting"]


def test_cli_table(capsys):
    code, out, err = _cli(
        capsys, "--params", "7.5e9", "--gpus", "1", "4", "16", "64", "256", "1024",
        "--gpu-mem", "32", "--bandwidth", "100",
    )  # fmt: skip
    assert code == 0, err
    row64 = next(line for line in out.splitlines() if line.split()[:1] == ["64"])
    assert row64.split() == ["64", "120", "31.4", "*", "16.6", "*", "1.88", "*"]
    row4 = next(line for line in out.splitlines() if line.split()[:1] == ["4"])
    assert row4.split() == ["4", "120", "52.5", "41.3", "30.0", "*"]
    assert "fewest GPUs that fit: DP never, P_os 45, P_os+g 7, P_os+g+p 4" in out
    assert "300.0 ms" in out and "450.0 ms" in out
    assert "§7" in out and "ring" in out
    assert all(line == line.rstrip() for line in out.splitlines())


def test_cli_layers_hidden_in_process(capsys):
    assert _main(["estimate", "--layers", "125", "--hidden", "8192", "--gpus", "64", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["params"] == formulas.gpt_params(125, 8192)
    assert r["param_source"] == "layers_hidden"
    assert r["rows"][0]["bytes"]["stage3"] == pytest.approx(
        16 * formulas.gpt_params(125, 8192) / 64
    )


def test_cli_activations_in_process(capsys):
    argv = ["estimate", "--params", "1.5B", "--layers", "48", "--hidden", "1600"]
    argv += ["--batch", "32", "--seq", "1024", "--gpus", "1", "--gpu-mem", "32"]
    assert _main(argv) == 0
    out = capsys.readouterr().out
    assert "60.4 GB" in out and "5.03 GB" in out
    assert _main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["params"] == 1.5e9
    assert r["activations"]["no_checkpointing_gb"] == pytest.approx(60.3979776)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--params", "-1"], "--params"),
        (["--params=-7.5e9"], "--params"),
        (["--params", "-7.5e9"], "--params"),
        (["--params", "0"], "--params"),
        (["--params", "lots"], "--params"),
        (["--params", "7.5e9", "--gpus", "0"], "--gpus"),
        (["--params", "7.5e9", "--gpus", "4", "-3"], "--gpus"),
        (["--params", "7.5e9", "--gpu-mem", "0"], "--gpu-mem"),
        (["--params", "7.5e9", "--bandwidth", "-5"], "--bandwidth"),
        (["--params", "7.5e9", "--k", "-1"], "--k"),
        (["--layers", "0", "--hidden", "10"], "--layers"),
    ],
)
def test_bad_arguments(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        _main(["estimate", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "--params"),
        (["--layers", "12"], "--hidden"),
        (["--params", "1e9", "--batch", "4"], "--seq"),
        (["--params", "1e9", "--batch", "4", "--seq", "128"], "--layers"),
    ],
)
def test_missing_arguments(argv, needle, capsys):
    assert _main(["estimate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error" in captured.err and needle in captured.err


def test_zero_gpus_exits_2_naming_the_argument(capsys):
    code, out, err = _cli(capsys, "--params", "7.5e9", "--gpus", "0")
    assert code == 2
    assert "argument --gpus" in err and out == ""


def test_dispatcher_skips_missing_command_module(monkeypatch, capsys):
    import zerokern.__main__ as zmain

    monkeypatch.setattr(
        zmain,
        "COMMANDS",
        [*zmain.COMMANDS, ("nosuchcmd", "zerokern.cli._no_such_demo_module", "not written yet")],
    )
    assert zmain.main(["estimate", "--params", "8", "--gpus", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["rows"][0]["bytes"] == {"stage0": 128, "stage1": 56, "stage2": 44, "stage3": 32}
    with pytest.raises(SystemExit) as exc:
        zmain.main(["nosuchcmd"])
    assert exc.value.code == 2
    assert "not available" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# --plot
# --------------------------------------------------------------------------------------------


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "mem.png"
    argv = ["estimate", "--params", "7.5e9", "--gpu-mem", "32", "--plot", str(out)]
    assert _main(argv) == 0
    data = out.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.png"]  # no temp file left
    assert "plot written to" in capsys.readouterr().out


def test_plot_bad_directory(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "missing-dir" / "mem.png"
    assert _main(["estimate", "--params", "7.5e9", "--plot", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "could not write" in captured.err
    assert not out.exists()


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    # Make "import matplotlib" fail in-process, as if it were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "mem.png"
    assert _main(["estimate", "--params", "7.5e9", "--plot", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing half-done: no table printed
    assert "pip install matplotlib" in captured.err
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# ZeRO-Offload rows (device and host bytes per rank)
# --------------------------------------------------------------------------------------------


def test_offload_bytes_split_the_paper_formulas_between_device_and_host():
    psi, n = 7.5e9, 64
    for stage, variant in ((1, "stage1_offload"), (2, "stage2_offload"), (3, "stage3_offload")):
        dev, host = formulas.offload_bytes(variant, psi, n)
        # Device + host is the stage's model-state total; stage 1 keeps its full-size
        # gradient on the device and the host holds a copy of the shard's part of it.
        extra = 2 * psi / n if stage == 1 else 0
        assert dev + host == pytest.approx(formulas.model_state_bytes(stage, psi, n) + extra)
        assert host == pytest.approx(14 * psi / n)  # 12 (master, m, v) + 2 (gradient shard)
    assert formulas.offload_bytes("stage2_offload", psi, n)[0] == 2 * psi
    assert formulas.offload_bytes("stage3_offload_params", psi, n) == (0, 16 * psi / n)
    assert formulas.offload_bytes("stage2_offload", 8, 4) == (16.0, 28.0)
    with pytest.raises(ValueError, match="offload variant"):
        formulas.offload_bytes("stage0_offload", psi, n)


def test_offload_fewest_gpus_against_brute_force():
    psi = 7.5e9
    for variant in formulas.OFFLOAD_VARIANTS:
        for dev_gb, host_gb in ((32, 64), (16, 8), (8, None), (1, 256), (40, 1)):
            cap, hcap = dev_gb * GB, None if host_gb is None else host_gb * GB
            got = formulas.offload_min_gpus_to_fit(variant, psi, cap, hcap)
            brute = next((n for n in range(1, 5000)
                          if formulas.fits(formulas.offload_bytes(variant, psi, n)[0], cap)
                          and (hcap is None
                               or formulas.fits(formulas.offload_bytes(variant, psi, n)[1],
                                                hcap))), None)
            assert got == brute, (variant, dev_gb, host_gb, got, brute)


def test_offload_rows_in_report_json_and_text(capsys):
    r = estimate(7.5e9, gpus=[4, 64], gpu_mem_gb=32, host_mem_gb=64)
    off = r["offload"]
    assert off["host_mem_gb"] == 64
    row = off["rows"][1]
    assert row["device_bytes"]["stage2_offload"] == 15e9
    assert row["host_bytes"]["stage2_offload"] == pytest.approx(14 * 7.5e9 / 64)
    assert row["fits"]["stage2_offload"] is True
    assert off["min_gpus_to_fit"]["stage2_offload"] == 2  # host: 105/N <= 64 from N = 2
    text = report.format_report(r)
    assert "ZeRO-Offload: device GB / host GB per GPU" in text
    assert "15.0 / 1.64 *" in text and "--host-mem 64 GB" in text
    section = text.split("ZeRO-Offload:")[1].split("Communication")[0]
    assert max(len(line) for line in section.splitlines()) <= 100
    assert _main(["estimate", "--params", "7.5e9", "--gpus", "64", "--host-mem", "8",
                  "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["offload"]["host_mem_gb"] == 8
    assert got["offload"]["rows"][0]["fits"]["stage3_offload_params"] is True  # 1.88 <= 8
    assert _main(["estimate", "--params", "7.5e9", "--gpus", "1", "--host-mem", "8",
                  "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["offload"]["rows"][0]["fits"]["stage2_offload"] is False  # 105 GB > 8
    assert got["min_gpus_to_fit"] is None  # no --gpu-mem: the device rows are unchanged


def test_host_mem_must_be_positive(capsys):
    code, _, err = _cli(capsys, "--params", "1e9", "--host-mem", "0")
    assert code == 2 and "--host-mem" in err


# --------------------------------------------------------------------------------------------
# Compressed optimizer state (issue 27): --moments / --master set K
# --------------------------------------------------------------------------------------------

# K by hand for parameters of at least 4,096 elements: master + exp_avg + exp_avg_sq bytes,
# and for int8 one fp32 absmax per 256 elements for each moment. The host K of an offloaded
# master="none" state adds the bf16 copy of the shard the CPU step updates (2 bytes).
FORMAT_K = {("fp32", "fp32"): 4 + 4 + 4, ("bf16", "fp32"): 4 + 2 + 2,
            ("int8", "fp32"): 4 + 1 + 1 + 2 * 4 / 256, ("fp32", "none"): 4 + 4,
            ("bf16", "none"): 2 + 2, ("int8", "none"): 1 + 1 + 2 * 4 / 256}


@pytest.mark.parametrize("moments,master", sorted(FORMAT_K))
def test_format_k(moments, master):
    k = FORMAT_K[moments, master]
    assert formulas.optimizer_bytes_per_param(2, moments, master) == k
    parts = formulas.optimizer_state_parts(moments, master)
    assert float(sum(parts.values())) == k
    host = k + (2 if master == "none" else 0)
    assert formulas.optimizer_bytes_per_param(2, moments, master, on_host=True) == host
    for v in formulas.OFFLOAD_VARIANTS:
        # stage 3's parameter shard in host memory is updated in place: no copy beside it
        want = k if (v == "stage3_offload_params" and master == "none") else host
        assert formulas.offload_k(v, moments, master) == want, v
    assert formulas.k_formula_text(moments, master).endswith(f"= {k:g}")
    # fp32 parameters are their own master (8 with fp32 moments, the paper's fp32 case)
    if master == "fp32":
        assert formulas.optimizer_bytes_per_param(4, moments, master) == k - 4


def test_format_constants_match_the_optimizer():
    from zerokern.quant.adamw import MASTER_MODES, MIN_COMPRESSED_NUMEL, MOMENT_FORMATS
    from zerokern.quant.maps import BLOCK

    assert formulas.MIN_COMPRESSED_NUMEL == MIN_COMPRESSED_NUMEL
    assert formulas.QUANT_BLOCK == BLOCK
    assert formulas.MOMENT_FORMATS == MOMENT_FORMATS and formulas.MASTER_MODES == MASTER_MODES


def test_format_refusals():
    with pytest.raises(ValueError, match="moments must be one of"):
        formulas.optimizer_bytes_per_param(2, "int4")
    with pytest.raises(ValueError, match="master must be one of"):
        formulas.optimizer_bytes_per_param(2, "int8", "bf16")
    with pytest.raises(ValueError, match="master='none' needs 16-bit"):
        formulas.optimizer_bytes_per_param(4, "int8", "none")
    with pytest.raises(ValueError, match="give k or moments/master"):
        estimate(7.5e9, k=8, moments="int8")
    with pytest.raises(ValueError, match="moments must be one of"):
        estimate(7.5e9, moments="fp8")


def test_estimate_rows_with_int8_moments_and_no_master():
    psi = 7.5e9
    r = estimate(psi, gpus=[1, 64], gpu_mem_gb=32, moments="int8", master="none")
    k = 2.03125
    assert r["k"] == k and (r["moments"], r["master"]) == ("int8", "none")
    assert r["k_parts"] == {"master": 0.0, "exp_avg": 1.0, "exp_avg_sq": 1.0,
                            "exp_avg_absmax": 1 / 64, "exp_avg_sq_absmax": 1 / 64}
    row = r["rows"][1]  # N = 64, by hand: 2 + 2 bytes of weights and gradients, K state
    assert row["bytes"] == {"stage0": (4 + k) * psi, "stage1": 4 * psi + k * psi / 64,
                            "stage2": 2 * psi + (2 + k) * psi / 64,
                            "stage3": (4 + k) * psi / 64}
    assert r["min_gpus_to_fit"] == {"stage0": None, "stage1": 8, "stage2": 2, "stage3": 2}
    off = r["offload"]
    assert off["variants"]["stage2_offload"]["k"] == k + 2
    assert off["variants"]["stage3_offload_params"]["k"] == k
    assert off["rows"][1]["host_bytes"]["stage2_offload"] == pytest.approx(
        (2 + k + 2) * psi / 64)
    assert off["rows"][1]["host_bytes"]["stage3_offload_params"] == pytest.approx(
        (4 + k) * psi / 64)
    text = report.format_report(r)
    assert "K = 2.03125 optimizer state = 6.03125" in text
    assert "moments=int8, master=none: K = 1 + 1 int8 moments + 2 x 4/256 fp32 absmax" in text
    assert "K on the host: 2 bf16 copy + 1 + 1 int8 moments" in text
    assert all(line == line.rstrip() for line in text.splitlines())
    # The default format's report is the paper's, unchanged.
    assert estimate(psi)["k"] == 12 and estimate(psi)["k_parts"]["master"] == 4.0
    assert "optimizer state: moments" not in report.format_report(estimate(psi))


@pytest.mark.parametrize("moments,master", sorted(FORMAT_K))
def test_cli_moments_master_json(moments, master, capsys):
    argv = ["estimate", "--params", "1e9", "--gpus", "4", "--json", "--moments", moments,
            "--master", master]
    assert _main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    k = FORMAT_K[moments, master]
    assert r["k"] == k
    assert r["rows"][0]["bytes"]["stage2"] == pytest.approx(2e9 + (2 + k) * 1e9 / 4)


def test_cli_int8_no_master_table(capsys):
    code, out, err = _cli(capsys, "--params", "7.5e9", "--gpus", "1", "64", "--gpu-mem", "32",
                          "--moments", "int8", "--master", "none")
    assert code == 0, err
    # (2 + 2 + 2.03125) x 7.5 = 45.2 GB at N = 1; at 64: 30.2, 15.5, 0.707 GB
    row64 = next(line for line in out.splitlines() if line.split()[:1] == ["64"])
    assert row64.split() == ["64", "45.2", "30.2", "*", "15.5", "*", "0.707", "*"]
    assert "K = 2.03125" in out and "fewest GPUs that fit: DP never, P_os 8" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--params", "1e9", "--moments", "int4"], "argument --moments"),
        (["--params", "1e9", "--master", "bf16"], "argument --master"),
    ],
)
def test_cli_bad_format(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        _main(["estimate", *argv])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_cli_k_and_format_together_refused(capsys):
    assert _main(["estimate", "--params", "1e9", "--k", "8", "--moments", "int8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "give --k or --moments/--master" in captured.err
    assert _main(["estimate", "--params", "8", "--gpus", "4", "--k", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["k"] == 8  # --k alone still sets K
