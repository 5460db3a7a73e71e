"""Fused AdamW step, every optimizer-state format: zerokern vs torch, bitsandbytes and torchao,
side by side in one run.

    python bench/bench_adam.py                          # CPU: 2^20 and 2^25 elements
    python bench/bench_adam.py --sizes 25 --rounds 7
    python bench/bench_adam.py --all                    # + torch forloop/foreach, every backend
    python bench/bench_adam.py --quick                  # tiny sizes, 2 rounds: a smoke test

Every provider updates one flat tensor of n parameters (one shard), from the same initial
values (randn * 0.02) and the same gradient (randn); torch's AdamW and zerokern's providers get
their arrays laid out alike (carve: one buffer, the same gap between arrays), because where
the arrays land moved the same kernel by up to 2x on an AMD machine:
  torch_fused         torch.optim.AdamW(fused=True) on an fp32 param and fp32 grad: the
                      baseline of "x_vs_base" (torch_foreach if fused does not run here)
  torch_mixed         torch doing our mixed-precision work: bf16 grad cast to fp32, fused AdamW
                      on the fp32 master, the master copied into the bf16 param
  torch_forloop, torch_foreach   (--all) torch.optim.AdamW's other implementations
  zk_fp32_<b>         zerokern.ops.fused_adamw_ (today's format): bf16 grad, fp32 master and
                      moments, the bf16 param written in the same pass
  zk_bf16_<b>         zerokern.ops.fused_adamw_compressed_, bf16 moments, fp32 master, bf16 copy
  zk_int8_<b>         the same with 8-bit block-wise moments (uint8 codes, one fp32 absmax per
                      256 elements per moment), fp32 master, bf16 copy
  zk_int8_nomaster_<b>  8-bit moments and no master: the bf16 param updated in place with
                      stochastic rounding (sr_index, seed)
  zk_int8v3_<b>, zk_int8v3_nomaster_<b>  the same two with int8 format version 3
                      (zerokern.quant.fmt_v3: computed maps; cpu and torch backends only)
  bnb_adamw8bit       bitsandbytes.optim.AdamW8bit on an fp32 param and fp32 grad
  torchao_adamw8bit   torchao.optim.AdamW8bit (torch.compile'd) on an fp32 param and fp32 grad
  ds_cpu_adam         DeepSpeed's DeepSpeedCPUAdam (ZeRO-Offload's host step, AdamW mode) on
                      an fp32 param, grad and moments (CPU only; DS_ACCELERATOR=cpu without
                      a GPU; its op is JIT-built on first use)
<b> is the backend that ran: the fastest one that works for that format on the device (a
backend that refuses, e.g. a native kernel not built yet, is skipped with its reason printed);
--all times every working backend. bitsandbytes and torchao are optional: a missing or failing
one is skipped with the reason printed and recorded.

"bytes_per_elem" is what a format must read and write per element (absmax included):
fp32 AdamW 28 (grad, param, m, v read; param, m, v written), zk_fp32 28 (bf16 grad and param
instead of fp32 grad), bf16 moments 20, int8 moments with master 16.06, without 10.06, the
8-bit anchors on fp32 params 16.06; torch_mixed is counted as the zk_fp32 work (28), not the
40 its three passes move. GB/s = n x bytes_per_elem / median time.

"The limit" is the machine's memory bandwidth at that size, measured in the same run: a
STREAM-like triad (a = b + 3 c over n fp32 elements, 12 bytes each, pages touched before
timing) timed in the same interleaved rounds as the providers, its best round; and never
below the best round of torch's fused AdamW (28 bytes per element), which a triad that
torch's own kernel beats would not be a limit. "pct_limit" = a row's GB/s / the limit: how
close a format comes to moving its bytes at the memory's speed.

Before timing, each provider's first step is checked against AdamW's first step in closed
form (p <- p (1 - lr wd) - lr g / (|g| + eps), from the inputs the provider got): the cosine
of the two updates ("update_cos", must exceed 0.95: every format reproduces step 1 up to its
rounding; a provider that does nothing or the wrong thing fails the run). Then the providers
are timed in interleaved rounds (_harness.time_interleaved); each ratio is taken within a
round: "x_vs_base" = baseline ms / row ms (> 1: faster than torch fused fp32), "x_vs_bnb" and
"x_vs_torchao" = that anchor's ms / row ms, each the median over rounds with its spread.
On a small shared CPU box run with OMP_NUM_THREADS=1 (bench/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

from zerokern import ops  # noqa: E402
from zerokern.ops._backend import available_backends  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BLOCK = 256
ABSMAX = 2 * 2 * 4 / BLOCK  # two fp32 absmax per 256 elements, read and written
FORMATS = {  # zk format -> (moments, master, bytes per element)
    "fp32": ("fp32", "fp32", 28.0),
    "bf16": ("bf16", "fp32", 20.0),
    "int8": ("int8", "fp32", 16.0 + ABSMAX),
    "int8_nomaster": ("int8", "none", 10.0 + ABSMAX),
    "int8v3": ("int8", "fp32", 16.0 + ABSMAX),
    "int8v3_nomaster": ("int8", "none", 10.0 + ABSMAX),
}
VERSION = {"int8v3": 3, "int8v3_nomaster": 3}  # int8 format version (zerokern.quant.fmt_v3)
ANCHORS = ("bnb_adamw8bit", "torchao_adamw8bit")
MIN_COS = 0.95
TRIAD = "stream_triad"


@dataclass
class Provider:
    """One timed step plus what the step-1 check needs: the param as fp32 after it, and the
    param and grad values (as fp32) the provider started from."""

    step: Callable[[], object]
    param: Callable[[], torch.Tensor]
    p0: torch.Tensor
    g: torch.Tensor
    bytes_per_elem: float
    what: str


GAP_BYTES = 16384 + 64
"""Bytes between two consecutive arrays of one provider (:func:`carve`)."""


def carve(device: torch.device, *specs: tuple[int, torch.dtype]) -> list[torch.Tensor]:
    """One provider's arrays (``(numel, dtype)`` each), carved in order from one buffer, each
    64-byte aligned and :data:`GAP_BYTES` after the previous one, so that every provider's
    arrays lie the same way relative to each other. The placement alone moved the same
    kernel a lot: on a 2-core AMD EPYC VM, torch's fused AdamW and zerokern's fp32 kernel took
    30 to 66 ms at 2^25 elements depending only on the distance between their four arrays (the
    two kernels alike, within 5%, at each distance), and arrays allocated one after another
    fall a power of two plus one page apart, among the slowest; left to the allocator, the
    ratio of two providers measured where their arrays happened to land."""
    sizes = [numel * torch.empty(0, dtype=dt).element_size() for numel, dt in specs]
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // 64) * 64 + GAP_BYTES
    buf = torch.empty(end, dtype=torch.uint8, device=device)
    return [buf[a:a + size].view(dt) for a, size, (_, dt) in zip(starts, sizes, specs, strict=True)]


def inputs(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared initial param (randn * 0.02, GPT-like magnitudes) and gradient."""
    gen = torch.Generator(device=device).manual_seed(0)
    p0 = torch.randn(n, device=device, generator=gen).mul_(0.02)
    g = torch.randn(n, device=device, generator=gen)
    return p0, g


