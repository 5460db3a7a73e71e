"""Triton kernels (fused AdamW, sq_norm, copy_segments) without a GPU.

* Logic: the kernels run under the Triton interpreter on CPU tensors. TRITON_INTERPRET must
  be set before triton is first imported, and other tests of this pytest process may have
  imported it already, so this file runs itself as a script in a subprocess
  (``TRITON_INTERPRET=1 python tests/test_triton_kernels.py interp``); the script prints
  one JSON line of per-group failures and case counts, which the tests below assert on.
* Codegen: each kernel is compiled for Hopper, GPUTarget("cuda", 90, 32), in a second
  subprocess without the interpreter (``python tests/test_triton_kernels.py compile``):
  no GPU is needed, only ptxas (shipped in triton/backends/nvidia/bin). The tests check
  that cubin/PTX were produced and inspect the AdamW PTX/SASS (128-bit vector accesses,
  IEEE sqrt/div, no FMA contraction, no spills).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
TIMEOUT_S = 600


# ----------------------------------------------------------------------------------------
# Script side: interpreter checks
# ----------------------------------------------------------------------------------------


def _reference64(p, g, m, v, *, lr, b1, b2, eps, wd, step, grad_scale):
    """The kernels.h formula in float64 on the same fp32 inputs."""
    p, m, v = p.double(), m.double(), v.double()
    g = g.double() / grad_scale
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2**step) ** 0.5 + eps
    p = p - lr / (1 - b1**step) * m / denom
    return p, m, v


def _emulate_fp32(p, g, m, v, k):
    """The kernel's op sequence in numpy fp32, one rounding per op (no FMA)."""
    import numpy as np

    f = np.float32
    p, m, v = p.numpy().copy(), m.numpy().copy(), v.numpy().copy()
    g = g.float().numpy()
    if k["APPLY_SCALE"]:
        g = g * f(k["inv_grad_scale"])
    p = p * f(k["decay"])
    d = g - m
    m = m + f(k["w"]) * d if k["LERP_LOW"] else g - d * f(k["one_minus_w"])
    v = v * f(k["beta2"]) + (f(k["one_minus_beta2"]) * g) * g
    denom = np.sqrt(v) / f(k["bc2_sqrt"]) + f(k["eps"])
    p = p - (f(k["step_size"]) * m) / denom
    return p, m, v


class _Group:
    """Collects failures of one group of cases."""

    def __init__(self):
        self.cases = 0
        self.failures: list[str] = []

    def check(self, name, fn, *args):
        self.cases += 1
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - every failure is reported by name
            self.failures.append(f"{name}: {type(e).__name__}: {e}"[:2000])

    def result(self):
        return {"cases": self.cases, "failures": self.failures}


def _bits(t):
    import torch

    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def vs_f64(got, refs, g, g0):
    import torch
    from _tol import ADAM_FP32

    for t, ref in zip(got, refs):
        torch.testing.assert_close(t.double(), ref, rtol=ADAM_FP32[0], atol=ADAM_FP32[1])
    assert torch.equal(g, g0), "grad modified"


def vs_emulation(got, refs):
    import numpy as np

    for what, t, ref in zip(("param", "exp_avg", "exp_avg_sq"), got, refs):
        bad = np.flatnonzero(t.numpy().view(np.int32) != ref.view(np.int32))
        assert bad.size == 0, f"{what}: {bad.size} elements differ, first at {bad[:5]}"


def lp_bitwise(param_lp, p):
    import torch

    assert torch.equal(_bits(param_lp), _bits(p.to(param_lp.dtype))), "param_lp != param.to(lp)"


