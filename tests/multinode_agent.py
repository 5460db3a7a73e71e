"""torchrun, held at the start: ``python tests/multinode_agent.py GATE <torchrun's arguments>``
imports torch.distributed.run (torch: seconds of CPU), waits until the file GATE exists, then
runs torchrun's entry point, ``torch.distributed.run.main`` (what the ``torchrun`` script and
``python -m torch.distributed.run`` call), on the arguments that follow.

tests/test_multinode.py's elastic case starts its second agent this way: its import overlaps
the first agent's, and the rendezvous still sees the agents arrive in the order the test
needs (the test creates GATE once the first agent is up).
"""

import sys
import time
from pathlib import Path

from torch.distributed.run import main

if __name__ == "__main__":
    gate = Path(sys.argv.pop(1))
    deadline = time.monotonic() + 600.0  # the test kills it sooner; never left waiting
    while not gate.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{gate} not created within 600 s")
        time.sleep(0.05)
    main()
