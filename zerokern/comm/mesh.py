"""Hybrid sharding: the Comm of a ``torch.distributed.device_mesh.DeviceMesh``.

``ZeroAdamW(..., mesh=)`` and ``shard_model(..., mesh=)`` take a 1-D or 2-D DeviceMesh, FSDP2's
HSDP convention: dim 0 replicates, dim 1 shards (whatever the dims are named). A rank's Comm
is then its shard group (the optimizer state, and at stage 3 the parameters, are split over
its S ranks; the layout, the state and ``comm.rank`` / ``comm.world_size`` are the shard
group's), and ``comm.replicate`` is its replicate group (R ranks holding the same shard):
each gradient slice reduce-scattered within the shard group is then all-reduced across the
replicate group and averaged by S * R once. A 1-D mesh is its group, as ``process_group=``.

The size of a "node" (the shard group) is the mesh's, never guessed from the number of local
devices, so one machine can play several nodes.

The checks run on every process of the default group before anything changes, and every
process reaches the same verdict from the same gathered facts: a mesh that is not a
DeviceMesh, has 3 or more dims, was given with ``process_group``, does not hold every process
of the default group exactly once, or differs between processes raises ValueError naming
``mesh`` on every rank (otherwise one rank would wait in a collective the others never join).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .collectives import Comm

REPLICATE, SHARD = 0, 1
"""FSDP2's HSDP convention: mesh dim 0 replicates, dim 1 shards."""


def _describe(mesh: Any, process_group: Any, where: str) -> tuple[str | None, Any]:
    """What this rank was given: (its mistake or None, (mesh rank lists, dim names))."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - every supported torch has it
        return f"{where}: torch.distributed.device_mesh is not available", None
    if not isinstance(mesh, DeviceMesh):
        return (f"{where}: mesh must be a torch.distributed.device_mesh.DeviceMesh (e.g. "
                f"init_device_mesh('cuda', (nodes, gpus_per_node))), got "
                f"{type(mesh).__name__}"), None
    facts = (mesh.mesh.tolist(), mesh.mesh_dim_names)
    if process_group is not None:
        return (f"{where}: mesh and process_group were both given; the mesh names the groups "
                "(give one of them)"), facts
    if mesh.ndim not in (1, 2):
        return (f"{where}: mesh has {mesh.ndim} dims {tuple(mesh.mesh.shape)}; zerokern takes "
                "a 1-D mesh (flat sharding) or a 2-D one (dim 0 replicate, dim 1 shard)"), facts
    return None, facts


def _verdict(gathered: list[tuple[str | None, Any]], world: int, where: str) -> str | None:
    """The first mistake in every process's facts (the same on every rank), or None."""
    for r, (err, _) in enumerate(gathered):
        if err is not None:
            return err if len(gathered) == 1 else f"{err} (on rank {r})"
    ref = gathered[0][1]
    for r, (_, facts) in enumerate(gathered):
        if facts != ref:
            return (f"{where}: mesh differs across processes: rank 0 passed {ref[0]} (dims "
                    f"{ref[1]}), rank {r} passed {facts[0]} (dims {facts[1]}); build it the same "
                    "way on every rank (init_device_mesh)")
    ranks = ref[0]
    flat = [x for row in ranks for x in row] if ranks and isinstance(ranks[0], list) else ranks
    if sorted(flat) != list(range(world)):
        shape = ((len(ranks), len(ranks[0])) if ranks and isinstance(ranks[0], list)
                 else (len(ranks),))
        return (f"{where}: mesh {shape} holds ranks {sorted(flat)}, but the default process "
                f"group has {world}: its dims must multiply to the world size and hold every "
                f"rank once (e.g. init_device_mesh(device, (nodes, {world} // nodes)))")
    return None


def mesh_comm(mesh: Any, process_group: Any = None, *, where: str = "ZeroAdamW") -> Comm:
    """The Comm of ``mesh`` (``mesh`` None: of ``process_group``, as before). A collective
    over the default group when a mesh is given: call it on every rank."""
    if mesh is None:
        return Comm(process_group)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{where}: mesh was given but torch.distributed is not initialized")
    err, facts = _describe(mesh, process_group, where)
    world = Comm(None)  # the default group, for the checks only (uncounted traffic)
    gathered = world.all_gather_object((err, facts), "device mesh")
    verdict = _verdict(gathered, world.world_size, where)
    if verdict is not None:
        raise ValueError(verdict)
    return comm_of_mesh(mesh)