def _torch_param(n: int, device: torch.device) -> torch.nn.Parameter:
    p0, g = inputs(n, device)
    p = torch.nn.Parameter(p0)
    p.grad = g
    return p


def torch_opt(n: int, device: torch.device, mode: str) -> Provider:
    p0, g0 = inputs(n, device)
    pa, g, m, v = carve(device, *[(n, torch.float32)] * 4)
    pa.copy_(p0)
    g.copy_(g0)
    m.zero_()
    v.zero_()
    p = torch.nn.Parameter(pa)
    p.grad = g
    kw = {"forloop": dict(foreach=False), "foreach": dict(foreach=True),
          "fused": dict(fused=True)}[mode]
    opt = torch.optim.AdamW([p], **HP, **kw)
    # The moments carved with the rest, set as the state AdamW's first step would create.
    step0 = torch.zeros((), dtype=torch.float32, device=device if mode == "fused" else "cpu")
    opt.state[p] = {"step": step0, "exp_avg": m, "exp_avg_sq": v}
    return Provider(opt.step, lambda: p.detach(), p0, g, 28.0,
                    f"torch.optim.AdamW({next(iter(kw))}=True), fp32 param and grad")


def torch_mixed(n: int, device: torch.device) -> Provider:
    p0, g = inputs(n, device)
    master = torch.nn.Parameter(p0.clone())
    p16 = p0.to(torch.bfloat16)
    g16 = g.to(torch.bfloat16)
    opt = torch.optim.AdamW([master], **HP, fused=True)

    def step() -> None:
        master.grad = g16.float()
        opt.step()
        p16.copy_(master.detach())

    return Provider(step, lambda: master.detach(), p0, g16.float(), 28.0,
                    "bf16 grad -> fp32, AdamW(fused) on the fp32 master, copy to bf16 param")


