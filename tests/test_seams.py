"""The seams between zerokern's parts, checked from the source and from behaviour:

* the stages (zero/stages/) and stage 3's units (zero/stage3/) call no collective: they go
  through the communication parts (comm/parts.py);
* zerokern/zero has no import cycle among its module-level imports;
* the cross-replica sum of a 2-D mesh is issued asynchronously and waited only after the next
  bucket's (or unit's) reduce-scatter was issued, and the averages are the synchronous ones;
* a stage-3 unit moves only along its tables (states.py): a training step's paths pass, and
  reduce() goes GATHERED -> REDUCING; an illegal move raises naming both states.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest
import torch

import zerokern
from zerokern.comm import Comm
from zerokern.zero.layout import build_layout
from zerokern.zero.stage3 import GradPhase, IllegalTransition, Stage3Runtime, UnitState
from zerokern.zero.stage3 import states as unit_states
from zerokern.zero.stage3 import unit as unit_mod
from zerokern.zero.stages import Stage2

PKG = pathlib.Path(zerokern.__file__).parent
COLLECTIVES = {"reduce_scatter", "all_gather", "all_reduce", "broadcast", "all_to_all",
               "all_to_all_uneven",
               "replicate_all_reduce", "broadcast_all", "all_gather_object",
               "all_gather_object_all", "barrier", "reduce_scatter_tensor",
               "all_gather_into_tensor", "all_to_all_single", "isend", "irecv", "send", "recv"}


# -- no collective in the stages ---------------------------------------------------------------
def _collective_calls(path: pathlib.Path) -> list[str]:
    """Calls of a collective method, and any use of torch.distributed, in one file."""
    tree = ast.parse(path.read_text(), str(path))
    dist_names = {"torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.distributed"):
                    dist_names.add(a.asname or a.name)
                    found.append(f"{path.name}:{node.lineno} imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torch.distributed"):
            found.append(f"{path.name}:{node.lineno} imports from {node.module}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in COLLECTIVES:
                found.append(f"{path.name}:{node.lineno} calls .{node.func.attr}")
            elif ast.unparse(node.func.value) in dist_names:
                found.append(f"{path.name}:{node.lineno} calls {ast.unparse(node.func)}")
    return found


def test_the_checker_sees_a_collective(tmp_path):
    f = tmp_path / "stage.py"
    f.write_text("import torch.distributed as dist\nself.comm.reduce_scatter(a, b)\n"
                 "dist.new_group()\nself.grad_comm.reduce(a, b)\n")
    assert _collective_calls(f) == ["stage.py:1 imports torch.distributed",
                                    "stage.py:2 calls .reduce_scatter",
                                    "stage.py:3 calls dist.new_group"]


@pytest.mark.parametrize("package", ["stages", "stage3"])
def test_stages_and_units_call_no_collective(package):
    files = sorted((PKG / "zero" / package).glob("*.py"))
    assert files
    found = [hit for f in files for hit in _collective_calls(f)]
    assert found == [], "collectives belong in zerokern/comm/parts.py: " + "; ".join(found)


def test_muon_step_calls_no_collective():
    # Muon's engine step moves its matrices through zerokern/comm (owner_exchange.py,
    # shard_exchange.py), as the stages do through the communication parts.
    found = _collective_calls(PKG / "zero" / "muon_step.py")
    assert found == [], "collectives belong in zerokern/comm: " + "; ".join(found)


# -- no import cycle ---------------------------------------------------------------------------
def _modules(root: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _runtime_imports(body: list[ast.stmt]):
    """The import statements run when the module is imported: at module level, in if/try/with
    blocks, but not under ``if TYPE_CHECKING:`` (never run) nor inside functions or classes
    (run when called, after every module finished importing)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from _runtime_imports(node.body)
            yield from _runtime_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *[h.body for h in node.handlers]):
                yield from _runtime_imports(block)
        elif isinstance(node, ast.With):
            yield from _runtime_imports(node.body)


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the package its import runs. Importing ``a.b.c`` also runs the
    ``__init__`` of ``a.b`` (unless it is a package the importer is itself in: that one is
    importing already); ``from p import x`` needs ``p`` itself unless every ``x`` is a
    submodule of a package the importer is in."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        here = name if is_pkg else name.rpartition(".")[0]
        mine = _ancestors(name)
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods}
            targets |= subs
            if len(subs) < len(node.names) or mod not in mine:
                targets.add(mod)
        deps = set()
        for t in targets:
            deps |= {t} | (_ancestors(t) - mine)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles: strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_the_cycle_finder_finds_a_cycle_through_a_package_init(tmp_path):
    pkg = tmp_path / "p"
    for d in ("a", "b"):
        (pkg / d).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from ..b.x import X\n")  # a needs b.x
    (pkg / "a" / "y.py").write_text("Y = 1\n")
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "b" / "x.py").write_text("from ..a.y import Y\nX = Y\n")  # runs a/__init__ first
    (pkg / "b" / "z.py").write_text("from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    from ..a import y\n"
                                    "def f():\n    from ..a import y\n")
    g = import_graph(pkg)
    assert strongly_connected(g) == [["p.a", "p.b.x"]]
    assert g["p.b.z"] == set()  # TYPE_CHECKING and function-level imports do not count


