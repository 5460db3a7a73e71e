"""Independent references shared by the kernel tests: the AdamW step in float64."""

from __future__ import annotations


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


__all__ = ["reference64"]
