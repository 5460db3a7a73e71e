"""Train the demo GPT with ZeRO on several nodes, and survive losing one (torchrun elastic).

The pattern to copy: save a zerokern checkpoint every ``--ckpt-every`` steps to one path, and
at start-up resume from it when it is there. A zerokern checkpoint loads at any world size,
so when torchrun restarts the job with fewer (or more) nodes, the survivors reshard the last
checkpoint onto the new world and carry on. The global batch stays the same at every world
size (``--global-batch`` rows a step, split over the ranks), so the restarted job continues
the same training; the per-step learning rate is a function of the step alone.

Two nodes of 8 GPUs; run this on every node, HOST being the address of one of them and
/shared a filesystem every node sees:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id myjob examples/train_multinode.py --ckpt /shared/ckpt

Elastic: between 1 and 4 nodes, the job restarted at most 3 times (a lost node, a crash)
from the last checkpoint, at whatever number of nodes is left (the variable gives every
attempt a fresh store: torch 2.14 otherwise hands restarted processes the failed attempt's
one, see docs/multinode.md):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:4 --max-restarts 3 \\
        --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id myjob \\
        examples/train_multinode.py --ckpt /shared/ckpt

On this machine, 2 "nodes" of 2 CPU processes over gloo (what tests/test_multinode.py runs;
the agents pin ``--rdzv-conf is_host=...`` and ``--local-addr`` so the roles of the two
agents on one host are fixed):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 examples/train_multinode.py --model-size tiny \\
        --ckpt /tmp/ckpt --steps 20

(the same command in a second terminal). With the c10d rendezvous torchrun assigns the node
ranks itself (``--node-rank`` is ignored); ``GROUP_RANK`` tells a process which node it is.

By default the optimizer state (at ``--stage 3`` the parameters too) is sharded within a node
and replicated across nodes: a 2-D DeviceMesh of (nodes, node size), FSDP2's HSDP layout
(docs/hybrid.md); ``--sharding flat`` shards over every rank. The size of a node (the
processes that share a machine's fast links) is a setting, never guessed from the GPUs a
process sees: ``--node-size``, else ``ZEROKERN_NODE_SIZE``, else torchrun's
``LOCAL_WORLD_SIZE`` (its ``--nproc-per-node``). See docs/multinode.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerokern
from zerokern.demo import GPT, VOCAB, Block, config_for, get_batch


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``argv`` as for argparse; None reads sys.argv)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--steps", type=int, default=200, help="total steps, resumed ones included")
    p.add_argument("--model-size", default="small", choices=("tiny", "small", "base"))
    p.add_argument("--global-batch", type=int, default=16,
                   help="sequences per step over all ranks; the world size must divide it")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--ckpt", default=None,
                   help="checkpoint path on a filesystem every node sees; resumed if present")
    p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--sharding", default="hybrid", choices=("hybrid", "flat"),
                   help="hybrid: shard within a node, replicate across nodes (a 2-D mesh); "
                        "flat: shard over every rank")
    p.add_argument("--node-size", type=int, default=None,
                   help="processes per node (default: $ZEROKERN_NODE_SIZE, else "
                        "torchrun's $LOCAL_WORLD_SIZE)")
    p.add_argument("--metrics", default=None,
                   help="rank 0 appends one JSON line per step: step, loss, world size")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "global_batch", "ckpt_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def node_size(args: argparse.Namespace, world: int) -> int:
    """Processes per node: a setting (flag, ZEROKERN_NODE_SIZE or torchrun's LOCAL_WORLD_SIZE),
    never the number of GPUs this process can see, so one machine can play several nodes."""
    raw = args.node_size or os.environ.get("ZEROKERN_NODE_SIZE") \
        or os.environ.get("LOCAL_WORLD_SIZE") or world
    size = int(raw)
    if size < 1 or world % size:
        raise ValueError(f"node size (--node-size / ZEROKERN_NODE_SIZE / LOCAL_WORLD_SIZE) "
                         f"must divide the world size {world}, got {size}")
    return size


def checkpoint_exists(path: str) -> bool:
    """Whether load_checkpoint(path) has something to load: the path itself or, after a save
    that crashed between its two renames (filesystems without an atomic exchange), a complete
    sibling (docs/checkpoints.md, "What a crash leaves behind")."""
    return os.path.lexists(path) or bool(
        glob.glob(glob.escape(path) + ".tmp-*/meta.json")
        + glob.glob(glob.escape(path) + ".old-*/meta.json"))


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Warm-up for 10% of the steps, then cosine to a tenth: a function of the step alone, so
    a resumed run follows the same schedule without saving a scheduler."""
    warmup = max(1, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def main(argv: Sequence[str] | None = None,
         on_checkpoint: Callable[[int], None] | None = None) -> list[float]:
    """Train (resuming from ``--ckpt`` when it exists) and return the global loss of each step
    this process ran. ``on_checkpoint(step)`` runs on every rank after each checkpoint
    (``step`` steps done): the tests use it to stop a node at a known point."""
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # torchrun's env:// rendezvous
    try:
        return _train(args, use_cuda, on_checkpoint)
    finally:
        dist.destroy_process_group()


def _train(args: argparse.Namespace, use_cuda: bool,
           on_checkpoint: Callable[[int], None] | None) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise ValueError(f"--global-batch {args.global_batch} is not a multiple of the world "
                         f"size {world}: pick one every world size of the job divides")
    micro = args.global_batch // world
    per_node = node_size(args, world)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda \
        else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)
    cfg = config_for(args.model_size, VOCAB)
    model = GPT(cfg).to(device=device, dtype=getattr(torch, args.dtype))
    mesh = None
    if args.sharding == "hybrid":
        # Rows are nodes: torchrun numbers the ranks node by node, so row r holds node r's
        # ranks. Dim 0 replicates across nodes, dim 1 shards within one (docs/hybrid.md).
        mesh = init_device_mesh(device.type, (world // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))
    opt = zerokern.parallelize(model, stage=args.stage, unit_classes=(Block,), mesh=mesh,
                               lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                               max_grad_norm=1.0)

    start = 0
    # Every rank must take the same branch: rank 0 looks, the others follow.
    found = [args.ckpt is not None and rank == 0 and checkpoint_exists(args.ckpt)]
    dist.broadcast_object_list(found, src=0)
    if found[0]:
        extra = zerokern.load_checkpoint(args.ckpt, model, opt)  # reshards to this world
        start = int(extra["step"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if rank == 0:
        how = f"resumed at step {start}" if found[0] else "from scratch"
        print(f"{world} ranks = {world // per_node} node(s) x {per_node}, {args.sharding} "
              f"sharding, stage {args.stage}; restart {restart}, {how}", flush=True)

    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = get_batch(step, rank, world, micro, cfg.seq, device)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)  # every rank has the same rows count: the mean of the means
        losses.append(total.item() / world)
        if rank == 0 and args.metrics:
            with open(args.metrics, "a") as f:
                f.write(json.dumps({"step": step, "loss": losses[-1], "world": world,
                                    "restart": restart}) + "\n")
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            dt = (time.perf_counter() - t0) / (step - start + 1)
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {dt * 1e3:.0f} ms/step", flush=True)

        done = step + 1
        if args.ckpt is not None and (done % args.ckpt_every == 0 or done == args.steps):
            # Atomic: a node lost during the save leaves the previous checkpoint at the path.
            zerokern.save_checkpoint(args.ckpt, model, opt, extra={"step": done})
            if on_checkpoint is not None:
                on_checkpoint(done)
    return losses


if __name__ == "__main__":
    main()
