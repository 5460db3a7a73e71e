"""Train a small GPT with ZeRO: zerokern as a drop-in replacement for DDP + torch.optim.AdamW.

CPU, 2 processes on this machine (gloo):

    torchrun --nproc-per-node 2 examples/train_gpt.py --stage 2

GPUs (NCCL), one machine with 8 GPUs:

    torchrun --nproc-per-node 8 examples/train_gpt.py --stage 3

Several nodes: run this on every node, HOST being the address of one of them:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_gpt.py

(examples/train_multinode.py adds hybrid sharding within nodes and checkpoints that let an
elastic job resume after losing a node: docs/multinode.md.)

The model and the data (a text corpus generated locally, nothing downloads) come from
zerokern.demo. Compared with a DDP script, the ZeRO-specific line is the one marked "ZeRO":
the model is not wrapped in DDP (ZeroAdamW averages the gradients over the ranks itself), and
zerokern.parallelize builds the optimizer in place of torch.optim.AdamW; at stage 3 it first
partitions the parameters, one unit per transformer block.
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

import zerokern
from zerokern.demo import GPT, VOCAB, Block, config_for, decode, get_batch

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument(
    "--stage",
    type=int,
    default=2,
    choices=(0, 1, 2, 3),
    help="0: DDP-like, 1: optimizer state sharded, 2: + gradients, 3: + params",
)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--model-size", default="small", choices=("tiny", "small", "base"))
parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument(
    "--dtype",
    default="bfloat16",
    choices=("bfloat16", "float32"),
    help="parameters; with bfloat16 the optimizer keeps fp32 master weights",
)
args = parser.parse_args()

# torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address.
use_cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if use_cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if use_cuda:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
master = rank == 0

torch.manual_seed(0)  # same initial weights everywhere (ZeroAdamW also broadcasts rank 0's)
cfg = config_for(args.model_size, VOCAB)
model = GPT(cfg).to(device=device, dtype=getattr(torch, args.dtype))
if master:
    print(
        f"{model.num_params():,} parameters, ZeRO stage {args.stage}, {world} ranks over "
        f"{dist.get_backend()}, {args.dtype}"
    )

optimizer = zerokern.parallelize(  # ZeRO: in place of DDP(model) + torch.optim.AdamW
    model,
    stage=args.stage,
    unit_classes=(Block,),  # stage 3: one unit per block
    lr=args.lr,
    betas=(0.9, 0.95),
    weight_decay=0.1,
    max_grad_norm=1.0,
)


def lr_at(step):
    """Linear warm-up for 10% of the steps, then cosine decay to a tenth of the peak."""
    warmup = max(1, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


t0 = time.perf_counter()
for step in range(args.steps):
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step)
    # Each rank takes its slice of the step's global batch.
    x, y = get_batch(step, rank, world, args.micro_batch, cfg.seq, device)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    if step % 20 == 0 or step == args.steps - 1:
        loss = loss.detach().float()
        dist.all_reduce(loss)  # the global batch's loss: mean over ranks
        dt = (time.perf_counter() - t0) / (step + 1)
        if master:
            print(f"step {step:4d}  loss {loss.item() / world:.4f}  {dt * 1e3:.0f} ms/step")

# Sample some text. Every rank runs the same forwards (stage 3 gathers each block from all of
# them) and draws the same characters from a generator seeded alike.
model.eval()
gen = torch.Generator().manual_seed(0)
idx = torch.zeros(1, 1, dtype=torch.long, device=device)  # start after a newline
with torch.no_grad():
    for _ in range(120):
        logits, _ = model(idx[:, -cfg.seq :])
        probs = torch.softmax(logits[0, -1].float(), dim=-1).cpu()
        nxt = torch.multinomial(probs, 1, generator=gen).to(device)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
if master:
    print("sample:", decode(idx[0, 1:]).replace("\n", " / "))

dist.destroy_process_group()
