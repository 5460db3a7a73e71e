"""Multi-node launch and elastic resume, through torchrun's own machinery, on one machine.

Each test starts real torchrun agents (``python -m torch.distributed.run``, or its entry point
held until a file exists: tests/multinode_agent.py; the c10d rendezvous, 2 CPU processes per
agent over gloo) running examples/train_multinode.py through
tests/multinode_worker.py, and compares loss curves bit for bit against independent launches:

- two agents ``--nnodes 2`` (a job of 2 "nodes" x 2 processes, hybrid sharding on a 2 x 2
  mesh whose node size is torchrun's LOCAL_WORLD_SIZE) train exactly as one agent with 4
  processes on the same mesh (``--standalone``, ZEROKERN_NODE_SIZE=2): same losses, same
  final optimizer state;
- two agents ``--nnodes 1:2 --max-restarts 1``: one node is killed (agent and workers, SIGKILL)
  after the checkpoint of step 3; torchrun restarts the survivor at world size 2 (a 1 x 2
  mesh), the script resumes from the checkpoint (resharded) and its losses equal those of a
  separate 2-process run from a copy of that checkpoint; the steps before the kill equal the
  4-process run's.

Two agents on one host: each pins its role with ``--rdzv-conf is_host=...`` (one hosts the
rendezvous store; the other, started first, waits to connect) and ``--local-addr`` 127.0.0.1 /
127.0.0.2 (the rendezvous ranks nodes by address, then pid, so the address fixes which is node
0). The node killed is the one that hosts no store, as on real machines where the store host
is the node a job cannot lose (pytorch issue #147064 discusses what goes wrong otherwise).

Robustness: the rendezvous port is picked outside the kernel's ephemeral range and checked
free; every agent runs in its own session; every process started carries a token in its
environment and whatever of them is left is killed when a test ends, passed or not. Each
wait has a deadline (a failure, never the expected time) and a failure shows the agents'
logs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("multinode_worker.py")
HELD_AGENT = Path(__file__).with_name("multinode_agent.py")  # torchrun, held until a file exists
ROOT = WORKER.parents[1]
STEPS, CKPT_EVERY, KILL_AFTER = 8, 3, 3
TRAIN = ["--model-size", "tiny", "--steps", str(STEPS), "--global-batch", "8",
         "--ckpt-every", str(CKPT_EVERY)]
HYBRID_2X2 = "4 ranks = 2 node(s) x 2, hybrid sharding, stage 2;"  # rank 0's first line
HYBRID_1X2 = "2 ranks = 1 node(s) x 2, hybrid sharding, stage 2;"
DEADLINE = 300.0  # seconds any launch may take before the test fails (normal: 10-40 s)
# Rendezvous settings: nothing waits for ever. A restarted round completes after the dead
# node's heartbeats lapse (keep_alive_interval x keep_alive_max_attempt) and last_call_timeout.
RDZV = "join_timeout=120,read_timeout=120,close_timeout=30"
ELASTIC_RDZV = RDZV + ",last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5"


def free_port() -> int:
    """A port for the rendezvous store: below the ephemeral range (so no outgoing connection
    or bind(0) of another process takes it in the meantime) and free now."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, low) if low > 21000 else rng.randrange(low, 65536)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port found")


def tagged_pids(token: str) -> list[int]:
    """Processes whose environment holds ``token``: the agents, their workers, and any
    worker an agent left behind (workers run in sessions of their own)."""
    pids = []
    needle = f"ZK_TEST_TOKEN={token}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class Job:
    """torchrun agents started by one test, their logs, and their cleanup."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token = uuid.uuid4().hex
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str, torchrun: list[str], train: list[str], out: Path,
              env: dict[str, str] | None = None, gate: Path | None = None) -> subprocess.Popen:
        """Start an agent. With ``gate``, it imports torch now and starts torchrun once
        ``gate`` exists (tests/multinode_agent.py)."""
        out.mkdir(parents=True, exist_ok=True)
        full_env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO", PYTHONUNBUFFERED="1",
                        ZK_TEST_OUT=str(out), ZK_TEST_TOKEN=self.token, **(env or {}))
        launcher = ["-m", "torch.distributed.run"] if gate is None else [str(HELD_AGENT), str(gate)]
        with open(self.root / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *launcher, "--log-dir",
                 str(self.root / f"torchelastic-{name}"), *torchrun, str(WORKER), *train],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                cwd=ROOT, start_new_session=True)
        self.agents[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"----- {n} (exit {p.poll()}) -----\n{self.log(n)[-6000:]}"
                         for n, p in self.agents.items())

    def wait_until(self, ok: Callable[[], bool], what: str, t0: float) -> None:
        """Poll ``ok`` until it holds; fail (with the logs) past the deadline or when every
        agent has exited without it."""
        while not ok():
            if time.monotonic() - t0 > DEADLINE:
                pytest.fail(f"{what}: not after {DEADLINE:.0f} s\n{self.logs()}")
            if all(p.poll() is not None for p in self.agents.values()) and not ok():
                pytest.fail(f"{what}: every agent exited first\n{self.logs()}")
            time.sleep(0.1)

    def finish(self, name: str, t0: float) -> int:
        proc = self.agents[name]
        try:
            return proc.wait(timeout=max(1.0, DEADLINE - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"agent {name} still running after {DEADLINE:.0f} s\n{self.logs()}")

    def close(self) -> None:
        for _ in range(3):  # an agent may start a worker while the first pass kills
            for pid in tagged_pids(self.token):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.agents.values():
            proc.wait()


def kill_node(agent: subprocess.Popen, workers: list[int]) -> None:
    """What losing a machine looks like to the rest of the job: its agent and its workers
    die at once (SIGKILL: no handler runs, no socket is closed politely)."""
    os.killpg(agent.pid, signal.SIGKILL)
    for pid in workers:
        try:
            os.killpg(pid, signal.SIGKILL)  # each worker leads a session of its own
        except ProcessLookupError:
            pass
    agent.wait()


def read_ranks(out: Path, prefix: str) -> dict[int, dict]:
    return {d["rank"]: d for d in
            (json.loads(p.read_text()) for p in out.glob(f"{prefix}-rank*.json"))}


def one_curve(done: dict[int, dict], world: int) -> list[float]:
    """The loss curve every rank saw (the same all-reduced value on each)."""
    assert sorted(done) == list(range(world)), f"ranks that finished: {sorted(done)}"
    curves = {tuple(d["losses"]) for d in done.values()}
    assert len(curves) == 1, f"the ranks disagree on the losses: {curves}"
    return list(curves.pop())


def final_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every rank file's fp32 master and moments, by file and tensor."""
    return {f"{p.name}:{k}": v for p in sorted(ckpt.glob("rank*.safetensors"))
            for k, v in load_file(p).items()}


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.close()
        assert not tagged_pids(j.token), "processes left behind"