def test_zero_has_no_import_cycle():
    cycles = strongly_connected(import_graph(PKG / "zero"))
    assert cycles == [], f"import cycles in zerokern/zero: {cycles}"


# -- the cross-replica sum runs asynchronously -------------------------------------------------
class _Handle:
    def __init__(self, log: list, what: tuple) -> None:
        self.log, self.what = log, what

    def wait(self, timeout: float | None = None) -> bool:
        self.log.append(("wait", *self.what))
        return True


class Peers:
    """N identical ranks of one group: a sum over them is N x this rank's value (exact for
    small integers); records every collective (issued, async or not) and every wait."""

    replicate = None
    scratch_peak = 0

    def __init__(self, world: int, rank: int, log: list, name: str) -> None:
        self.world_size, self.rank, self.log, self.name = world, rank, log, name

    def in_place_scratch(self) -> bool:
        return False

    def _issued(self, op: str, label: str, async_op: bool) -> _Handle | None:
        what = (self.name, op, label)
        self.log.append(("issue", *what, async_op))
        return _Handle(self.log, what) if async_op else None

    def all_reduce(self, t, label="", *, async_op=False, **_):
        t.mul_(self.world_size)
        return self._issued("all_reduce", label, async_op)

    def reduce_scatter(self, out, inp, label="", async_op=False):
        out.copy_(inp.view(self.world_size, -1)[self.rank] * self.world_size)
        return self._issued("reduce_scatter", label, async_op)

    def all_gather(self, out, inp, label="", async_op=False, **_):
        out.view(self.world_size, -1)[self.rank].copy_(inp)
        return self._issued("all_gather", label, async_op)


def _pos(log: list, entry: tuple) -> int:
    return log.index(entry)


@pytest.mark.parametrize("backwards", [1, 2])
def test_stage2_sums_across_replicas_asynchronously_behind_the_next_bucket(backwards):
    numels = [5, 40, 3, 70, 9, 90, 17]
    S, R = 2, 3
    layout = build_layout([numels], stage=2, world_size=S, rank=1, bucket_numel=64)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in numels]
    log: list = []
    comm = Peers(S, 1, log, "shard")
    comm.replicate = Peers(R, 2, log, "replicate")
    eng = Stage2(layout, params, comm, dtype=torch.float32, device=torch.device("cpu"),
                 overlap=True, backend="torch")
    total = [torch.zeros(n) for n in numels]
    for _ in range(backwards):
        for i in layout.ready_order:
            grad = torch.randint(-8, 9, (numels[i],), generator=g).float()
            total[i] += grad
            params[i].grad = grad.clone()
            eng.reducer.on_grad_ready(i, in_backward=False)
        eng.reducer.drain()
    eng.finish_grads()
    # The average over S * R identical ranks is the local total: divided once, exactly.
    for pc in layout.pieces:
        want = total[pc.param][pc.param_offset:pc.param_offset + pc.numel]
        assert torch.equal(eng.grad_shard.narrow(0, pc.local_start, pc.numel), want)
    labels = [eng.bucket_label(b) for b in range(len(layout.buckets))]
    assert len(labels) >= 3
    across = [e for e in log if e[0] == "issue" and e[1] == "replicate"]
    assert len(across) == backwards * len(labels)
    assert all(e[-1] is True for e in across)  # every one asynchronous
    first_round = log[:_pos(log, ("wait", "replicate", "all_reduce",
                                  f"{labels[-1]} across replicas"))]
    for b in range(len(labels) - 1):
        issued = _pos(first_round, ("issue", "replicate", "all_reduce",
                                    f"{labels[b]} across replicas", True))
        waited = _pos(first_round, ("wait", "replicate", "all_reduce",
                                    f"{labels[b]} across replicas"))
        # Issued once the bucket's reduce-scatter completed, waited only after the next
        # bucket's reduce-scatter was issued: it ran meanwhile.
        assert _pos(first_round, ("wait", "shard", "reduce_scatter", labels[b])) < issued
        next_rs = _pos(first_round, ("issue", "shard", "reduce_scatter", labels[b + 1], True))
        assert issued < waited and next_rs < waited


