"""shard_model: partition a model's parameters for ZeRO stage 3 (the facade of the stage3
package), and full_state_dict: gather the full parameters one unit at a time."""

from __future__ import annotations

import gc
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..comm import Comm
from ..comm.mesh import hpz_comm, mesh_comm
from ..comm.quantized_parts import WireFormat
from . import gather_timeout as told
from . import registry
from .config import check_hpz
from .interop import check_no_ddp, optimizer_of
from .stage3 import Stage3Runtime, foreign
from .stage3.build import split_by_dtype
from .validate import check_quantized_comm

# Default unit size when no unit classes are given: a module becomes a unit when it holds at
# least this share of the model's parameters (typically the transformer blocks).
_DEFAULT_UNIT_SHARE = 0.02


def _default_units(model: nn.Module) -> list[nn.Module]:
    total = sum(p.numel() for p in model.parameters())
    threshold = max(1, int(total * _DEFAULT_UNIT_SHARE))
    chosen: list[nn.Module] = []

    def visit(mod: nn.Module) -> None:
        for child in mod.children():
            n = sum(p.numel() for p in child.parameters())
            if isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
                visit(child)  # containers are never called as a whole: look inside
            elif n >= threshold and n < total:
                chosen.append(child)

    visit(model)
    return chosen


def _outermost(model: nn.Module, classes: tuple[type, ...]) -> list[nn.Module]:
    out: list[nn.Module] = []

    def visit(mod: nn.Module) -> None:
        for child in mod.children():
            if isinstance(child, classes):
                out.append(child)
            else:
                visit(child)

    visit(model)
    return out