class Reference:
    """The reference: the same training in one agent with 4 processes, told that a node has
    2 of them (ZEROKERN_NODE_SIZE), so its mesh is the same 2 x 2. It is started when the
    first test asks for it and runs beside that test's own agents (the 2 cores are otherwise
    idle while an agent imports torch or a rendezvous waits); ``result()`` waits for it."""

    def __init__(self, root: Path) -> None:
        self.root, self.job, self.t0 = root, Job(root), time.monotonic()
        self.job.start("standalone4", ["--standalone", "--nproc-per-node", "4"],
                       TRAIN + ["--ckpt", str(root / "ckpt")], root / "out",
                       {"ZEROKERN_NODE_SIZE": "2"})
        self._result: tuple[list[float], dict[str, torch.Tensor]] | None = None

    def result(self) -> tuple[list[float], dict[str, torch.Tensor]]:
        """(the loss curve, the final checkpoint's state); the launch must have succeeded."""
        if self._result is None:
            rc = self.job.finish("standalone4", self.t0)
            assert rc == 0, f"agent standalone4 exited {rc}\n{self.job.logs()}"
            assert HYBRID_2X2 in self.job.log("standalone4"), self.job.logs()
            self._result = (one_curve(read_ranks(self.root / "out", "done"), 4),
                            final_state(self.root / "ckpt"))
        return self._result


@pytest.fixture(scope="module")
def standalone4(tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("standalone4"))
    try:
        yield ref
    finally:
        ref.job.close()
        assert not tagged_pids(ref.job.token), "processes left behind"


def agent_args(port: int, run_id: str, nnodes: str, node: int, conf: str,
               restarts: int = 0) -> list[str]:
    """torchrun's options for 'node' ``node`` of a c10d job on this machine: node 0 hosts the
    rendezvous store and gets the lower address, so it is rendezvous rank 0."""
    return ["--nnodes", nnodes, "--node-rank", str(node), "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id, "--local-addr", f"127.0.0.{node + 1}",
            "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'},{conf}",
            "--max-restarts", str(restarts), "--monitor-interval", "0.2"]


def test_two_agents_train_as_one(job, tmp_path, standalone4):
    """torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2 --rdzv-backend c10d: all 4
    ranks finish, node 0 holds ranks 0-1, the script shards within each node (a 2 x 2 mesh
    from torchrun's LOCAL_WORLD_SIZE), and the losses and the final checkpoint equal those of
    the 4-process single-agent run on the same mesh bit for bit."""
    port, run_id, out, ckpt = free_port(), job.token[:12], tmp_path / "out", tmp_path / "ckpt"
    train = TRAIN + ["--ckpt", str(ckpt)]
    t0 = time.monotonic()
    nodes = [job.start(f"node{n}", agent_args(port, run_id, "2", n, RDZV), train, out)
             for n in (0, 1)]
    for n in (0, 1):
        rc = job.finish(f"node{n}", t0)
        assert rc == 0, f"node{n} exited {rc}\n{job.logs()}"

    assert HYBRID_2X2 in job.log("node0"), job.logs()
    ref_losses, ref_state = standalone4.result()
    done = read_ranks(out, "done")
    losses = one_curve(done, 4)
    for r, d in done.items():
        assert (d["world"], d["group_rank"], d["agent_pid"]) == (4, r // 2, nodes[r // 2].pid)
    assert len(losses) == STEPS
    assert losses == ref_losses  # bitwise: the same ranks, layout and reduction order
    meta = json.loads((ckpt / "meta.json").read_text())
    # One file per rank of the shard group (2): the replicas hold the same shards.
    assert (meta["world_size"], meta["extra"]) == (2, {"step": STEPS})
    state = final_state(ckpt)
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in state)


