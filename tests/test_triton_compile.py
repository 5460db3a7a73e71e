"""Codegen of every Triton kernel for Hopper, GPUTarget("cuda", 90, 32), without a GPU: only
ptxas is needed (shipped in triton/backends/nvidia/bin). The tests check that cubin/PTX were
produced and that nothing spills, and inspect the AdamW PTX/SASS (128-bit vector accesses,
IEEE sqrt/div, exactly the three fma.rn.f32 per element of the rounding contract in
csrc/kernels.h and no other contraction), and the same properties of the compressed-state
AdamW kernel (adamw_compressed.py) with its extra divisions and multiplies of the 8-bit codes
and no layout conversion through shared memory.

The kernels compile in a subprocess without the interpreter (see triton_common.py); the tests
below assert on what it reports. What the kernels compute is checked under the interpreter in
test_triton_adamw.py, test_triton_adamw_compressed.py, test_triton_sq_norm.py and
test_triton_flatten.py.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import triton_common
from triton_common import start_scripts as start_scripts  # conftest starts the subprocess

# ----------------------------------------------------------------------------------------
# Script side: run by triton_common, without the interpreter
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
    "mul.rn.f32",
    "add.rn.f32",
    "sub.rn.f32",
    "mul.f32",  # no rounding modifier: ptxas may contract these into an FMA
    "add.f32",
    "sub.f32",
    "cvt.rn.bf16.f32",
    "cvt.rn.f16.f32",
    ".ftz",
    ".f64",
    "neg.f32",
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
        # the kernel arguments the PTX reads (by position): an unused pointer is never loaded
        "params_read": sorted({int(i) for i in re.findall(r"_param_(\d+)\]", ptx)}),
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


def _script_compile(out):
    import triton

    out["triton"] = triton.__version__
    try:
        backends = triton.backends.backends
        if "nvidia" not in backends:
            out["skip"] = "triton has no nvidia backend"
            return
        try:
            from triton.backends.nvidia.compiler import get_ptxas

            ptxas = get_ptxas(90).path
        except (ImportError, AttributeError, TypeError):
            ptxas = None  # another triton version: let the compile itself tell
        except Exception as e:  # noqa: BLE001 - knobs raise when ptxas cannot be found
            out["skip"] = f"ptxas for sm_90 unavailable: {e!r}"[:500]
            return
        if ptxas is not None and not os.path.exists(ptxas):
            out["skip"] = f"ptxas not found at {ptxas}"
            return
    except Exception as e:  # noqa: BLE001
        out["skip"] = f"CUDA backend unusable: {e!r}"[:500]
        return

    from zerokern.kernels.triton import adamw as ka
    from zerokern.kernels.triton import flatten as kf
    from zerokern.kernels.triton import sq_norm as ks

    assert not ka._INTERPRETED
    scalars = "decay w beta2 one_minus_beta2 bc2_sqrt eps inv_grad_scale"
    bit_scalars = "neg_one_minus_w_bits neg_step_size_bits"
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
            **{s: "i32" for s in bit_scalars.split()},
            **{c: "constexpr" for c in ("BLOCK", "HAS_LP", "LERP_LOW", "APPLY_SCALE")},
            **{c: "constexpr" for c in ("USE_INT64", "SOFT_FP")},
        }
        cx = dict(
            BLOCK=ka.BLOCK,
            HAS_LP=lp is not None,
            LERP_LOW=lerp_low,
            APPLY_SCALE=scale,
            USE_INT64=i64,
            SOFT_FP=False,
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
    out["adamw_block"], out["adamw_num_warps"] = ka.BLOCK, ka.NUM_WARPS




def _script_compile_compressed(out):
    """The compressed-state AdamW kernel (adamw_compressed.py) for sm_90: one variant per
    moment format x parameter mode, plus the other grad dtypes, the other lerp branch,
    unscaled and int64 offsets."""
    if "skip" in out:
        return
    from zerokern.kernels.triton import adamw_compressed as kc

    assert not kc._INTERPRETED
    scalars = "decay w beta2 one_minus_beta2 bc2_sqrt eps inv_grad_scale"
    bit_scalars = "seed_lo_bits seed_hi_bits step_bits neg_one_minus_w_bits neg_step_size_bits"
    constexprs = ("ROWS", "MOMENTS", "HAS_LP", "SR", "LERP_LOW", "APPLY_SCALE", "USE_INT64",
                  "SOFT_FP", "V3")
    moment_types = {kc.MOMENTS_FP32: "fp32", kc.MOMENTS_BF16: "bf16", kc.MOMENTS_INT8: "u8"}

    def compressed(moments, param, gd="bf16", lerp_low=True, scale=True, i64=False, v3=False):
        quantized = moments == kc.MOMENTS_INT8
        sr = param == "bf16-sr"
        lp = {"fp32+bf16": "bf16", "fp32+fp16": "fp16"}.get(param)
        sig = {
            "param_ptr": "*bf16" if sr else "*fp32",
            "grad_ptr": f"*{gd}",
            "exp_avg_ptr": f"*{moment_types[moments]}",
            "exp_avg_sq_ptr": f"*{moment_types[moments]}",
            "m_absmax_ptr": "*fp32",
            "v_absmax_ptr": "*fp32",
            "lp_ptr": f"*{lp or 'fp32'}",
            "sr_index_ptr": "*i64" if sr else "*fp32",
            "tables_ptr": "*fp32",
            "n": "i64" if i64 else "i32",
            **{s: "i32" for s in bit_scalars.split()},
            **{s: "fp32" for s in scalars.split()},
            **{c: "constexpr" for c in constexprs},
        }
        # the kernel's own argument order
        order = list(kc.adamw_compressed_kernel.arg_names)
        sig = {a: sig[a] for a in order}
        cx = dict(ROWS=kc.ROWS, MOMENTS=moments, HAS_LP=lp is not None, SR=sr,
                  LERP_LOW=lerp_low, APPLY_SCALE=scale, USE_INT64=i64, SOFT_FP=False, V3=v3)
        ptrs = ["param_ptr", "grad_ptr", "exp_avg_ptr", "exp_avg_sq_ptr"]
        ptrs += [] if v3 else ["tables_ptr"]
        ptrs += ["m_absmax_ptr", "v_absmax_ptr"] if quantized else []
        ptrs += ["lp_ptr"] if lp else []
        ptrs += ["sr_index_ptr"] if sr else []
        return _compile_one(kc.adamw_compressed_kernel, sig, cx, dict(kc.COMPILE_OPTIONS), ptrs,
                            sass=True)

    kernels = {}
    for moments, mname in moment_types.items():
        for param in ("fp32", "fp32+bf16", "bf16-sr"):
            kernels[f"compressed moments={mname} param={param} grad=bf16"] = compressed(
                moments, param)
    kernels["compressed moments=fp32 param=fp32 grad=fp32"] = compressed(
        kc.MOMENTS_FP32, "fp32", gd="fp32")
    kernels["compressed moments=u8 param=fp32+fp16 grad=fp16 int64 w>=0.5 unscaled"] = (
        compressed(kc.MOMENTS_INT8, "fp32+fp16", gd="fp16", lerp_low=False, scale=False,
                   i64=True))
    # int8 format version 3 (computed maps): the master-free param (the most registers) and
    # the fp32 master with an fp32 grad (128-bit accesses of both)
    kernels["compressed moments=u8 v3 param=bf16-sr grad=bf16"] = compressed(
        kc.MOMENTS_INT8, "bf16-sr", v3=True)
    kernels["compressed moments=u8 v3 param=fp32 grad=fp32"] = compressed(
        kc.MOMENTS_INT8, "fp32", gd="fp32", v3=True)
    out["compressed_kernels"] = kernels
    out["compressed_tables_arg"] = list(kc.adamw_compressed_kernel.arg_names).index("tables_ptr")
    out["compressed_tile"] = kc.ROWS * kc.QBLOCK
    out["compressed_num_warps"] = kc.NUM_WARPS


CHECKS = {"compile": (("compile", _script_compile),
                     ("compile_compressed", _script_compile_compressed))}


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled():
    return triton_common.results("compile", __file__)


def test_compile_sm90_all_kernels(compiled):
    for name, k in compiled["kernels"].items():
        assert k["cubin_bytes"] > 0 and k["ptx_chars"] > 0, (name, k["asm"])
        assert k["sm_90"], name
        res = k["resources"]
        if res is not None:
            assert res["local"] == 0, f"{name} spills: {res}"


def test_compile_sm90_adamw_codegen(compiled):
    ka_block, ka_warps = compiled["adamw_block"], compiled["adamw_num_warps"]
    lines = [f"triton {compiled['triton']}, compile {compiled['seconds']['compile']} s"]
    for name, k in compiled["kernels"].items():
        ptx = {p: c for p, c in k["ptx"].items() if c}
        sass, res = k.get("sass"), k["resources"]
        lines.append(f"{name}: ptx {ptx} sass {sass} res {res} smem {k['shared']}")
        if not name.startswith("adamw"):
            continue
        # The rounding contract of csrc/kernels.h, per element, as properties that hold
        # whatever the Triton version's lowering: exactly three fma.rn.f32 (lerp, v update,
        # p update) and no other contraction; at least the muls g*inv_scale (when scaled),
        # p*decay, (1-b2)*g and v*b2, the sub g-m and the add +eps, each rounded on its own
        # (.rn: ptxas must not contract them); IEEE sqrt and both divisions; no fp64 and no
        # flush-to-zero. Each thread owns BLOCK / (32 * NUM_WARPS) elements, in the unmasked
        # and in the masked path. (Exact counts of the other ops differ between Triton 3.6
        # and 3.8, e.g. how a select or a constant is materialised.)
        per = 2 * ka_block // (32 * ka_warps)
        scaled = "unscaled" not in name
        assert ptx.get("fma.rn.f32", 0) == 3 * per, (name, ptx)
        at_least = {
            "mul.rn.f32": (4 if scaled else 3) * per,
            "sub.rn.f32": per,
            "add.rn.f32": per,
            "sqrt.rn.f32": per,
            "div.rn.f32": 2 * per,
        }
        short = {op: ptx.get(op, 0) for op, n in at_least.items() if ptx.get(op, 0) < n}
        assert not short, (name, short, at_least)
        for bad in ("sqrt.approx", "div.full", "div.approx", ".ftz", "mul.f32", "add.f32",
                    "sub.f32", ".f64"):
            assert not ptx.get(bad), (name, bad, ptx)
        if "lp=bf16" in name:
            assert ptx.get("cvt.rn.bf16.f32"), (name, ptx)
        if "unaligned" not in name:
            # The unmasked full-block path moves the fp32 state with 128-bit accesses.
            assert ptx.get("ld.global.v4", 0) >= 3 and ptx.get("st.global.v4", 0) >= 3, (name, ptx)
    copy = compiled["kernels"]["copy_chunks"]["ptx"]
    assert copy["ld.global.v4"] > 0 and copy["st.global.v4"] > 0, copy
    print("\n".join(lines))


def test_compile_sm90_adamw_compressed_codegen(compiled):
    """The compressed-state kernel for Hopper: cubin for sm_90, no spills, the rounding
    contract's operations (exactly three fma.rn.f32 per element, IEEE sqrt and divisions,
    every other mul/add/sub rounded on its own, no fp64, no flush-to-zero), 128-bit accesses
    of the fp32 state in the full-tile path, and no layout conversion through shared memory
    (only the int8 absmax reductions exchange a few bytes); int8 format version 3 never
    reads the map table."""
    kernels = compiled["compressed_kernels"]
    per = 2 * compiled["compressed_tile"] // (32 * compiled["compressed_num_warps"])
    lines = []
    for name, k in kernels.items():
        ptx = {p: c for p, c in k["ptx"].items() if c}
        lines.append(f"{name}: ptx {ptx} sass {k.get('sass')} res {k['resources']} "
                     f"smem {k['shared']}")
        assert k["cubin_bytes"] > 0 and k["sm_90"], (name, k["asm"])
        if k["resources"] is not None:
            assert k["resources"]["local"] == 0, f"{name} spills: {k['resources']}"
        quantized = "moments=u8" in name
        v3 = " v3" in name
        folded = v3 or "moments=bf16" in name  # fold_bias_correction's scalars
        scaled = "unscaled" not in name
        assert ptx.get("fma.rn.f32", 0) == 3 * per, (name, ptx)
        # quantizing divides each new moment by its block absmax; dequantizing multiplies;
        # bf16 moments' and version 3's update skip the division by bc2_sqrt (folded scalars)
        at_least = {
            "mul.rn.f32": ((4 if scaled else 3) + (2 if quantized else 0)) * per,
            "sub.rn.f32": per,
            "add.rn.f32": per,
            "sqrt.rn.f32": per,
            "div.rn.f32": ((4 if quantized else 2) - (1 if folded else 0)) * per,
        }
        short = {op: ptx.get(op, 0) for op, n in at_least.items() if ptx.get(op, 0) < n}
        assert not short, (name, short, at_least)
        # the unfolded twin: version 2 for version 3, fp32 moments for bf16 moments
        v2_twin = kernels.get(name.replace(" v3", "").replace("moments=bf16", "moments=fp32"))
        if folded and v2_twin is not None:
            twin = v2_twin["ptx"].get("div.rn.f32", 0)
            assert ptx.get("div.rn.f32", 0) <= twin - per, (name, ptx, twin)
        for bad in ("sqrt.approx", "div.full", "div.approx", ".ftz", "mul.f32", "add.f32",
                    "sub.f32", ".f64"):
            assert not ptx.get(bad), (name, bad, ptx)
        if "moments=bf16" in name or "fp32+bf16" in name:
            assert ptx.get("cvt.rn.bf16.f32"), (name, ptx)
        if "fp32+fp16" in name:
            assert ptx.get("cvt.rn.f16.f32"), (name, ptx)
        # fp32 tensors moved with 128-bit accesses in the full-tile path: the fp32 master,
        # fp32 moments, an fp32 grad.
        loads = ("param=fp32" in name) + 2 * ("moments=fp32" in name) + ("grad=fp32" in name)
        stores = ("param=fp32" in name) + 2 * ("moments=fp32" in name)
        assert ptx.get("ld.global.v4", 0) >= loads, (name, ptx)
        assert ptx.get("st.global.v4", 0) >= stores, (name, ptx)
        assert k["shared"] <= (64 if quantized else 0), (name, k["shared"])
        # format version 3 computes its maps: the table of version 2 is never read
        reads_tables = compiled["compressed_tables_arg"] in k["params_read"]
        assert reads_tables == (quantized and " v3 " not in name), (name, k["params_read"])
    print("\n".join(lines))
