"""One table of tolerances for the suite, by dtype (docs/how-it-works/conventions.md, Tolerances:
when the tests compare bit for bit, against these, or against a derived bound)."""

import torch

# (rtol, atol) for comparing an fp32 result against a float64 reference of the same inputs.
ADAM_FP32 = (2e-6, 1e-7)
# Multi-step training parity against DDP + torch.optim.AdamW (fp32 params).
TRAIN_FP32 = (1e-5, 1e-5)
# sq_norm in fp32-or-better accumulation vs float64.
SQ_NORM = (1e-5, 0.0)

TOL = {torch.float32: ADAM_FP32}

# Unit roundoffs: one round-to-nearest moves x by at most U * |x| (and by at most U times the
# rounded value). fp32 keeps 24 significant bits, bf16 8 (7 stored + the implicit one).
U_FP32 = 2.0**-24
U_BF16 = 2.0**-8


def adamw_step_bound(beta1: float, beta2: float, t: int) -> float:
    """Largest |m_hat / (sqrt(v_hat) + eps)| AdamW's step t can take, whatever the gradients:
    a parameter moves by at most lr times this (plus its weight decay) at step t.

    m_hat = (1-b1)/(1-b1^t) * sum_k b1^(t-k) g_k and v_hat = (1-b2)/(1-b2^t) * sum_k
    b2^(t-k) g_k^2; by Cauchy-Schwarz, |sum_k b1^(t-k) g_k| <= sqrt(sum_j (b1^2/b2)^j) *
    sqrt(sum_k b2^(t-k) g_k^2), with equality for g_k proportional to (b1/b2)^(t-k). eps only
    makes the step smaller. 1 at t = 1 (the step is sign(g)); for betas (0.9, 0.999) 1.0108
    at t = 5 and 1.0431 at t = 10.
    """
    q = beta1 * beta1 / beta2
    return ((1 - beta1) / (1 - beta1**t) * ((1 - beta2**t) / (1 - beta2)) ** 0.5
            * sum(q**j for j in range(t)) ** 0.5)