class _RecordingComm(Comm):
    """A world-size-1 Comm whose collectives hand back a handle, recording issue and wait."""

    def __init__(self, log: list, name: str) -> None:
        super().__init__()
        self.log, self.name = log, name

    def _h(self, op: str, label: str, async_op: bool):
        self.log.append(("issue", self.name, op, label, async_op))
        return _Handle(self.log, (self.name, op, label)) if async_op else None

    def all_gather(self, out, inp, label="shard", async_op=False, *, count=True):
        super().all_gather(out, inp, label, count=count)
        return self._h("all_gather", label, async_op)

    def reduce_scatter(self, out, inp, label="bucket", async_op=False):
        super().reduce_scatter(out, inp, label)
        return self._h("reduce_scatter", label, async_op)

    def all_reduce(self, t, label="tensor", *, count=True, op=None, async_op=False):
        return self._h("all_reduce", label, async_op)


class _Three(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))


def _runtime(log: list) -> Stage3Runtime:
    m = _Three()
    comm = _RecordingComm(log, "shard")
    comm.replicate = _RecordingComm(log, "replicate")
    units = [(n, getattr(m, n), list(getattr(m, n).parameters())) for n in "abc"]
    rt = Stage3Runtime(m, units, comm, prefetch=1, reshard_after_forward=True)
    rt.shard_parameters()
    rt.ctx.overlap = True
    return rt


def test_stage3_sums_across_replicas_asynchronously_behind_the_next_unit():
    log: list = []
    rt = _runtime(log)
    every = lambda p: True  # noqa: E731
    grads = {}
    for u in reversed(rt.units):  # the backward's order
        u.begin_backward(every)
        u.gather()
        for p in u.params:
            p.grad = torch.randn(p.shape)
            grads[id(p)] = p.grad.clone()
        u.reduce(every)
    rt.finish_reduce()
    for u in rt.units:
        for p, off, n in zip(u.params, u.plan.param_offsets, u.plan.numels):
            got = u.slice_of(rt.local_grads).narrow(0, off, n)
            assert torch.equal(got, grads[id(p)].reshape(-1))
    c, b, a = (f"gradients of unit {n}" for n in "cba")
    issued_c = _pos(log, ("issue", "replicate", "all_reduce", f"{c} across replicas", True))
    waited_c = _pos(log, ("wait", "replicate", "all_reduce", f"{c} across replicas"))
    assert _pos(log, ("wait", "shard", "reduce_scatter", c)) < issued_c
    # c's sum across replicas runs while b's reduce-scatter is issued (and a is gathered).
    assert issued_c < _pos(log, ("issue", "shard", "reduce_scatter", b, True)) < waited_c
    assert waited_c < _pos(log, ("issue", "shard", "reduce_scatter", a, True))
    assert rt.ctx.grad_comm.pending == 0


# -- the unit's state machine ------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_training_step_moves_units_only_along_their_tables(monkeypatch, checkpoint):
    from models import Block, TinyGPT, batch

    moves: list[tuple[str, str, str]] = []
    check = unit_states.check_move

    def recording(unit, now, to):
        check(unit, now, to)  # raises on a move outside the table
        moves.append((unit, now.name, to.name))

    monkeypatch.setattr(unit_mod, "check_move", recording)
    torch.manual_seed(0)
    model = zerokern.shard_model(TinyGPT(checkpoint=checkpoint), unit_classes=(Block,),
                                 prefetch=1)
    opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-2, stage=3)
    for step in range(2):
        for micro in range(2):  # a further backward of the same step: BACKWARD_AGAIN
            x, y = batch(step, micro)
            torch.nn.functional.cross_entropy(model(x, 1 if step else None), y).backward()
        opt.step()
        opt.zero_grad()
    pairs = {(a, b) for _, a, b in moves}
    storage = {(a.name, b.name) for a, b in unit_states.STORAGE_MOVES}
    phases = {(a.name, b.name) for a, b in unit_states.PHASE_MOVES}
    assert pairs <= storage | phases
    assert ("GATHERED", "REDUCING") in pairs  # reduce goes through the documented states
    assert ("REDUCING", "SHARDED") in pairs and ("REDUCED", "BACKWARD_AGAIN") in pairs
    assert ("SHARDED", "REDUCING") not in pairs  # never through SHARDED on the way


@pytest.mark.parametrize("now,to", [(UnitState.SHARDED, UnitState.GATHERED),
                                    (UnitState.GATHERING, UnitState.REDUCING),
                                    (UnitState.REDUCING, UnitState.GATHERED),
                                    (GradPhase.IDLE, GradPhase.REDUCED),
                                    (GradPhase.BACKWARD, GradPhase.BACKWARD_AGAIN)])
def test_an_illegal_move_raises_naming_both_states(now, to):
    log: list = []
    u = _runtime(log).units[0]
    with pytest.raises(IllegalTransition) as info:
        unit_states.check_move(u.name, now, to)
    msg = str(info.value)
    assert f"{type(now).__name__}.{now.name} -> {type(to).__name__}.{to.name}" in msg
    assert "'a'" in msg
    # and through the unit itself: nothing moves
    if isinstance(now, UnitState):
        u.state = now
        with pytest.raises(IllegalTransition, match=f"{now.name} -> UnitState.{to.name}"):
            u._move(to)
        assert u.state is now