def shard_model(
    model: nn.Module,
    *,
    process_group: Any = None,
    unit_classes: tuple[type, ...] | list[type] | None = None,
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    offload_params: bool = False,
    gather_timeout: float | None = None,
    mesh: Any = None,
    hpz: bool = False,
    gather_dtype: str | None = None,
) -> nn.Module:
    """Partition ``model``'s parameters in place for ZeRO stage 3 and return it.

    Every module of ``unit_classes`` (outermost matches) is a unit, and the root keeps the
    parameters left over, including parameters shared between units (tied embeddings). Each
    rank stores 1/N of every unit; a unit is all-gathered before its forward and its backward
    and released afterwards; gradients are reduce-scattered as soon as its backward is done.
    Use with ``ZeroAdamW(model.parameters(), stage=3)``.

    Parameters of several dtypes (a bf16 embedding beside fp32 matrices): one flat buffer
    per dtype, each with its own slices, gather arena and collectives; a unit holding several
    dtypes is gathered and reduced as one unit per dtype. The parameters share one device.
    Refused with ``offload_params``, ``hpz`` and ``gather_dtype`` (not built for several).

    ``offload_params=True`` (ZeRO-Infinity's ``offload_param``): each rank's parameter slice
    lives in host memory (pinned on CUDA) between uses and is copied to the device just
    before its unit's all-gather (prefetched units with the unit before them). Use with
    ``ZeroAdamW(..., stage=3, offload="cpu")``.

    ``gather_timeout`` (seconds; default ``$ZEROKERN_GATHER_TIMEOUT``, else 300): the longest
    a rank waits in one unit's gather or gradient reduce-scatter for the other ranks before it
    raises CollectiveTimeout naming the unit and the likely cause (a forward or state_dict
    run on some ranks only, e.g. evaluation under ``if rank == 0``). It bounds each wait, not
    the step. ``math.inf``: no bound of zerokern's own. On NCCL it applies only when given
    (here or in the environment): a bounded wait blocks the host until the gather is done.

    ``mesh`` (instead of ``process_group``): a ``torch.distributed.device_mesh.DeviceMesh``.
    2-D, hybrid sharding (FSDP2's HSDP convention: dim 0 replicate, dim 1 shard): each unit
    is split over the S ranks of this rank's shard group and gathered within it; gradients
    are reduce-scattered within it, then all-reduced across the R ranks of the replicate
    group and averaged over all S * R. Every replica starts from global rank 0's values. A
    1-D mesh is its group. Build the optimizer with ``ZeroAdamW(..., stage=3)`` (it takes
    this mesh). A wrong mesh raises ValueError naming ``mesh`` on every rank, before
    anything changes.

    ``hpz=True`` (with a 2-D ``mesh`` of R nodes of S ranks; ZeRO++'s hpZ): each unit is
    split over all R * S ranks instead (its slices, gradients and optimizer state 1/(R S) per
    rank, as on a flat group of every rank), and the forward's gathers cross the nodes; each
    rank then keeps its node's share of every gathered unit (1/S of it, in the parameters'
    dtype), and the unit's gathers until the next forward (its backward) are all-gathers of
    those shares within the node. The result is bitwise that of a flat group of all R * S
    ranks; the shares cost 1/S of the parameters' bytes per rank
    (``memory_stats()["hpz_secondary"]``). Refused without a 2-D mesh and with
    ``offload_params``.

    ``gather_dtype="int8"`` (ZeRO++'s qwZ): the units' gathers travel as int8 codes from now
    on, forward and backward, before any optimizer exists (inference); a ZeroAdamW built on
    the model without a ``gather_dtype`` of its own keeps it
    (docs/reference/quantized-comm.md). Refused with ``offload_params``.
    """
    if not isinstance(offload_params, bool):
        raise TypeError(f"offload_params must be True or False, got {offload_params!r}")
    if not isinstance(hpz, bool):
        raise TypeError(f"hpz must be True or False, got {hpz!r}")
    comm = mesh_comm(mesh, process_group, where="shard_model")
    # Every rank selects its units, then all compare (or learn of a rank's error) before
    # anything is modified: a check that failed on one rank alone would leave the others
    # waiting in the first per-unit broadcast until the process-group timeout.
    timeout = (told.DEFAULT_S, False)
    try:
        timeout = told.resolve(gather_timeout)
        units, names, params = _select_units(model, unit_classes, prefetch)
        _check_hpz(hpz, comm, offload_params)
        _check_gather_dtype(gather_dtype, offload_params)
        _check_mixed(params, offload_params, hpz, gather_dtype)
        failure: BaseException | None = None
    except (ValueError, TypeError, RuntimeError) as exc:
        units, names, params, failure = [], {}, [], exc
    _check_units_same_on_all_ranks(comm, units, names, prefetch, reshard_after_forward,
                                   failure, offload_params, hpz, gather_dtype)
    if hpz:  # agreed on every rank: the primary partition spans the whole mesh
        comm = hpz_comm(comm)
    # Several dtypes: one runtime per dtype (split_by_dtype), each a whole stage-3 runtime
    # over its own flat slices; the first's saved-tensor hooks serve them all.
    rts = [Stage3Runtime(
        model, us, comm, prefetch=prefetch, reshard_after_forward=reshard_after_forward,
        offload_params=offload_params, gather_timeout=timeout,
    ) for us in split_by_dtype(units)]
    for rt in rts:
        rt.param_names = {id(p): names[id(p)] for p in params}
        rt.join(rts)
        if gather_dtype is not None:  # the model's own wire, until an optimizer asks otherwise
            rt.gather_bits = WireFormat.of(None, gather_dtype).gather_bits
            rt.ctx.set_wire(WireFormat(gather_bits=rt.gather_bits))
        rt.shard_parameters()
        rt.install_hooks()
    _refuse_pickling(model, params)
    # Lets ZeroAdamW(stage=3) find the runtime from model.parameters() (each parameter its
    # dtype's), and checkpoints and full_state_dict from the model (the first's: its siblings).
    registry.register(model, [], rts[0])
    for rt in rts:
        registry.register_params([p for u in rt.units for p in u.params], rt)
    model.register_state_dict_post_hook(_state_dict_hook)
    model.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    model.register_load_state_dict_post_hook(_load_state_dict_post_hook)
    foreign.install()  # another optimizer's step over these parameters is refused
    return model