def zk(n: int, device: torch.device, fmt: str, backend: str) -> Provider:
    """zerokern's step in format ``fmt`` (FORMATS) on ``backend``."""
    moments, master, nbytes = FORMATS[fmt]
    p0, g = inputs(n, device)
    st = {"step": 0}
    hp = dict(lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"],
              weight_decay=HP["weight_decay"])
    if fmt == "fp32":
        f32, b16 = torch.float32, torch.bfloat16
        param, g16, m, v, p16 = carve(device, (n, f32), (n, b16), (n, f32), (n, f32), (n, b16))
        param.copy_(p0)
        g16.copy_(g)
        m.zero_()
        v.zero_()

        def step() -> None:
            st["step"] += 1
            ops.fused_adamw_(param, g16, m, v, **hp, step=st["step"], param_lp=p16,
                             backend=backend)

        return Provider(step, lambda: param, p0, g16.float(), nbytes,
                        f"ops.fused_adamw_(backend={backend!r}), bf16 grad, fp32 master/m/v, "
                        "bf16 param out")
    pdt = torch.float32 if master == "fp32" else torch.bfloat16
    param, g16, kw = compressed_state(n, device, moments, master, pdt)
    param.copy_(p0)
    g16.copy_(g)
    start = param.to(torch.float32, copy=True)  # the start (bf16-rounded without master)

    def cstep() -> None:
        st["step"] += 1
        ops.fused_adamw_compressed_(param, g16, **kw, **hp, step=st["step"], backend=backend,
                                    format_version=VERSION.get(fmt, 2))

    what = (f"ops.fused_adamw_compressed_(backend={backend!r}), {moments} moments "
            f"(format version {VERSION.get(fmt, 2)}), "
            + ("fp32 master, bf16 param out" if master == "fp32"
               else "bf16 param, stochastic rounding"))
    return Provider(cstep, lambda: param.float(), start, g16.float(), nbytes, what)