def test_elastic_restart_resumes_from_checkpoint(job, tmp_path, standalone4):
    """--nnodes 1:2 --max-restarts 1: node 1 is killed after the checkpoint of step 3 (saved
    on the 2 x 2 mesh); the survivor restarts at world size 2 (a 1 x 2 mesh), resumes from
    that checkpoint and trains exactly as a 2-process run from a copy of it."""
    port, run_id = free_port(), job.token[:12]
    out, ckpt, metrics = tmp_path / "out", tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    train = TRAIN + ["--ckpt", str(ckpt), "--metrics", str(metrics)]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store for the workers of every attempt.
    # torch 2.14's agent otherwise hands the restarted workers the store of the attempt that
    # failed, unprefixed, and a new rank reads the dead rank 0's gloo address from it
    # ("Gloo connectFullMesh failed ... Connection refused"; pytorch #135712, #167288).
    pause = {"ZK_TEST_PAUSE_AT": str(KILL_AFTER), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    t0 = time.monotonic()
    # Node 1 first: it waits to connect to the store node 0 will host, so both are in the
    # first round long before node 0's last call ends (a late node 1 would instead join a
    # running job and restart it at 4 ranks: a different, and not the tested, path). Node 0
    # imports torch meanwhile and starts torchrun once node 1's has started (the gate).
    gate = tmp_path / "node1-started"
    node0 = job.start("node0", agent_args(port, run_id, "1:2", 0, ELASTIC_RDZV, 1), train, out,
                      pause, gate=gate)
    node1 = job.start("node1", agent_args(port, run_id, "1:2", 1, ELASTIC_RDZV, 1), train, out,
                      pause)
    job.wait_until(lambda: "Starting elastic_operator" in job.log("node1"),
                   "node 1's agent starting", t0)
    gate.touch()
    job.wait_until(lambda: len(list(out.glob("pause-rank*.json"))) == 4,
                   f"4 ranks stopped after the checkpoint of step {KILL_AFTER}", t0)

    paused = read_ranks(out, "pause")
    for r, d in paused.items():
        assert (d["world"], d["restart"], d["group_rank"]) == (4, 0, r // 2), paused
        assert d["agent_pid"] == (node0.pid, node1.pid)[r // 2], paused
    saved = tmp_path / "ckpt-step3"
    shutil.copytree(ckpt, saved)  # every rank is blocked: the checkpoint is complete and still
    # The reference: an uninterrupted 2-process run from the copy of the step-3 checkpoint,
    # started now to use the seconds the survivor's rendezvous spends waiting.
    job.start("from_step3", ["--standalone", "--nproc-per-node", "2"],
              TRAIN + ["--ckpt", str(saved)], tmp_path / "ref")
    kill_node(node1, [d["pid"] for d in paused.values() if d["group_rank"] == 1])
    for name in ("node0", "from_step3"):
        rc = job.finish(name, t0)
        assert rc == 0, f"{name} exited {rc}\n{job.logs()}"

    assert HYBRID_2X2 in job.log("node0") and HYBRID_1X2 in job.log("node0"), job.logs()
    ref_losses, _ = standalone4.result()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(m["step"], m["world"], m["restart"]) for m in rows] == (
        [(s, 4, 0) for s in range(KILL_AFTER)] + [(s, 2, 1) for s in range(KILL_AFTER, STEPS)])
    done = read_ranks(out, "done")
    resumed = one_curve(done, 2)
    assert all((d["group_rank"], d["agent_pid"]) == (0, node0.pid) for d in done.values())
    assert [m["loss"] for m in rows] == ref_losses[:KILL_AFTER] + resumed
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (meta["world_size"], meta["extra"]) == (2, {"step": STEPS})

    assert resumed == one_curve(read_ranks(tmp_path / "ref", "done"), 2)  # bitwise
    # Step 3 runs on the weights the checkpoint holds, over the same 8 rows as the 4-process
    # run: only the order of the fp32 sums differs, so the reload itself is exact.
    assert resumed[0] == pytest.approx(ref_losses[KILL_AFTER], rel=1e-6)
    # Against the 4-process run the resumed steps differ by rounding only: each rank takes the
    # mean of 4 rows, not 2, before the ranks' gradients are averaged, so the fp32 gradients
    # differ in their last bits (the loss of step 3, same weights, by 2e-7), and rounding the
    # updated weights to bf16 can land on the neighbouring value (2^-8 relative) for a few of
    # them: about 1e-4 relative on the loss after that. Deterministic, so the bound is firm.
    assert resumed == pytest.approx(ref_losses[KILL_AFTER:], rel=1e-3)