def describe_mesh(mesh: Any, process_group: Any, where: str) -> tuple[str | None, Any]:
    """This rank's mesh as ``mesh_comm`` gathers it: (its mistake or None, its facts), for a
    caller that gathers it together with other facts (zero/agreement.py) and then calls
    ``mesh_verdict`` on what every rank of the default group sent."""
    if not (dist.is_available() and dist.is_initialized()):
        return f"{where}: mesh was given but torch.distributed is not initialized", None
    return _describe(mesh, process_group, where)


def mesh_verdict(gathered: list[tuple[str | None, Any]], world: int, where: str) -> str | None:
    """The first mistake in every process's ``describe_mesh`` (the same on every rank)."""
    return _verdict(gathered, world, where)


def comm_of_mesh(mesh: Any) -> Comm:
    """The Comm of a mesh every rank has checked (``mesh_verdict`` found nothing): no
    collective."""
    if mesh.ndim == 1:
        comm = Comm(mesh.get_group(0))
    else:
        comm = Comm(mesh.get_group(SHARD))
        comm.replicate = Comm(mesh.get_group(REPLICATE))
    comm.mesh_ranks = mesh.mesh.tolist() if mesh.ndim == 2 else [mesh.mesh.tolist()]
    comm.mesh_dim_names = mesh.mesh_dim_names
    return comm


def hpz_comm(comm: Comm) -> Comm:
    """hpZ's Comm (``shard_model(hpz=True)``) of a checked 2-D mesh whose shard group is
    ``comm``: every rank of the mesh (the default group, which the mesh holds whole: the
    primary partition, flat), with ``comm``'s group, the node, as ``secondary`` (where the
    backward's gathers stay: zero/stage3/secondary.py). No collective."""
    world = Comm(None)
    world.mesh_ranks, world.mesh_dim_names = comm.mesh_ranks, comm.mesh_dim_names
    world.secondary = Comm(comm.group)
    return world


@dataclass(frozen=True)
class MeshInfo:
    """Where a rank's data-parallel peers are, typed (as FSDP2's ``FSDPMeshInfo`` /
    ``HSDPMeshInfo``): ``shard``, the group its state and, at stage 3, its parameters are
    split over, and on a 2-D mesh ``replicate``, the group of the R ranks holding the same
    shard (None on a flat group). The communication parts (parts.py) are chosen from it once;
    nothing else asks a Comm whether it is part of a mesh."""

    shard: Comm
    replicate: Comm | None = None

    @classmethod
    def of(cls, comm: Comm) -> MeshInfo:
        """The mesh ``comm`` is the shard group of (``comm_of_mesh`` set its replicate group;
        a Comm of a process group has none)."""
        return cls(comm, comm.replicate)

    @property
    def hybrid(self) -> bool:
        """A 2-D mesh: gradients are summed across the replicate group too."""
        return self.replicate is not None

    @property
    def replicas(self) -> int:
        """R, the replicate group's size (1 on a flat group)."""
        return 1 if self.replicate is None else self.replicate.world_size

    @property
    def dp_size(self) -> int:
        """S * R: every rank whose gradient goes into one average."""
        return self.shard.world_size * self.replicas


def check_same_mesh(mesh: Any, comm: Comm, where: str = "ZeroAdamW(stage=3)") -> None:
    """Stage 3: the optimizer's ``mesh``, if given, must be the one the model was sharded
    over (shard_model(mesh=)), whose Comm it uses."""
    if mesh is None:
        return
    ranks = getattr(getattr(mesh, "mesh", None), "tolist", lambda: None)()
    if ranks is not None and getattr(mesh, "ndim", 0) == 1:
        ranks = [ranks]
    if ranks != comm.mesh_ranks:
        raise ValueError(
            f"{where}: mesh {ranks} is not the one the model was sharded over "
            f"({comm.mesh_ranks if comm.mesh_ranks is not None else 'a flat process group'}); "
            "pass the same mesh to shard_model, or none here (the model's is used)")
