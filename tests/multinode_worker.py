"""One torchrun worker of tests/test_multinode.py: examples/train_multinode.py's main(), plus
two things only a test needs.

- After main() returns, the rank writes ``$ZK_TEST_OUT/done-rank<r>.json`` (its rank, node,
  pids and losses): the test's evidence that every rank finished.
- ``ZK_TEST_PAUSE_AT=k``: in the first attempt (TORCHELASTIC_RESTART_COUNT 0), right after
  the checkpoint of step k, every rank writes ``$ZK_TEST_OUT/pause-rank<r>.json`` and blocks in
  a receive from a rank of the other node that nobody sends. The job stands still at a known
  point with a complete checkpoint, so the test can kill one node then, not at some step a
  race picks; the survivors' receives fail when the killed node's sockets close, as any
  collective would, and torchrun restarts them.

Command line: examples/train_multinode.py's, passed through.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_multinode.py"


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)  # the test never reads a half-written file


def _me() -> dict:
    """This process's place in the job, from torchrun's environment."""
    return dict(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]),
                group_rank=int(os.environ["GROUP_RANK"]),
                restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                pid=os.getpid(), agent_pid=os.getppid())


def main() -> None:
    spec = importlib.util.spec_from_file_location("train_multinode", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    out = Path(os.environ["ZK_TEST_OUT"])
    pause_at = int(os.environ.get("ZK_TEST_PAUSE_AT", 0))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    def on_checkpoint(step: int) -> None:
        if step != pause_at or restart != 0:
            return
        me = _me()
        _write(out / f"pause-rank{me['rank']}.json", me)
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        dist.recv(torch.zeros(1), src=(me["rank"] + per_node) % me["world"])
        raise AssertionError("a receive that nobody sends to returned")

    losses = example.main(sys.argv[1:], on_checkpoint=on_checkpoint)
    me = _me()
    _write(out / f"done-rank{me['rank']}.json", dict(me, losses=losses))


if __name__ == "__main__":
    main()
