"""Triton kernels: fused AdamW, sq_norm, flatten/unflatten (copy_segments).

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors. Triton 3.6's interpreter cannot
run a loop whose trip count is a runtime value with numpy >= 2.4 (it calls ``int()`` on a
one-element array, which numpy 2.4 removed), and the sq_norm and flatten kernels have such
loops. ``interpreter_problem()`` detects that by running a one-loop kernel once, so callers
can refuse (or tests skip) with the fix named instead of failing deep inside the interpreter.
Compiled kernels (a real GPU) are not affected.
"""

from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def interpreter_problem() -> str | None:
    """None when the kernels can run here; otherwise why not and what to do. Only the
    interpreter is probed; without TRITON_INTERPRET=1 this returns None at once."""
    if not interpreting():
        return None
    import numpy
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x_ptr, n):
        for i in range(0, n):
            tl.store(x_ptr + i, i)

    x = torch.zeros(3, dtype=torch.int32)
    try:
        _probe[(1,)](x, 3)
    except Exception as exc:  # noqa: BLE001 - any failure means the interpreter is unusable
        return (f"the Triton {triton.__version__} interpreter cannot run kernels with runtime "
                f"loop bounds under numpy {numpy.__version__} ({type(exc).__name__}: "
                f"{str(exc)[:160]}); under TRITON_INTERPRET=1 use numpy<2.4 with this Triton, "
                f"or Triton >= 3.8")
    if x.tolist() != [0, 1, 2]:
        return f"the Triton {triton.__version__} interpreter ran a loop wrongly: {x.tolist()}"
    return None


def check_interpreter() -> None:
    """Raise RuntimeError (before any tensor is touched) when interpreter_problem()."""
    why = interpreter_problem()
    if why is not None:
        raise RuntimeError(why)
