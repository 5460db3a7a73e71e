"""What the trainer integrations share about zerokern's options, so that none of them lists
the options itself:

- one ``ZeroConfig`` from ``config=`` and the option keywords, whose names are
  ``ZeroConfig.names()`` (every option is a keyword of every integration), validated at once,
  when the integration is constructed, before the model is touched;
- the mesh: a ``DeviceMesh``, or its shape, built once the process group exists (Lightning
  builds the strategy before it starts the processes, so no mesh can exist yet);
- the check that a ZeroAdamW built elsewhere (by ``configure_optimizers``, or given to the
  HF Trainer) has the options the integration was given.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from ..zero import ZeroOptimizer
from ..zero.config import ZeroConfig


def pop_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the option keywords (``ZeroConfig.names()``) from ``kwargs`` and return them."""
    return {name: kwargs.pop(name) for name in ZeroConfig.names() if name in kwargs}


def config_of(config: ZeroConfig | None, options: dict[str, Any], where: str) -> ZeroConfig:
    """The validated config of ``config=`` and the option keywords ``options`` (an option
    given both ways is refused, as by ZeroAdamW and ``parallelize``)."""
    return ZeroConfig.merge(config, options, where).validate()


def check_mesh_arg(mesh: Any, where: str) -> None:
    """``mesh`` is None, a DeviceMesh, or the shape of one: ``(shard,)`` or ``(replicate,
    shard)`` (positive ints). Refused at once (the mesh itself is checked when it is used)."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None or isinstance(mesh, DeviceMesh):
        return
    if not (isinstance(mesh, (tuple, list)) and len(mesh) in (1, 2)
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in mesh)):
        raise TypeError(
            f"{where}: mesh must be a torch.distributed.device_mesh.DeviceMesh or its shape, "
            f"(replicate, shard) or (shard,) as positive ints, got {mesh!r}")


def build_mesh(mesh: Any, device_type: str, where: str) -> Any:
    """The DeviceMesh of ``mesh`` (checked by ``check_mesh_arg``): a given one as it is, a
    shape built over the default process group (dims named ``replicate`` and ``shard``).
    A collective for a shape: call it on every rank."""
    if mesh is None or not isinstance(mesh, (tuple, list)):
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if math.prod(mesh) != world:
        raise ValueError(f"{where}: mesh {tuple(mesh)} has {math.prod(mesh)} ranks but the "
                         f"world has {world}: its dims must multiply to the world size")
    names = ("replicate", "shard") if len(mesh) == 2 else ("shard",)
    return init_device_mesh(device_type, tuple(mesh), mesh_dim_names=names)


def mesh_ranks(mesh: Any) -> list[list[int]] | None:
    """A mesh's global ranks as a Comm records them (``Comm.mesh_ranks``; None: no mesh)."""
    if mesh is None:
        return None
    ranks = mesh.mesh.tolist()
    return ranks if mesh.ndim == 2 else [ranks]


def check_optimizer(opt: ZeroOptimizer, config: ZeroConfig, mesh: Any, where: str,
                    what: str) -> None:
    """A ZeroAdamW (or ZeroOptimizer) built elsewhere (``what``) must have every option of
    ``config`` that is not at its default (the stage is compared by the caller), and be over
    ``mesh`` if one was given. The options left at their defaults are the optimizer's own
    (as before there was a config: ``ZeroAdamW(loss_scale="dynamic")`` in
    ``configure_optimizers``). The stage-3 model options are not compared: the integration
    applied them to the model itself."""
    default = ZeroConfig()
    for name in ZeroConfig.adamw_names():
        want, have = getattr(config, name), getattr(opt.config, name)
        if name != "stage" and want != getattr(default, name) and want != have:
            raise ValueError(
                f"{where}: {name}={want!r} was given, but {what} has {name}={have!r}; build "
                f"it with the same options (e.g. config=<the integration>.config)")
    if mesh is not None and mesh_ranks(mesh) != getattr(opt.comm, "mesh_ranks", None):
        raise ValueError(
            f"{where}: mesh {mesh_ranks(mesh)} was given, but {what} runs over "
            f"{opt.comm.mesh_ranks or 'a flat process group'}; build it with mesh= the same "
            "mesh")
