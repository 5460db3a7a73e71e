"""bf16 moments take the folded update (``kernel_contract.fold_bias_correction``, issue 39):
the oracle equals AdamW's update with ``v``'s bias correction folded into the step size and
eps, spelled here with the contract's fp32 arithmetic, bit for bit, and not the unfolded one;
both are AdamW's update to a few ulps in float64. The kernels skip the division by
``bc2_sqrt`` there and so refuse the plain scalars before writing anything. (The CPU and
Triton kernels against the oracle: tests/test_ops_adamw_compressed.py and
tests/test_triton_adamw_compressed.py.)"""

from __future__ import annotations

import pytest
import torch
from references import folded_update_steps

from zerokern import _native
from zerokern.kernel_contract import (
    adam_scalars,
    fold_bias_correction,
    folds_bias_correction,
)
from zerokern.ops.adamw_compressed import adamw_compressed_torch_, fused_adamw_compressed_
from zerokern.quant.maps import BLOCK, kernel_tables

native = pytest.mark.skipif(
    not (_native.has_native() and hasattr(_native._C, "adamw_compressed")),
    reason="zerokern._C without the cpu adamw_compressed kernel",
)
N = 3 * BLOCK + 17  # a partial block: the kernels' tails too
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "param": torch.randn(N, generator=gen),
        "exp_avg": (torch.randn(N, generator=gen) * 1e-2).bfloat16(),
        "exp_avg_sq": (torch.rand(N, generator=gen) * 1e-4).bfloat16(),
        "param_lp": torch.zeros(N, dtype=torch.bfloat16),
    }


def test_which_formats_fold():
    assert folds_bias_correction("bf16", 2) and folds_bias_correction("bf16", 3)
    assert folds_bias_correction("int8", 3)
    assert not folds_bias_correction("int8", 2) and not folds_bias_correction("fp32", 3)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=native)])
def test_bf16_update_is_the_folded_formula(backend):
    st = _state(1)
    p0, m0, v0 = st["param"].clone(), st["exp_avg"].float(), st["exp_avg_sq"].float()
    g = torch.randn(N, generator=torch.Generator().manual_seed(2)) * 0.1
    step = 3
    outs = folded_update_steps(p0, g, m0, v0, lr=HP["lr"], b1=HP["beta1"], b2=HP["beta2"],
                               eps=HP["eps"], wd=HP["weight_decay"], step=step)
    fused_adamw_compressed_(st["param"], g, st["exp_avg"], st["exp_avg_sq"],
                            param_lp=st["param_lp"], step=step, backend=backend, **HP)
    p, m, v = outs["folded"]
    assert torch.equal(st["param"], p)
    assert torch.equal(st["param_lp"], p.bfloat16())
    # the moments do not depend on the fold: rounded to nearest even as before
    assert torch.equal(st["exp_avg"], m.bfloat16())
    assert torch.equal(st["exp_avg_sq"], v.bfloat16())


@native
def test_bf16_kernels_refuse_unfolded_scalars():
    """A caller of the kernels passing the plain scalars (bc2_sqrt != 1) with bf16 moments is
    refused before anything is written, by the oracle, the CPU kernel and the Triton one."""
    st = _state(3)
    st["sr"] = torch.zeros(0)
    before = {k: t.clone() for k, t in st.items()}
    s = adam_scalars(step=2, **HP)
    assert s.bc2_sqrt != 1.0
    args = (st["param"], torch.ones(N), st["exp_avg"], st["exp_avg_sq"], None, None,
            st["param_lp"], None, 0, 2)
    with pytest.raises(ValueError, match="folded scalars"):
        adamw_compressed_torch_(*args, s, 2)
    with pytest.raises(ValueError, match="folded scalars"):
        _native.require("cpu").adamw_compressed(*args, kernel_tables(st["param"].device), 2, *s)
    pytest.importorskip("triton")  # optional (the `triton` extra)
    from zerokern.kernels.triton.adamw_compressed import adamw_compressed_triton_

    with pytest.raises(ValueError, match="folded scalars"):
        adamw_compressed_triton_(*args, kernel_tables(st["param"].device), s, format_version=2)
    for k, t in before.items():
        assert torch.equal(st[k], t), f"{k} was modified"
    # the folded scalars pass the same check (the oracle steps)
    adamw_compressed_torch_(*args, fold_bias_correction(s), 2)
    assert not torch.equal(st["param"], before["param"])