def _interp_adamw(out):
    import torch

    from zerokern.kernels.triton import adamw as ka
    from zerokern.ops._scalars import adam_scalars

    assert ka._INTERPRETED, "TRITON_INTERPRET=1 was not in effect"
    f64, emu, lpg = _Group(), _Group(), _Group()
    gdtypes = [torch.float32, torch.bfloat16, torch.float16]
    lps = [None, torch.bfloat16, torch.float16]
    hps = [  # (beta1, weight_decay, step, grad_scale)
        (0.9, 0.0, 1, 1.0),
        (0.9, 0.1, 1000, 1024.0),
        (0.9, 0.1, 1, 1024.0),
        (0.9, 0.0, 1000, 1.0),
        (0.3, 0.1, 10, 1.0),  # w = 0.7: the other lerp branch
    ]
    configs = [(n, gd, lp, hp) for n in (1, 7, 4099) for gd in gdtypes for lp in lps for hp in hps]
    configs += [(65539, gd, torch.bfloat16, hps[1]) for gd in gdtypes]
    configs += [(65539, torch.float32, None, hps[4])]
    for n, gdtype, lp, (b1, wd, step, gs) in configs:
        name = f"n={n} grad={gdtype} lp={lp} b1={b1} wd={wd} step={step} scale={gs}"
        gen = torch.Generator().manual_seed(n + step)
        p = torch.randn(n, generator=gen)
        g = (torch.randn(n, generator=gen) * 3 * gs).to(gdtype)
        m = torch.randn(n, generator=gen) * 0.1
        v = torch.rand(n, generator=gen) * 0.01
        hp = dict(lr=1e-3, b1=b1, b2=0.999, eps=1e-8, wd=wd, step=step, grad_scale=gs)
        s = adam_scalars(
            lr=1e-3, beta1=b1, beta2=0.999, eps=1e-8, weight_decay=wd, step=step, grad_scale=gs
        )
        rp, rm, rv = _reference64(p, g, m, v, **hp)
        ep, em, ev = _emulate_fp32(p, g, m, v, ka.kernel_scalars(s))
        g0 = g.clone()
        param_lp = None if lp is None else torch.full((n,), 7.0, dtype=lp)
        ka.adamw_triton_(p, g, m, v, param_lp, s)
        f64.check(name, vs_f64, (p, m, v), (rp, rm, rv), g, g0)
        emu.check(name, vs_emulation, (p, m, v), (ep, em, ev))
        if lp is not None:
            lpg.check(name, lp_bitwise, param_lp, p)

    # n == 0: no launch, no error.
    e = torch.empty(0)
    f64.check(
        "n=0",
        lambda: ka.adamw_triton_(
            e,
            e.clone(),
            e.clone(),
            e.clone(),
            None,
            adam_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1),
        ),
    )

    # Rounding of param_lp on crafted bit patterns: lr = 0 gives decay = 1 and step_size = 0,
    # so the step leaves every param bit pattern as it is and param_lp = round(param).
    specials = [
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # bf16 ties to even / just off
        0x3FFFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x477FF000,  # carry into exponent, overflow
        0x477FEFFF, 0x38000000, 0x33800000, 0x33000001,  # fp16 max / subnormal edges
        0x3F801000, 0x3F803000, 0x3FFFF000, 0x33000000,  # fp16 ties to even, carry
        0x33C00000, 0x387FE000, 0x477FF001,  # fp16 subnormal ties, overflow
        0x00000001, 0x00008000, 0x00018000, 0x007FFFFF,  # fp32 subnormals
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
        0x7FC00000, 0x7F800001, 0xFFC00000,  # NaNs
    ]  # fmt: skip
    special = torch.tensor(specials, dtype=torch.int64)
    special = torch.cat([special, special | (1 << 31)]).to(torch.int32)
    rnd = torch.randint(-(2**31), 2**31, (4099,), generator=torch.Generator().manual_seed(1))
    bits = torch.cat([special, rnd.to(torch.int32)])
    for lp in (torch.bfloat16, torch.float16):
        n = bits.numel()
        p = bits.clone().view(torch.float32)
        m, v, g = torch.ones(n), torch.ones(n), torch.zeros(n)
        param_lp = torch.zeros(n, dtype=lp)
        s = adam_scalars(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1)
        ka.adamw_triton_(p, g, m, v, param_lp, s)

        def crafted(p=p, param_lp=param_lp, lp=lp):
            ref = bits.view(torch.float32)
            nan = torch.isnan(ref)
            assert torch.equal(_bits(p)[~nan], bits[~nan]), "param changed with lr=0"
            want = ref.to(lp)
            assert torch.equal(torch.isnan(param_lp), nan), "NaN positions differ"
            got_b, want_b = _bits(param_lp)[~nan], _bits(want)[~nan]
            bad = torch.nonzero(got_b != want_b).flatten()[:5].tolist()
            assert not bad, f"lp bits differ at {bad}: {got_b[bad]} vs {want_b[bad]}"

        lpg.check(f"crafted bit patterns -> {lp}", crafted)

    out["adamw_f64"], out["adamw_emulation"], out["adamw_lp"] = (
        f64.result(),
        emu.result(),
        lpg.result(),
    )