def compressed_state(n: int, device: torch.device, moments: str, master: str,
                     pdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
    """The param (dtype pdt) and bf16 grad of one flat range of n elements (one parameter
    starting at element 0), uninitialised, and the keyword arguments of
    fused_adamw_compressed_ that hold its state: zero moments, and the absmax, the bf16 copy or
    the stochastic-rounding key the format needs. All carved together (carve)."""
    nb = -(-n // BLOCK)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[moments]
    specs = [(n, pdt), (n, torch.bfloat16), (n, dt), (n, dt)]
    specs += [(nb, torch.float32)] * 2 * (moments == "int8")
    specs += [(n, torch.bfloat16)] * (master == "fp32")
    param, g16, *arrays = carve(device, *specs)
    for a in arrays:
        a.zero_()
    kw: dict[str, object] = {"exp_avg": arrays[0], "exp_avg_sq": arrays[1]}
    if moments == "int8":
        kw["exp_avg_absmax"], kw["exp_avg_sq_absmax"] = arrays[2], arrays[3]
    if master == "fp32":
        kw["param_lp"] = arrays[-1]
    else:
        kw["sr_index"] = BLOCK * torch.arange(nb, device=device, dtype=torch.int64)
        kw["seed"] = 0
    return param, g16, kw


def bnb_adamw8bit(n: int, device: torch.device) -> Provider:
    import bitsandbytes as bnb

    p = _torch_param(n, device)
    p0 = p.detach().clone()
    opt = bnb.optim.AdamW8bit([p], **HP)
    return Provider(opt.step, lambda: p.detach(), p0, p.grad, 16.0 + ABSMAX,
                    f"bitsandbytes {bnb.__version__} AdamW8bit, fp32 param and grad")


def ds_cpu_adam(n: int, device: torch.device) -> Provider:
    """DeepSpeed's host step of ZeRO-Offload (DeepSpeedCPUAdam, AdamW mode) on the same flat
    fp32 shard, carved like torch's arrays; its native op is JIT-built on first use (set
    DS_ACCELERATOR=cpu on a machine without a GPU)."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if device.type != "cpu":
        raise ValueError("DeepSpeedCPUAdam steps host tensors only")
    p0, g0 = inputs(n, device)
    pa, g = carve(device, (n, torch.float32), (n, torch.float32))
    pa.copy_(p0)
    g.copy_(g0)
    p = torch.nn.Parameter(pa)
    p.grad = g
    opt = DeepSpeedCPUAdam([p], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                           weight_decay=HP["weight_decay"], adamw_mode=True)
    return Provider(opt.step, lambda: p.detach(), p0, g0, 28.0,
                    f"deepspeed {deepspeed.__version__} DeepSpeedCPUAdam (adamw_mode), fp32 "
                    "param, grad and moments")


def torchao_adamw8bit(n: int, device: torch.device) -> Provider:
    import torchao
    from torchao.optim import AdamW8bit

    p = _torch_param(n, device)
    p0 = p.detach().clone()
    opt = AdamW8bit([p], **HP)
    return Provider(opt.step, lambda: p.detach(), p0, p.grad, 16.0 + ABSMAX,
                    f"torchao {torchao.__version__} AdamW8bit (torch.compile), fp32 param "
                    "and grad")


def fused_runs(device: torch.device) -> bool:
    """Whether torch.optim.AdamW(fused=True) runs on this device (CPU since torch 2.4)."""
    try:
        p = torch.nn.Parameter(torch.zeros(4, device=device))
        p.grad = torch.ones(4, device=device)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def working_backends(fmt: str, device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The backends that run format ``fmt`` here (fastest first), found by one step on 512
    elements each, and why each other one did not."""
    ok, why = [], {}
    for b in available_backends(device):
        try:
            zk(512, device, fmt, b).step()
            ok.append(b)
        except Exception as exc:  # a backend not built, not compiled for this device, ...
            why[b] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    return ok, why


def providers(device: torch.device, every: bool, only: list[str] | None
              ) -> tuple[dict[str, Callable[[int], Provider]], str, list[str]]:
    """Factories by row name, the baseline's name, and the notes on what was skipped."""
    notes: list[str] = []
    out: dict[str, Callable[[int], Provider]] = {}
    base = "torch_fused" if fused_runs(device) else "torch_foreach"

    def wanted(name: str) -> bool:
        return not only or name == base or any(name == o or name.startswith(o + "_")
                                               for o in only)

    if base != "torch_fused":
        notes.append("torch_fused: AdamW(fused=True) does not run here; baseline torch_foreach")
    modes = ["forloop", "foreach", "fused"] if every else [base.split("_")[1]]
    for mode in modes:
        out[f"torch_{mode}"] = lambda n, mode=mode: torch_opt(n, device, mode)
    out["torch_mixed"] = lambda n: torch_mixed(n, device)
    for fmt in FORMATS:
        if not wanted(f"zk_{fmt}"):
            continue
        ok, why = working_backends(fmt, device)
        notes += [f"zk_{fmt}: backend {b} skipped: {w}" for b, w in why.items()]
        for b in ok if every else ok[:1]:
            out[f"zk_{fmt}_{b}"] = lambda n, fmt=fmt, b=b: zk(n, device, fmt, b)
    for name, make in (("bnb_adamw8bit", bnb_adamw8bit),
                       ("torchao_adamw8bit", torchao_adamw8bit),
                       ("ds_cpu_adam", ds_cpu_adam)):
        if not wanted(name):
            continue
        try:
            make(4096, device).step()
            out[name] = lambda n, make=make: make(n, device)
        except Exception as exc:  # optional providers: not installed or not for this device
            notes.append(f"{name}: skipped: {type(exc).__name__}: {exc}".splitlines()[0][:200])
    return {k: v for k, v in out.items() if wanted(k)}, base, notes


def update_cos(prov: Provider) -> float:
    """One step, then the cosine between the provider's update and AdamW's first step in
    closed form from the same inputs (the ratios below mean nothing for a wrong step)."""
    prov.step()
    got = prov.param().float() - prov.p0
    lr, wd, eps = HP["lr"], HP["weight_decay"], HP["eps"]
    want = -lr * wd * prov.p0 - lr * prov.g / (prov.g.abs() + eps)
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=0).item()
    return cos


def bench(device: torch.device, sizes: list[int], rounds: int, bw: float,
          meta: dict[str, str], every: bool, only: list[str] | None,
          clock: Callable[[], float] = time.perf_counter) -> list[dict[str, object]]:
    facts, base, notes = providers(device, every, only)
    for note in notes:
        print(f"# {note}")
    rows: list[dict[str, object]] = []
    for lg in sizes:
        n = 1 << lg
        provs = {name: make(n) for name, make in facts.items()}
        cos = {name: update_cos(p) for name, p in provs.items()}
        for name, c in cos.items():
            if not c > MIN_COS:
                raise AssertionError(f"{name} at 2^{lg}: update cosine {c:.4f} against AdamW's "
                                     f"first step (want > {MIN_COS})")
        fns = {k: p.step for k, p in provs.items()}
        fns[TRIAD] = H.triad(n, device)
        samples = H.time_interleaved(fns, device, rounds=rounds, clock=clock)
        triad_ms = samples.pop(TRIAD)
        triad_gbs = n * H.TRIAD_BYTES_PER_ELEM / (min(triad_ms) * 1e-3) / 1e9
        limit, limit_by = triad_gbs, "triad"
        fused = n * provs[base].bytes_per_elem / (min(samples[base]) * 1e-3) / 1e9
        if fused > limit:
            limit, limit_by = fused, base
        print(f"# 2^{lg}: limit {limit:.1f} GB/s ({limit_by}; triad best "
              f"{n * H.TRIAD_BYTES_PER_ELEM / (min(triad_ms) * 1e-3) / 1e9:.1f}, median "
              f"{n * H.TRIAD_BYTES_PER_ELEM / (statistics.median(triad_ms) * 1e-3) / 1e9:.1f}"
              f" GB/s; {base} best {fused:.1f} GB/s)")
        refs = {"base": base, **{a.split("_")[0]: a for a in ANCHORS if a in samples}}
        for name, ms in samples.items():
            med = statistics.median(ms)
            row: dict[str, object] = {"log2_n": lg, "provider": name, "ms": med,
                                      "ms_min": min(ms), "ms_max": max(ms), "rounds": len(ms)}
            nbytes = provs[name].bytes_per_elem
            gbs = n * nbytes / (med * 1e-3) / 1e9
            row.update(gparam_s=n / (med * 1e-3) / 1e9, bytes_per_elem=nbytes, gb_s=gbs,
                       gb_s_best=n * nbytes / (min(ms) * 1e-3) / 1e9, limit_gbs=limit,
                       limit_by=limit_by, pct_limit=100 * gbs / limit, triad_gbs=triad_gbs,
                       update_cos=cos[name])
            for tag, ref in refs.items():
                row.update(H.ratio_stats([b / m for b, m in zip(samples[ref], ms)],
                                         f"x_vs_{tag}"))
            row.update(baseline=base, what=provs[name].what, copy_bw_gbs=bw, **meta)
            rows.append(row)
        del provs
    for note in notes:  # skipped providers are part of the record
        rows.append({"provider": note.split(":")[0], "status": note, **meta})
    return rows


def markdown(rows: list[dict[str, object]], command: str, meta: dict[str, str],
             rounds: int) -> str:
    """The rows as the markdown table docs/benchmarks.md shows."""
    lines = [f"{meta['device']}, torch {meta['torch']}, {meta['date']}, {rounds} interleaved "
             f"rounds, {meta.get('clock', 'wall')} clock.  \n`{command}`", "",
             "| log2 n | provider | ms | B/elt | GB/s | % of limit "
             "| x vs torch fused: median (min-max) | x vs bnb | x vs torchao |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]

    def r3(row: dict[str, object], k: str) -> str:
        if k not in row:
            return ""
        return f"{row[k]:.2f} ({row[k + '_min']:.2f}-{row[k + '_max']:.2f})"

    limits: dict[object, str] = {}
    for row in rows:
        if "ms" not in row:
            continue
        limits[row["log2_n"]] = (f"2^{row['log2_n']}: {row['limit_gbs']:.1f} GB/s "
                                 f"({row['limit_by']})")
        lines.append(f"| {row['log2_n']} | {row['provider']} | {row['ms']:.2f} | "
                     f"{row['bytes_per_elem']:.2f} | {row['gb_s']:.1f} | "
                     f"{row['pct_limit']:.0f} | "
                     f"{r3(row, 'x_vs_base')} | {r3(row, 'x_vs_bnb')} | "
                     f"{r3(row, 'x_vs_torchao')} |")
    lines.append("")
    lines.append("The limit (best round of a STREAM triad in the same rounds, or of torch's fused "
                 "AdamW if higher): " + "; ".join(limits.values()) + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=int, nargs="+",
                    help="log2 sizes (default 20 25; CUDA 20 25 28; --quick 10 12)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 5; --quick 2)")
    ap.add_argument("--all", action="store_true",
                    help="also torch forloop/foreach and every working zerokern backend")
    ap.add_argument("--providers", nargs="+", metavar="PREFIX",
                    help="only the rows named PREFIX or PREFIX_... (and the baseline): "
                    "torch, zk, zk_int8, bnb, torchao, ...")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (smoke test)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time each sample by this process's CPU time (time.process_time), "
                    "which other processes on a time-shared machine do not inflate; with one "
                    "thread only (it sums the threads' times)")
    ap.add_argument("--out", help="folder for the CSV and markdown (default bench/results)")
    ap.add_argument("--tag", default="", help="appended to the file names (e.g. run1)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sizes = args.sizes or ([10, 12] if args.quick else
                           [20, 25, 28] if device.type == "cuda" else [20, 25])
    rounds = args.rounds or (2 if args.quick else 5)
    if args.clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        ap.error("--clock cpu needs --device cpu and one thread (OMP_NUM_THREADS=1)")
    meta, bw = H.op_bench_header(device, rounds, args.quick)
    meta["clock"] = args.clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = bench(device, sizes, rounds, bw, meta, args.all, args.providers, clock)
    cols = ["log2_n", "provider", "ms", "ms_min", "ms_max", "bytes_per_elem", "gb_s",
            "pct_limit", "x_vs_base", "x_vs_base_min", "x_vs_base_max", "x_vs_bnb", "x_vs_torchao",
            "update_cos"]
    H.print_table([r for r in rows if "ms" in r], cols)
    for r in rows:
        if "status" in r:
            print(f"# {r['status']}")
    command = "python bench/bench_adam.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    md = markdown(rows, command, meta, rounds)
    print("\n" + md)
    name = f"bench_adam_{device.type}_{meta['date']}"
    name += (f"_{args.tag}" if args.tag else "") + ("_quick" if args.quick else "")
    # The skipped providers' reasons go in the CSV too (rows with a status and no timing).
    path = H.write_csv(rows, f"{name}.csv", args.out)
    path.with_suffix(".md").write_text(md + "\n")
    print(f"# wrote {path} and {path.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
