"""Independent references shared by the kernel tests: the AdamW step in float64, and the
folded update's scalars spelled by hand."""

from __future__ import annotations

import math


def reference64(p, g, m, v, *, lr, b1, b2, eps, wd, step, grad_scale):
    """One AdamW step (csrc/kernels.h's formula) in float64 on the same fp32 inputs."""
    p, m, v = p.double(), m.double(), v.double()
    g = g.double() / grad_scale
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2**step) ** 0.5 + eps
    p = p - lr / (1 - b1**step) * m / denom
    return p, m, v


def folded_update_steps(p0, g, m, v, *, lr, b1, b2, eps, wd, step):
    """The contract's fp32 update (``zerokern.quant.contract.adamw_contract_``) from
    ``(p0, m, v)`` with the scalars spelled here, plain and with ``v``'s bias correction
    folded into the step size and eps in double (``p - (step_size * sqrt(bc2)) * m /
    (sqrt(v) + eps * sqrt(bc2))``); checks both are AdamW's step to a few ulps in float64
    and differ somewhere (else a test comparing against one could not tell them apart).

    Returns:
        ``{"plain": (p, m, v), "folded": (p, m, v)}``, fp32.
    """
    from zerokern.kernel_contract import AdamScalars
    from zerokern.quant.contract import adamw_contract_

    bc1, bc2 = 1 - b1**step, 1 - b2**step
    plain = AdamScalars(decay=1 - lr * wd, one_minus_beta1=1 - b1, beta2=b2,
                        one_minus_beta2=1 - b2, step_size=lr / bc1, bc2_sqrt=math.sqrt(bc2),
                        eps=eps, inv_grad_scale=1.0)
    folded = plain._replace(step_size=lr / bc1 * math.sqrt(bc2), eps=eps * math.sqrt(bc2),
                            bc2_sqrt=1.0)
    outs = {}
    for name, s in (("plain", plain), ("folded", folded)):
        p, mm, vv = p0.clone(), m.clone(), v.clone()
        adamw_contract_(p, g, mm, vv, None, s)
        outs[name] = (p, mm, vv)
    p64, _, _ = reference64(p0, g, m, v, lr=lr, b1=b1, b2=b2, eps=eps, wd=wd, step=step,
                            grad_scale=1.0)
    u64 = p0.double() * (1 - lr * wd) - p64  # the update's size, for the tolerance
    for name, (p, _, _) in outs.items():
        err = (p.double() - p64).abs()
        assert (err <= 2.0**-21 * (p64.abs() + u64.abs())).all(), name
    assert not outs["plain"][0].equal(outs["folded"][0]), "the check cannot tell them apart"
    return outs


__all__ = ["folded_update_steps", "reference64"]