class _RefusePickle:
    """Stands in for ``__reduce_ex__`` on a stage-3 model and its parameters (an instance
    attribute, which pickle and copy look up before the class's method). Outside a forward a
    parameter holds no values on this rank (its slice lives in the unit's shard), so pickling
    it would store placeholders and a pickled model would carry the runtime: refused, with
    what to save instead."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, protocol: int) -> Any:
        raise RuntimeError(
            f"torch.save / pickle / copy of {self.what} sharded by zerokern.shard_model "
            "(ZeRO stage 3): outside a forward each rank holds only its slice, so the saved "
            "object would hold no values. Save model.state_dict() instead (the full "
            "parameters; a collective: call it on every rank, torch.save on rank 0), or "
            "zerokern.full_state_dict(model), or a zerokern checkpoint (save_checkpoint)")


def _refuse_pickling(model: nn.Module, params: list[nn.Parameter]) -> None:
    object.__setattr__(model, "__reduce_ex__", _RefusePickle(f"the model ({type(model).__name__})"))
    for p in params:
        p.__reduce_ex__ = _RefusePickle("a parameter")  # type: ignore[method-assign]


def _check_gather_dtype(gather_dtype: Any, offload_params: bool) -> None:
    """The spellings ZeroAdamW takes; not with parameter slices in host memory (the offload
    pipeline moves parameters in their own dtype)."""
    check_quantized_comm(None, gather_dtype, 3, None, "fp32")
    if gather_dtype is not None and offload_params:
        raise ValueError(f"gather_dtype={gather_dtype!r} with offload_params=True is not built: "
                         "the offload pipeline moves parameters in their own dtype; drop one "
                         "of them")


def _check_hpz(hpz: bool, comm: Comm, offload_params: bool) -> None:
    """hpZ needs nodes to keep a secondary copy in: a 2-D mesh."""
    if not hpz:
        return
    check_hpz(hpz, 3, offload_params)
    if comm.replicate is None:
        raise ValueError(
            "hpz=True needs a 2-D mesh (mesh=init_device_mesh(device, (nodes, ranks_per_node))): "
            "hpZ splits the parameters over every rank and keeps a secondary copy within each "
            "node (mesh dim 1) for the backward's gathers; a flat group has no node to keep it "
            "in")


def _check_mixed(params: list[nn.Parameter], offload_params: bool, hpz: bool,
                 gather_dtype: str | None) -> None:
    """Parameters of several dtypes take one runtime each (split_by_dtype); the options that
    share one pipeline or in-node copy across the model are not built for that yet."""
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) < 2:
        return
    for name, on in (("offload_params=True", offload_params), ("hpz=True", hpz),
                     (f"gather_dtype={gather_dtype!r}", gather_dtype is not None)):
        if on:
            raise ValueError(f"{name} with parameters of several dtypes ({', '.join(dtypes)}) "
                             "is not built; cast the model to one dtype, or drop the option")


def _select_units(
    model: nn.Module, unit_classes: tuple[type, ...] | list[type] | None, prefetch: int,
) -> tuple[list[tuple[str, nn.Module, list[nn.Parameter]]], dict[int, str], list[nn.Parameter]]:
    """Validate the arguments and pick the units (pure: nothing is modified)."""
    if registry.runtime_of_module(model) is not None:
        raise RuntimeError(
            "shard_model: this model is already sharded (shard_model was called "
            "twice); call it once, right after building the model"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if unit_classes is None:
        unit_modules = _default_units(model)
    else:
        if isinstance(unit_classes, type):  # tuple() of a class alone: "not iterable"
            name = unit_classes.__name__
            raise TypeError(f"unit_classes must be a tuple of module classes, got the class "
                            f"{name} alone: write unit_classes=({name},)")
        classes = tuple(unit_classes)
        if not classes or not all(isinstance(c, type) for c in classes):
            raise TypeError(f"unit_classes must be a tuple of module classes, got {unit_classes!r}")
        unit_modules = _outermost(model, classes)
        if not unit_modules:
            names = ", ".join(c.__name__ for c in classes)
            raise ValueError(
                f"unit_classes ({names}) match no submodule of "
                f"{type(model).__name__}; pass the class of its repeated blocks"
            )
    params = list(model.parameters())
    if not params:
        raise ValueError("model: it has no parameters to shard")
    check_no_ddp(params, "shard_model")
    names = {id(p): n for n, p in model.named_parameters()}
    if any(optimizer_of(p) is not None for p in params):
        # A deleted optimizer lives on until the collector breaks its reference cycles: only
        # a live one refuses.
        gc.collect()
    for p in params:
        trained_by = optimizer_of(p)
        if trained_by is not None:
            # Its flat buffers hold the parameters as they are now: partitioned under it, the
            # model would train silently wrong (the step updates the optimizer's own copy).
            raise RuntimeError(
                f"shard_model: parameter {names.get(id(p), '?')!r} is already trained by a "
                f"{type(trained_by).__name__} (stage {trained_by.stage}) built before "
                "shard_model. Partition the model first, then build the optimizer with "
                "stage=3: zerokern.parallelize(model, stage=3, unit_classes=..., ...) does both "
                "in that order")
    if any(p.is_meta for p in params):
        # Deferred initialisation: there are no values to broadcast and slice yet.
        raise ValueError("model: its parameters are on the meta device and hold no values; "
                         "materialise the model first: model.to_empty(device=...) and "
                         "initialise its parameters (e.g. reset_parameters() or "
                         "load_state_dict), then shard it")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"model: all parameters must share one device, found {devices}: "
                         f"stage 3 keeps one device per model; move the model first")
    # Owner of every parameter: the unit whose subtree registers it; shared ones go to the root.
    owner_of_module: dict[int, int] = {}
    for ui, um in enumerate(unit_modules):
        for m in um.modules():
            owner_of_module[id(m)] = ui
    owners: dict[int, set[int]] = {}
    names: dict[int, str] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), set()).add(owner_of_module.get(id(m), -1))
            names.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
    by_id = {id(p): p for p in params}
    unit_params: list[list[nn.Parameter]] = [[] for _ in unit_modules]
    root_params: list[nn.Parameter] = []
    for pid, p in by_id.items():
        o = owners[pid]
        if len(o) == 1 and -1 not in o:
            unit_params[next(iter(o))].append(p)
        else:
            root_params.append(p)
    units: list[tuple[str, nn.Module, list[nn.Parameter]]] = []
    module_names = {id(m): n for n, m in model.named_modules()}
    for um, ps in zip(unit_modules, unit_params):
        if ps:
            units.append((module_names.get(id(um), type(um).__name__), um, ps))
    units.append(("<root>", model, root_params))
    return units, names, params


def _check_units_same_on_all_ranks(
    comm: Comm, units: list[tuple[str, nn.Module, list[nn.Parameter]]], names: dict[int, str],
    prefetch: int, reshard_after_forward: bool, failure: BaseException | None = None,
    offload_params: bool = False, hpz: bool = False, gather_dtype: str | None = None,
) -> None:
    """Raise on every rank, before anything is modified, when a rank's arguments were
    refused (``failure``) or the ranks would partition different models: otherwise the
    first per-unit broadcast would wait on mismatched sizes until the process-group timeout
    (30 minutes by default)."""
    sig = {
        "error": None if failure is None else f"{type(failure).__name__}: {failure}",
        "options": (prefetch, reshard_after_forward, offload_params, hpz, gather_dtype),
        "units": [(uname, [(names[id(p)], tuple(p.shape), str(p.dtype)) for p in ps])
                  for uname, _, ps in units],
    }
    sigs = comm.all_gather_object_all(sig, "shard_model unit signatures")
    if failure is not None:
        raise failure
    for r, other in enumerate(sigs):
        if other["error"] is not None:
            raise ValueError(f"shard_model failed on rank {r}: {other['error']}")
    ref = sigs[0]
    for r, other in enumerate(sigs):
        if other == ref:
            continue
        if other["options"] != ref["options"]:
            raise ValueError(
                f"shard_model arguments differ across ranks: (prefetch, reshard_after_forward, "
                f"offload_params, hpz, gather_dtype) is {ref['options']} on rank 0 but "
                f"{other['options']} on rank {r}")
        a, b = ref["units"], other["units"]
        if len(a) != len(b):
            raise ValueError(
                f"shard_model: the model differs across ranks: rank 0 has {len(a) - 1} units "
                f"with parameters, rank {r} has {len(b) - 1}; build the same model on every rank")
        for (na, pa), (nb, pb) in zip(a, b):
            if (na, pa) != (nb, pb):
                detail = next(((x, y) for x, y in zip(pa, pb) if x != y), None)
                if detail is not None:
                    (a0, a1, a2), (b0, b1, b2) = detail
                    what = f"parameter {a0} {a1} {a2} on rank 0 but {b0} {b1} {b2} on rank {r}"
                elif len(pa) != len(pb):
                    what = f"{len(pa)} parameters on rank 0, {len(pb)} on rank {r}"
                else:
                    what = "the unit's module path differs"
                raise ValueError(
                    f"shard_model: the model differs across ranks in unit {na!r} "
                    f"(rank {r}: {nb!r}): {what}; build the same model on every rank")


def _state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """model.state_dict() of a sharded model holds the full parameters, gathered one unit at a
    time. Collective: every rank must call it (as with FSDP's full state dict). Only the
    entries torch put in are replaced, so the keys and their order are the plain model's
    (non-persistent buffers, such as rotary tables, stay out: a strict load_state_dict of
    the result works on the plain model and on the sharded one)."""
    rt = registry.runtime_of_module(module)
    assert rt is not None  # the hook is registered by shard_model only
    values = {k: v for r in rt.siblings for k, v in _gather_params(r, keep=True).items()}
    for name, p in module.named_parameters(remove_duplicate=False):  # tied names too
        if prefix + name in state_dict:
            state_dict[prefix + name] = values[id(p)]
    for name, b in module.named_buffers(remove_duplicate=False):
        if prefix + name in state_dict:
            state_dict[prefix + name] = b.detach().cpu().clone()


def _load_state_dict_pre_hook(
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing: list,
    unexpected: list,
    errors: list,
) -> None:
    """model.load_state_dict(full) of a sharded model: each rank copies its slice of every unit;
    the entries are then taken out, since a released parameter cannot be copied into (the
    post hook below keeps them from being reported missing). Load the model before building
    the optimizer (or restore the optimizer's state dict after), since the optimizer keeps
    its own fp32 master."""
    rt = registry.runtime_of_module(module)
    assert rt is not None  # the hook is registered by shard_model only
    given = {n: state_dict[prefix + n] for n, p in module.named_parameters(remove_duplicate=False)
             if prefix + n in state_dict}
    # A tied parameter has several names, and a state dict may hold only one of them (HF's
    # save_pretrained drops the tied lm_head.weight): any name given loads it.
    value_of: dict[int, torch.Tensor] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if n in given:
            value_of.setdefault(id(p), given[n])
    if any(tuple(t.shape) != tuple(registry.runtime_of_param(p).shape_of(p)) for n, p in
           module.named_parameters(remove_duplicate=False) if (t := given.get(n)) is not None):
        _TAKEN[module] = set()
        return  # nothing copied: load_state_dict reports the size mismatch
    if rt.ctx.secondary is not None:  # hpZ: the in-node shares no longer match the slices
        rt.ctx.secondary.drop()
    with torch.no_grad():
        for r in rt.siblings:  # several dtypes: each runtime its own slices
            for u in r.units:
                for sp in u.plan.rank_pieces(r.comm.rank):
                    p = u.params[sp.param_index]
                    full = value_of.get(id(p))
                    if full is None:
                        continue  # load_state_dict reports it as missing
                    r.local_params.narrow(0, u.shard_start + sp.local_offset, sp.numel).copy_(
                        full.reshape(-1)[sp.param_offset : sp.param_offset + sp.numel]
                    )
    taken = set()
    for n in given:
        del state_dict[prefix + n]
        taken.add(prefix + n)
    _TAKEN[module] = taken


# Parameter keys the pre hook loaded itself, per model, for the post hook of the same call.
_TAKEN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _load_state_dict_post_hook(module: nn.Module, incompatible: Any) -> None:
    taken = _TAKEN.pop(module, set())
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in taken]


def runtime_of(model: Any) -> Stage3Runtime | None:
    """The stage-3 runtime of a model partitioned by shard_model (None otherwise)."""
    return registry.runtime_of_module(model)


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> OrderedDict[str, torch.Tensor]:
    """The full (unsharded) parameters and buffers of a shard_model'ed model, on CPU: the
    keys, in their order, of the plain model's ``state_dict()`` (persistent buffers only).

    Call on every rank: units are gathered one at a time (never more than one extra unit in
    memory). With rank0_only, other ranks receive an empty dict.
    """
    rt = runtime_of(model)
    if rt is None:
        return OrderedDict((k, v.detach().cpu().clone()) for k, v in model.state_dict().items())
    if rank0_only and rt.comm.rank != 0:
        for r in rt.siblings:
            _gather_params(r, keep=False)  # the others' gathers need this rank's slices
        return OrderedDict()
    # state_dict's hook (above) gathers the parameters into torch's own dict.
    return OrderedDict(model.state_dict())


def _gather_params(rt: Stage3Runtime, *, keep: bool) -> dict[int, torch.Tensor]:
    """Every parameter's full value on CPU, by id (none kept unless ``keep``), gathered one
    unit at a time; units gathered already (inside a forward) stay gathered."""
    values: dict[int, torch.Tensor] = {}
    # Exact gathers even with gather_dtype="int8": the values saved or exported are the
    # parameters', never their int8 decoding (units gathered already keep what they hold).
    with torch.no_grad(), rt.ctx.exact_gathers():
        for u in rt.units:
            was = u.gathered
            rt.gather(u)
            if keep:
                for p in u.params:
                    values[id(p)] = p.detach().cpu().clone()
            if not was:
                rt.release(u)
    return values
