"""torch alone, no zerokern: 2 gloo ranks all-gather into `narrow` views made for the call,
then exit at once. The views' Python objects die when the call returns, while gloo's worker
thread still holds the finished Work (and so the tensors); when it lets go during interpreter
shutdown it needs the GIL, and the process can die in std::terminate (SIGABRT).

    python scripts/repro_gloo_exit.py RUNS     prints how many of RUNS runs exited non-zero
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

RANK_CODE = """
import sys, torch, torch.distributed as dist
rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
buf = torch.zeros(2 * 4096)
for _ in range(3):
    dist.all_gather_into_tensor(buf.narrow(0, 0, 2 * 4096), buf.narrow(0, rank * 4096, 4096))
"""


def one_run() -> list[int]:
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "rendezvous")
        procs = [subprocess.Popen([sys.executable, "-c", RANK_CODE, str(r), init],
                                  stderr=subprocess.DEVNULL) for r in range(2)]
        return [p.wait(timeout=120) for p in procs]


if __name__ == "__main__":
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    bad = sum(any(one_run()) for _ in range(runs))
    print(f"torch {__import__('torch').__version__}: {bad} of {runs} runs exited non-zero")
