"""The optimizer state's surface of a ZeRO optimizer (``StateSurface``, a part of
``ZeroOptimizer``): ``shards()`` / ``edit_shards()``, the per-rank and torch-format state
dicts, and the statistics. Each method delegates to the parts core.py builds
(optimizer_state.py, interchange.py, rule_state.py, engine_slot.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..comm.collectives import comm_summary
from .interchange import is_torch_format
from .shards import ParamShard


class StateSurface:
    """The state and statistics methods (mixed into ``ZeroOptimizer`` before ``ZeroCore``)."""

    _table: Any
    _slot: Any
    _access: Any
    _interchange: Any
    _rule_state: Any
    _last_comm: Any
    param_groups: list[dict[str, Any]]
    scaler: Any
    rule: Any

    # -- optimizer state --------------------------------------------------------------------
    def shards(self, model: torch.nn.Module | None = None, *,
               ready_order: list[int] | None = None) -> list[ParamShard]:
        """Per managed parameter: its full shape, step count, and the element ranges this rank
        holds with writable fp32 views of their values and of the update rule's buffers
        (AdamW: ``exp_avg`` and ``exp_avg_sq``; a torch class: its per-element state).

        Names come from ``model`` (its ``named_parameters``) when given, else from named
        param groups (``ZeroAdamW(model.named_parameters())``) or the shard_model'ed model.
        Before the first step() of stages 0-2 this fixes the bucket layout (in
        ``ready_order``, indices of managed_params, default reverse registration order),
        as loading a state does."""
        return self._access.shards(self.param_groups, model, ready_order)

    @contextmanager
    def edit_shards(self, model: torch.nn.Module | None = None, *, gather: bool = True,
                    ready_order: list[int] | None = None) -> Iterator[list[ParamShard]]:
        """Write this rank's optimizer state: yields shards(); write into their views and
        assign their ``step``. On leaving, the steps are taken and the parameters take the
        new values (16-bit: rounded to nearest even). Call on every rank: with ``gather``
        (stages 1-2) the new parameters are all-gathered, a collective; ``gather=False``
        means the caller writes every rank's full parameters itself. If the block raises,
        the steps and parameters are left as they were (the views may be written)."""
        with self._access.edit(self.param_groups, model, gather, ready_order) as shards:
            yield shards

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (flat buffers in its local layout; a
        compressed state's buffers as stored, with its format and seed). Before the first
        step() nothing has been laid out or trained: as torch's AdamW, the state is empty
        ({}), and asking fixes nothing. A torch class's per-parameter scalars (NAdam's
        ``mu_product``) are under ``"scalars"``."""
        out = self._access.state_dict(self.param_groups, self.scaler)
        out["zerokern"]["rule"] = self.rule.name
        scalars = self._rule_state.state_dict()
        if scalars is not None and out["state"]:
            out["state"]["scalars"] = scalars
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's own ``state_dict()``, or a full state dict in the torch optimizer
        class's format (every rank passes the same one: from full_state_dict, any world size
        or stage, or a single-process run of the torch class; 16-bit parameters then take
        their fp32 master from the current parameters). A per-rank state dict loads only
        into the moments/master format
        that saved it (refused otherwise); a torch-format one is stored in this optimizer's
        format (int8: quantized on load), which is how a state changes format."""
        if is_torch_format(state_dict):
            self._interchange.load(state_dict, self.param_groups)
            return
        meta = state_dict.get("zerokern")
        saved = meta.get("rule", "adamw") if isinstance(meta, dict) else self.rule.name
        if saved != self.rule.name:
            raise ValueError(f"state_dict holds the state of the update rule {saved!r}; this "
                             f"optimizer steps {self.rule.name!r}")
        st = state_dict.get("state") or {}
        scalars = st.get("scalars") if isinstance(st, dict) else None
        if scalars is not None:
            st = {k: v for k, v in st.items() if k != "scalars"}
            state_dict = {**state_dict, "state": st}
        self._access.load(state_dict, self.param_groups, self.scaler)
        self._rule_state.load(scalars, "state_dict")

    def full_state_dict(self, *, rank0_only: bool = True,
                        cpu_offload: bool = True) -> dict[str, Any]:
        """This optimizer's whole state in its torch class's format (``ZeroAdamW``:
        torch.optim.AdamW's), on rank 0 (other ranks get ``{}``) or, with
        ``rank0_only=False``, on every rank; tensors on the CPU with ``cpu_offload``. A
        collective: call it on every rank. The moments are fp32 whatever
        the parameters' dtype (what AdamW holds for fp32 parameters; the fp32 master of
        16-bit parameters is not part of torch's format); compressed moments are dequantized
        and a top-level ``"state_format"`` entry names the format. For interchange and small
        models; at scale use save_checkpoint, where each rank writes its own part."""
        return self._interchange.save(self.param_groups, rank0_only=rank0_only,
                                      cpu_offload=cpu_offload)

    # -- introspection ----------------------------------------------------------------------
    def comm_stats(self) -> dict[str, Any]:
        """Collectives of the last completed step, counted as the paper counts (§7): every
        mesh dim together, and under ``per_dim`` the ``"shard"`` dim's (the whole group when
        flat) and the ``"replicate"`` dim's (zero when flat), each with ``elements``,
        ``bytes``, ``wire_elements`` (what each rank sends under bandwidth-optimal
        algorithms, (n-1)/n of the paper's count) and ``per_kind``: what
        ``zerokern.formulas.hybrid_comm_elements`` / ``hybrid_wire_elements`` /
        ``hybrid_comm_bytes`` give."""
        return comm_summary(self._last_comm, sum(sh.numel() for sh in self._table.shapes))

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by kind, from the arenas' accounting.
        Padding (bucket/shard rounding, and in stage 3 the optimizer slots of frozen
        parameters) is reported on its own. Before the first step() of stages 0-2 nothing
        is allocated yet: the numbers are those of the buffers the first step will allocate
        (laid out in reverse registration order), and nothing is fixed by asking.

        ``total`` (= ``device_total``) is what the device holds; ``host_total`` what host
        memory holds (0 without offload). With ``offload="cpu"`` the device kinds are the
        16-bit parameters and the gradient buffers (``master``, ``exp_avg``, ``exp_avg_sq``
        are 0), and the ``host_*`` keys give the host side: master and moments (KΨ/N), the
        gradient shard, the two staging slots, padding.

        Each kind is the bytes of the buffers as stored, so K follows the state format: 12
        for fp32 moments with an fp32 master, about 6 for ``moments="int8"`` and 2 with
        ``master="none"`` too. ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` are the int8
        blocks' scales and ``exp_avg_side`` / ``exp_avg_sq_side`` the fp32 moments of
        parameters too small to compress (docs/compressed-state.md).

        ``torch.optim.Muon`` adds its owner exchange's buffers, kept between steps and
        outside the arena, counted in ``total`` (zerokern.formulas
        ``muon_exchange_memory_bytes``): at stage 0 ``muon_grad_buffer`` (fp32 updates)
        and ``muon_param_buffer`` (their bfloat16 Newton-Schulz results), N S elements
        each; at stages 1-3 this rank's owned segment in each dtype
        (``muon_grad_segment``, ``muon_param_segment``) and the all-to-alls' buffers
        (``muon_send``, ``muon_recv``, ``muon_back_send``, ``muon_back_recv``), sized by
        what crosses ranks."""
        out = self._slot.memory_stats()
        extra = self._rule_state.memory_stats(self._slot.planned_layout(self.param_groups))
        if extra:
            out = {**out, **extra}
            for k in ("total", "device_total"):
                if k in out:
                    out[k] += sum(extra.values())
        return out