def _interp_sq_norm(out):
    import torch
    from _tol import SQ_NORM

    from zerokern.kernels.triton import sq_norm as ks

    grp, special = _Group(), _Group()
    dtypes = [torch.float32, torch.bfloat16, torch.float16]

    def run(x, name):
        def chk():
            r = ks.sq_norm_triton(x)
            assert r.shape == () and r.dtype == torch.float32, (r.shape, r.dtype)
            ref = x.double().square().sum()
            torch.testing.assert_close(r.double(), ref, rtol=SQ_NORM[0], atol=SQ_NORM[1])
            r2 = ks.sq_norm_triton(x)
            assert torch.equal(_bits(r.reshape(1)), _bits(r2.reshape(1))), "not deterministic"

        grp.check(name, chk)

    for dt in dtypes:
        for n in (0, 1, 7, 4099, 65539):
            x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4).to(dt)
            run(x, f"n={n} {dt}")
        run(torch.randn(3, 5, 7).to(dt), f"3-D {dt}")
    # Small blocks and few partials: several loop iterations per program and the tail
    # block owned by different programs (n % BLOCK == 0 included).
    saved = ks.BLOCK, ks.MAX_PARTIALS
    try:
        ks.BLOCK, ks.MAX_PARTIALS = 64, 8
        for dt in dtypes:
            for n in (1, 63, 64, 65, 512, 1536, 4099):
                x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dt)
                run(x, f"BLOCK=64 MAX_PARTIALS=8 n={n} {dt}")
    finally:
        ks.BLOCK, ks.MAX_PARTIALS = saved

    inf, nan = float("inf"), float("nan")
    for dt in dtypes:
        for n in (7, 4099, 65539):
            for where, vals, want in (
                ("inf in a full block", {0: inf}, inf),
                ("-inf in the tail", {n - 1: -inf}, inf),
                ("nan", {n // 2: nan}, nan),
                ("inf and nan", {0: inf, n - 1: nan}, nan),
            ):
                x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dt)
                for i, val in vals.items():
                    x[i] = val

                def chk(x=x, want=want):
                    r = ks.sq_norm_triton(x).item()
                    ok = (r != r) if want != want else r == want
                    assert ok, f"got {r}, want {want}"

                special.check(f"{where} n={n} {dt}", chk)
    out["sq_norm"], out["sq_norm_inf_nan"] = grp.result(), special.result()


def _interp_flatten(out):
    import torch

    from zerokern.kernels.triton import flatten as kf

    grp = _Group()
    widths: set[int] = set()
    sentinel = -7

    def round_trip(name, srcs, pad_elems):
        """Pack srcs back to back into two buckets (the largest tensor split across them),
        optionally padding each offset to pad_elems; scatter back into fresh tensors."""
        dt = srcs[0].dtype
        big = max(range(len(srcs)), key=lambda i: srcs[i].numel())
        split = srcs[big].numel() // 3 + 1
        pieces = []  # (src view, bucket index)
        for i, t in enumerate(srcs):
            if i == big:
                pieces += [(t[:split], 0), (t[split:], 1)]
            else:
                pieces.append((t, 0 if i < big else 1))

        def pad(o):
            return -(-o // pad_elems) * pad_elems

        offsets, sizes = [], [1, 1]  # start each bucket 1 element in: unaligned for odd pads
        for t, b in pieces:
            o = pad(sizes[b])
            offsets.append(o)
            sizes[b] = o + t.numel()
        buckets = [torch.full((sz + 3,), sentinel, dtype=dt) for sz in sizes]
        segs = [(t, buckets[b][o : o + t.numel()]) for (t, b), o in zip(pieces, offsets)]
        outs = [torch.empty_like(t) for t in srcs]
        back = []
        for i, t in enumerate(outs):
            if i == big:
                back += [t[:split], t[split:]]
            else:
                back.append(t)
        back_segs = [(d, o) for (_, d), o in zip(segs, back)]

        def chk():
            table = kf.build_table(segs) + kf.build_table(back_segs)
            widths.update(table[3 :: kf.ROW])
            kf.copy_segments_triton(segs)
            covered = [torch.zeros(b.numel(), dtype=torch.bool) for b in buckets]
            for (t, b), o in zip(pieces, offsets):
                assert torch.equal(buckets[b][o : o + t.numel()], t), "bucket content"
                covered[b][o : o + t.numel()] = True
            for b, c in zip(buckets, covered):
                assert bool((b[~c] == sentinel).all()), "copy wrote outside its segment"
            kf.copy_segments_triton(back_segs)
            for t, o in zip(srcs, outs):
                assert torch.equal(t, o), "round trip"

        grp.check(name, chk)

    for dt in (torch.float32, torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(0)
        srcs = [torch.randn(n, generator=gen).to(dt) for n in (1, 7, 4099, 65539, 3)]
        for pad in (1, 16 // srcs[0].element_size()):
            round_trip(f"{dt} pad={pad}", srcs, pad)
        # sub-ranges of one tensor at odd offsets on both sides
        base = torch.randn(5000, generator=gen).to(dt)
        round_trip(f"{dt} views of one tensor", [base[1:4000], base[4001:4002], base[4003:]], 1)

    # Raw bytes, any alignment: equal misalignment mod 16 (head + 16-byte body + tail),
    # different misalignment (byte path), empty segments and an empty list.
    u = torch.randint(0, 256, (70000,), dtype=torch.uint8, generator=torch.Generator())
    dst = torch.zeros(140000, dtype=torch.uint8)
    segs = [
        (u[3:66000], dst[19:66016]),  # 3 == 19 mod 16
        (u[5:1000], dst[70002:70997]),  # 5 vs 2 mod 16
        (u[7:7], dst[80000:80000]),
        (u[0:1], dst[90001:90002]),
        (u[100:117], dst[100000:100017]),  # aligned start, 17 bytes
    ]

    def raw():
        widths.update(kf.build_table(segs)[3 :: kf.ROW])
        kf.copy_segments_triton(segs)
        kf.copy_segments_triton([])
        for s, d in segs:
            assert torch.equal(s, d)
        mask = torch.ones(dst.numel(), dtype=torch.bool)
        for _, d in segs:
            off = d.data_ptr() - dst.data_ptr()
            mask[off : off + d.numel()] = False
        assert bool((dst[mask] == 0).all()), "copy wrote outside its segment"

    grp.check("raw bytes", raw)
    out["flatten"] = grp.result()
    out["flatten_widths"] = sorted(int(w) for w in widths)


def _script_interp():
    import time

    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    out, times = {}, {}
    for name, fn in (
        ("adamw", _interp_adamw),
        ("sq_norm", _interp_sq_norm),
        ("flatten", _interp_flatten),
    ):
        t0 = time.perf_counter()
        fn(out)
        times[name] = round(time.perf_counter() - t0, 2)
    out["seconds"] = times
    print(json.dumps(out))


# ----------------------------------------------------------------------------------------
# Script side: compile for sm_90
# ----------------------------------------------------------------------------------------

PTX_PATTERNS = (
    "ld.global.v4",
    "ld.global.v2",
    "st.global.v4",
    "st.global.v2",
    "sqrt.rn.f32",
    "sqrt.approx",
    "div.rn.f32",
    "div.full",
    "div.approx",
    "fma.rn.f32",
    "cvt.rn.bf16.f32",
    "cvt.rn.f16.f32",
    ".ftz",
)


def _compile_one(fn, signature, constexprs, options, aligned_ptrs=(), sass=False):
    import re

    import triton
    from triton.backends.compiler import GPUTarget

    attrs = {(list(signature).index(a),): [["tt.divisibility", 16]] for a in aligned_ptrs}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = k.asm.get("ptx", "")
    cubin = k.asm.get("cubin", b"")
    info = {
        "asm": sorted(k.asm),
        "ptx_chars": len(ptx),
        "cubin_bytes": len(cubin),
        "sm_90": ".target sm_90" in ptx,
        "ptx": {p: len(re.findall(re.escape(p), ptx)) for p in PTX_PATTERNS},
        "shared": int(getattr(k.metadata, "shared", -1)),
        "resources": _resource_usage(cubin),
    }
    if sass:
        try:
            from triton.tools.disasm import get_sass

            text = get_sass(cubin)
            ops = re.findall(r"\b((?:LDG|STG|LDS|STS|LDL|STL)(?:\.[A-Z0-9]+)*)", text)
            info["sass"] = {o: ops.count(o) for o in sorted(set(ops))}
        except Exception as e:  # noqa: BLE001 - SASS is informative only
            info["sass_error"] = repr(e)[:300]
    return info


def _resource_usage(cubin):
    """REG / LOCAL (spill) / SHARED of the cubin, from cuobjdump -res-usage if available."""
    import re
    import tempfile

    try:
        from triton import knobs

        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001
        tool = None
    if not tool or not os.path.exists(tool) or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", r.stdout)
    if m is None:
        return None
    return dict(zip(("reg", "stack", "shared", "local"), map(int, m.groups())))


def _script_compile():
    import time

    import triton

    out = {"triton": triton.__version__}
    try:
        backends = triton.backends.backends
        if "nvidia" not in backends:
            print(json.dumps({"skip": "triton has no nvidia backend"}))
            return
        try:
            from triton.backends.nvidia.compiler import get_ptxas

            ptxas = get_ptxas(90).path
        except (ImportError, AttributeError, TypeError):
            ptxas = None  # another triton version: let the compile itself tell
        except Exception as e:  # noqa: BLE001 - knobs raise when ptxas cannot be found
            print(json.dumps({"skip": f"ptxas for sm_90 unavailable: {e!r}"[:500]}))
            return
        if ptxas is not None and not os.path.exists(ptxas):
            print(json.dumps({"skip": f"ptxas not found at {ptxas}"}))
            return
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"skip": f"CUDA backend unusable: {e!r}"[:500]}))
        return

    from zerokern.kernels.triton import adamw as ka
    from zerokern.kernels.triton import flatten as kf
    from zerokern.kernels.triton import sq_norm as ks

    assert not ka._INTERPRETED
    t0 = time.perf_counter()
    scalars = "decay w one_minus_w beta2 one_minus_beta2 step_size bc2_sqrt eps inv_grad_scale"
    kernels = {}
    adam_ptrs = ("param_ptr", "grad_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "lp_ptr")

    def adam(gd, lp, i64=False, lerp_low=True, scale=True, aligned=True):
        sig = {
            "param_ptr": "*fp32",
            "grad_ptr": f"*{gd}",
            "exp_avg_ptr": "*fp32",
            "exp_avg_sq_ptr": "*fp32",
            "lp_ptr": f"*{lp or 'fp32'}",
            "n": "i64" if i64 else "i32",
            **{s: "fp32" for s in scalars.split()},
            **{c: "constexpr" for c in ("BLOCK", "HAS_LP", "LERP_LOW", "APPLY_SCALE")},
            **{c: "constexpr" for c in ("USE_INT64", "SOFT_BF16")},
        }
        cx = dict(
            BLOCK=ka.BLOCK,
            HAS_LP=lp is not None,
            LERP_LOW=lerp_low,
            APPLY_SCALE=scale,
            USE_INT64=i64,
            SOFT_BF16=False,
        )
        ptrs = adam_ptrs if aligned else ()
        return _compile_one(ka.adamw_kernel, sig, cx, dict(ka.COMPILE_OPTIONS), ptrs, sass=True)

    for gd in ("fp32", "bf16", "fp16"):
        for lp in (None, "bf16", "fp16"):
            kernels[f"adamw grad={gd} lp={lp}"] = adam(gd, lp)
    kernels["adamw grad=bf16 lp=bf16 int64 w>=0.5 unscaled"] = adam(
        "bf16", "bf16", i64=True, lerp_low=False, scale=False
    )
    kernels["adamw grad=fp32 lp=None unaligned"] = adam("fp32", None, aligned=False)
    for dt in ("fp32", "bf16", "fp16"):
        for i64 in (False, True):
            kernels[f"sq_norm_partials {dt} int64={i64}"] = _compile_one(
                ks.sq_norm_partials_kernel,
                {
                    "x_ptr": f"*{dt}",
                    "partials_ptr": "*fp32",
                    "n": "i64" if i64 else "i32",
                    "BLOCK": "constexpr",
                    "USE_INT64": "constexpr",
                },
                dict(BLOCK=ks.BLOCK, USE_INT64=i64),
                dict(num_warps=ks.NUM_WARPS),
                ("x_ptr", "partials_ptr"),
            )
    kernels["sq_norm_final"] = _compile_one(
        ks.sq_norm_final_kernel,
        {"partials_ptr": "*fp32", "out_ptr": "*fp32", "num_partials": "i32", "BLOCK": "constexpr"},
        dict(BLOCK=ks.MAX_PARTIALS),
        dict(num_warps=4),
        ("partials_ptr", "out_ptr"),
    )
    kernels["copy_chunks"] = _compile_one(
        kf.copy_chunks_kernel,
        {"table_ptr": "*i64", "TILE": "constexpr", "SUB": "constexpr"},
        dict(TILE=kf.TILE, SUB=32 * kf.NUM_WARPS),
        dict(num_warps=kf.NUM_WARPS),
        ("table_ptr",),
        sass=True,
    )
    out["kernels"] = kernels
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


def _run_script(mode: str, interpret: bool) -> dict:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, str(HERE), mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        pytest.fail(f"`{mode}` subprocess failed (rc={r.returncode}):\n{r.stderr[-6000:]}")
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    return _run_script("interp", interpret=True)


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton")
    res = _run_script("compile", interpret=False)
    if "skip" in res:
        pytest.skip(res["skip"])
    return res


def _assert_group(res, key, min_cases):
    g = res[key]
    assert not g["failures"], f"{len(g['failures'])} of {g['cases']} failed:\n" + "\n".join(
        g["failures"][:20]
    )
    assert g["cases"] >= min_cases, g


def test_adamw_vs_float64(interp):
    _assert_group(interp, "adamw_f64", 100)


def test_adamw_bitwise_vs_fp32_op_sequence(interp):
    _assert_group(interp, "adamw_emulation", 100)


def test_adamw_param_lp_bitwise(interp):
    _assert_group(interp, "adamw_lp", 60)


def test_sq_norm(interp):
    _assert_group(interp, "sq_norm", 30)


def test_sq_norm_inf_nan(interp):
    _assert_group(interp, "sq_norm_inf_nan", 30)


def test_copy_segments(interp):
    _assert_group(interp, "flatten", 10)
    # Every access width of the copy kernel was exercised.
    assert interp["flatten_widths"] == [1, 2, 4, 16], interp["flatten_widths"]
    print("interpreter seconds:", interp["seconds"])


def test_compile_sm90_all_kernels(compiled):
    for name, k in compiled["kernels"].items():
        assert k["cubin_bytes"] > 0 and k["ptx_chars"] > 0, (name, k["asm"])
        assert k["sm_90"], name
        res = k["resources"]
        if res is not None:
            assert res["local"] == 0, f"{name} spills: {res}"


def test_compile_sm90_adamw_codegen(compiled):
    lines = [f"triton {compiled['triton']}, compile {compiled['seconds']} s"]
    for name, k in compiled["kernels"].items():
        ptx = {p: c for p, c in k["ptx"].items() if c}
        sass, res = k.get("sass"), k["resources"]
        lines.append(f"{name}: ptx {ptx} sass {sass} res {res} smem {k['shared']}")
        if not name.startswith("adamw"):
            continue
        # IEEE sqrt and division, and no mul+add contracted into FMA (bitwise parity with
        # the other backends' separately rounded fp32 ops).
        assert ptx.get("sqrt.rn.f32") and ptx.get("div.rn.f32"), (name, ptx)
        for bad in ("sqrt.approx", "div.full", "div.approx", "fma.rn.f32", ".ftz"):
            assert bad not in ptx, (name, bad, ptx)
        if "lp=bf16" in name:
            assert ptx.get("cvt.rn.bf16.f32"), (name, ptx)
        if "unaligned" not in name:
            # The unmasked full-block path moves the fp32 state with 128-bit accesses.
            assert ptx.get("ld.global.v4", 0) >= 3 and ptx.get("st.global.v4", 0) >= 3, (name, ptx)
    copy = compiled["kernels"]["copy_chunks"]["ptx"]
    assert copy["ld.global.v4"] > 0 and copy["st.global.v4"] > 0, copy
    print("\n".join(lines))


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "interp"
    if mode == "interp":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("run with TRITON_INTERPRET=1")
        _script_interp()
    elif mode == "compile":
        _script_compile()
    else:
        sys.exit(f"unknown mode {mode!r}")
