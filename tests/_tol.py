"""One table of tolerances for the suite, by dtype (see DESIGN.md §6)."""

import torch

# (rtol, atol) for comparing an fp32 result against a float64 reference of the same inputs.
ADAM_FP32 = (2e-6, 1e-7)
# Multi-step training parity against DDP + torch.optim.AdamW (fp32 params).
TRAIN_FP32 = (1e-5, 1e-5)
# sq_norm in fp32-or-better accumulation vs float64.
SQ_NORM = (1e-5, 0.0)

TOL = {torch.float32: ADAM_FP32}
