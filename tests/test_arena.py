"""Contiguous arena (zerokern.memory.Arena, ZeRO paper §6.3) against an independent model.

Every test runs on both bookkeeping cores: the native zerokern._C.ArenaCore (skipped when the
native module is not built) and the pure-Python _PyArenaCore. To test a standalone build of
csrc/arena.cpp instead of zerokern._C, set ZEROKERN_TEST_ARENA_CORE to the name of an
importable module exposing ArenaCore (e.g. one built with `PYBIND11_MODULE(arena_test, m)
{ zk::bind_arena(m); }` on PYTHONPATH).
"""

from __future__ import annotations

import copy
import importlib
import os
import random
import threading

import pytest
import torch

import zerokern.memory.arena as arena_mod
from zerokern.memory import Arena, ArenaOutOfMemory, Block
from zerokern.memory._arena_py import _PyArenaCore

STAT_KEYS = {
    "capacity",
    "in_use",
    "peak_in_use",
    "live_blocks",
    "free_bytes",
    "largest_free",
    "fragmentation",
    "num_allocs",
    "num_frees",
}


def _native_core_cls():
    name = os.environ.get("ZEROKERN_TEST_ARENA_CORE")
    if name:
        return importlib.import_module(name).ArenaCore
    from zerokern._native import _C

    if _C is None:
        pytest.skip("native module zerokern._C is not built")
    if not hasattr(_C, "ArenaCore"):
        pytest.skip("zerokern._C was built without ArenaCore")
    return _C.ArenaCore


@pytest.fixture(params=["native", "python"])
def core_cls(request):
    return _native_core_cls() if request.param == "native" else _PyArenaCore


# ---------------------------------------------------------------------------------------------
# Independent model: live blocks as a sorted interval list; free runs are simply the gaps
# between them, so coalescing is implicit and any missed merge in a core shows up as a
# different best-fit choice or a smaller largest_free.
# ---------------------------------------------------------------------------------------------


class Model:
    def __init__(self, capacity: int, alignment: int) -> None:
        self.capacity = capacity
        self.alignment = alignment
        self.live: dict[int, int] = {}  # offset -> reserved bytes
        self.peak = 0
        self.num_allocs = 0
        self.num_frees = 0

    def reserved(self, nbytes: int) -> int:
        a = self.alignment
        return max(1, -(-nbytes // a)) * a

    @property
    def in_use(self) -> int:
        return sum(self.live.values())

    def gaps(self) -> list[tuple[int, int]]:
        out, cursor = [], 0
        for off in sorted(self.live):
            if off > cursor:
                out.append((cursor, off - cursor))
            cursor = off + self.live[off]
        if cursor < self.capacity:
            out.append((cursor, self.capacity - cursor))
        return out

    def best_fit(self, need: int) -> int | None:
        fits = [(size, off) for off, size in self.gaps() if size >= need]
        return min(fits)[1] if fits else None

    def alloc(self, nbytes: int) -> int | None:
        need = self.reserved(nbytes)
        off = self.best_fit(need)
        if off is None:
            return None
        for o, s in self.live.items():
            assert off + need <= o or o + s <= off, "model produced an overlap"
        self.live[off] = need
        self.peak = max(self.peak, self.in_use)
        self.num_allocs += 1
        return off

    def free(self, off: int) -> None:
        del self.live[off]
        self.num_frees += 1

    def compact(self) -> dict[int, int]:
        """old offset -> new offset after packing in address order."""
        moved, cursor = {}, 0
        for off in sorted(self.live):
            moved[off] = cursor
            cursor += self.live[off]
        self.live = {moved[o]: s for o, s in self.live.items()}
        return moved

    def stats(self) -> dict:
        free = self.capacity - self.in_use
        largest = max((s for _, s in self.gaps()), default=0)
        return {
            "capacity": self.capacity,
            "in_use": self.in_use,
            "peak_in_use": self.peak,
            "live_blocks": len(self.live),
            "free_bytes": free,
            "largest_free": largest,
            "fragmentation": 0.0 if free == 0 else 1.0 - largest / free,
            "num_allocs": self.num_allocs,
            "num_frees": self.num_frees,
        }


def _assert_stats(actual: dict, model: Model) -> None:
    assert set(actual) == STAT_KEYS
    expected = model.stats()
    frag = actual.pop("fragmentation")
    assert frag == pytest.approx(expected.pop("fragmentation"), abs=1e-12)
    assert actual == expected


def _rand_nbytes(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.08:
        return 0
    if r < 0.6:
        return rng.randrange(1, 300)
    if r < 0.92:
        return rng.randrange(300, 3000)
    return rng.randrange(3000, 12000)


# ---------------------------------------------------------------------------------------------
# Core level
# ---------------------------------------------------------------------------------------------


def _check_moves(moves, live_before: dict[int, int], live_after: dict[int, int]) -> None:
    dsts = [d for _, d, _ in moves]
    assert dsts == sorted(dsts)
    for i, (src, dst, n) in enumerate(moves):
        assert dst < src
        assert live_before[src] == n and live_after[dst] == n
        # No copy writes over the source of a block that has not been moved yet.
        for src2, _, n2 in moves[i + 1 :]:
            assert dst + n <= src2 or src2 + n2 <= dst


@pytest.mark.parametrize("seed,alignment", [(0, 64), (1, 256), (2, 1), (3, 16)])
def test_core_random_ops_match_model(core_cls, seed, alignment):
    rng = random.Random(seed)
    capacity = 1 << 16
    core = core_cls(capacity, alignment)
    model = Model(capacity, alignment)
    mem = bytearray(capacity)  # simulated buffer: executes the defragment plans
    pattern: dict[int, bytes] = {}  # offset -> bytes written at alloc
    saw_oom = saw_overlap_move = 0

    for _ in range(3000):
        r = rng.random()
        if r < 0.55 or not model.live:
            nbytes = _rand_nbytes(rng)
            expected = model.alloc(nbytes)
            if expected is None:
                before = (core.stats(), core.blocks())
                with pytest.raises(core_cls.OOMError) as info:
                    core.alloc(nbytes)
                assert isinstance(info.value, MemoryError)
                assert f"requested {nbytes} bytes" in str(info.value)
                assert (core.stats(), core.blocks()) == before
                saw_oom += 1
            else:
                off = core.alloc(nbytes)
                assert off == expected  # best fit, lowest offset among equal runs
                assert off % alignment == 0
                data = rng.randbytes(model.live[off])
                mem[off : off + len(data)] = data
                pattern[off] = data
        elif r < 0.95:
            off = rng.choice(sorted(model.live))
            core.free(off)
            model.free(off)
            del pattern[off]
        else:
            before = dict(model.live)
            moves = core.plan_defragment()
            remap = model.compact()
            assert moves == [(o, remap[o], before[o]) for o in sorted(before) if remap[o] != o]
            _check_moves(moves, before, model.live)
            for src, dst, n in moves:
                saw_overlap_move += src - dst < n
                mem[dst : dst + n] = mem[src : src + n]  # slice copy: memmove semantics
            pattern = {remap[o]: p for o, p in pattern.items()}
            for off, data in pattern.items():
                assert mem[off : off + len(data)] == data
            assert core.stats()["fragmentation"] == 0.0
        assert core.blocks() == sorted(model.live.items())
        _assert_stats(core.stats(), model)

    assert saw_oom > 0 and saw_overlap_move > 0  # the sequence exercised both paths

    for off in sorted(model.live):
        core.free(off)
        model.free(off)
    s = core.stats()
    assert s["largest_free"] == s["free_bytes"] == capacity  # coalesced into one run
    assert s["fragmentation"] == 0.0 and s["in_use"] == 0 and core.blocks() == []
    _assert_stats(s, model)
    assert core.alloc(capacity) == 0


def test_cores_agree_op_by_op():
    native = _native_core_cls()
    rng = random.Random(42)
    cores = [native(40_000, 128), _PyArenaCore(40_000, 128)]
    live: list[int] = []
    for _ in range(3000):
        r = rng.random()
        if r < 0.55 or not live:
            nbytes = _rand_nbytes(rng)
            results = []
            for c in cores:
                try:
                    results.append(c.alloc(nbytes))
                except c.OOMError as e:
                    results.append(("oom", str(e)))
            assert results[0] == results[1]
            if isinstance(results[0], int):
                live.append(results[0])
        elif r < 0.95:
            off = live.pop(rng.randrange(len(live)))
            for c in cores:
                c.free(off)
        else:
            plans = [c.plan_defragment() for c in cores]
            assert plans[0] == plans[1]
            remap = {s: d for s, d, _ in plans[0]}
            live = [remap.get(o, o) for o in live]
        assert cores[0].blocks() == cores[1].blocks()
        assert cores[0].stats() == cores[1].stats()


def test_core_validation_and_errors(core_cls):
    for bad in (0, 3, 48, -8):
        with pytest.raises(ValueError, match="power of two"):
            core_cls(1024, bad)
    with pytest.raises(ValueError):
        core_cls(-1, 64)
    core = core_cls(1024, 64)
    assert (core.capacity, core.alignment) == (1024, 64)
    with pytest.raises(ValueError):
        core.alloc(-1)
    off = core.alloc(10)
    with pytest.raises(ValueError, match="no live block starts at offset 999"):
        core.free(999)
    core.free(off)
    with pytest.raises(ValueError, match="double free"):
        core.free(off)
    assert core.stats()["num_frees"] == 1
    assert core.plan_defragment() == []
    empty = core_cls(0, 1)
    with pytest.raises(core_cls.OOMError):
        empty.alloc(0)
    assert empty.stats()["fragmentation"] == 0.0


def test_core_capacity_not_multiple_of_alignment(core_cls):
    core = core_cls(1000, 256)
    offs = [core.alloc(256) for _ in range(3)]
    assert offs == [0, 256, 512]
    with pytest.raises(core_cls.OOMError):
        core.alloc(1)  # only the 232-byte tail is left
    assert core.stats()["largest_free"] == 232
    core.free(256)
    assert core.stats()["fragmentation"] == pytest.approx(1 - 256 / 488)
    core.free(0)
    core.free(512)
    assert core.blocks() == [] and core.stats()["largest_free"] == 1000


def test_core_zero_byte_blocks_are_distinct(core_cls):
    core = core_cls(4096, 128)
    offs = [core.alloc(0) for _ in range(5)]
    assert len(set(offs)) == 5 and all(o % 128 == 0 for o in offs)
    assert core.stats()["in_use"] == 5 * 128


def test_core_peak_and_reset(core_cls):
    core = core_cls(1 << 12, 64)
    a = core.alloc(1000)
    b = core.alloc(100)
    assert core.stats()["peak_in_use"] == 1024 + 128
    core.free(a)
    assert core.stats()["peak_in_use"] == 1024 + 128
    core.reset_peak()
    assert core.stats()["peak_in_use"] == 128
    core.free(b)
    assert core.stats()["peak_in_use"] == 128


# ---------------------------------------------------------------------------------------------
# Arena level
# ---------------------------------------------------------------------------------------------

DTYPES = [
    torch.uint8,
    torch.bool,
    torch.int16,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int32,
    torch.float64,
    torch.int64,
    torch.complex64,
]


def _fill(block: Block, gen: torch.Generator) -> torch.Tensor:
    """Writes a random byte pattern into the block; returns a copy of it."""
    nbytes = block.nbytes
    if block.dtype == torch.bool:  # keep bools valid (0/1)
        data = torch.randint(0, 2, (nbytes,), dtype=torch.uint8, generator=gen)
    else:
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    block.tensor.view(torch.uint8).copy_(data)
    return data


def _check_arena(arena: Arena, model: Model) -> None:
    blocks = arena.blocks()
    assert [(b.offset, model.live[b.offset]) for b in blocks] == sorted(model.live.items())
    storage = arena.buffer.untyped_storage().data_ptr()
    end = -1
    for b in blocks:
        assert b.offset % arena.alignment == 0
        assert b.offset >= end  # no overlap (address order, reserved sizes)
        end = b.offset + model.reserved(b.nbytes)
        t = b.tensor
        assert t.dtype == b.dtype and t.shape == (b.numel,)
        # A view of the arena buffer at the block's offset (data_ptr() is 0 when numel == 0).
        assert t.untyped_storage().data_ptr() == storage
        assert t.storage_offset() * t.element_size() == b.offset + arena.buffer.storage_offset()
        assert t.data_ptr() % arena.alignment == 0 or b.numel == 0  # absolute alignment
    _assert_stats(arena.stats(), model)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("chunk", [None, 100])
def test_arena_random_ops_preserve_contents(core_cls, seed, chunk, monkeypatch):
    if chunk is not None:
        # Tiny staging chunks: overlapping moves go through the temporary in many pieces.
        monkeypatch.setattr(arena_mod, "_COPY_CHUNK_BYTES", chunk)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    capacity, alignment = 1 << 16, 64
    arena = Arena(capacity, alignment=alignment, core_cls=core_cls)
    model = Model(capacity, alignment)
    live: list[Block] = []
    patterns: dict[int, torch.Tensor] = {}  # id(block) -> bytes
    defrags = 0

    def check_contents() -> None:
        for b in live:
            assert torch.equal(b.tensor.view(torch.uint8), patterns[id(b)])

    # 1000 operations: about 50 defragmentations among some 550 allocations and 400 frees, each
    # followed by a full check of the arena against the model.
    for _ in range(1000):
        r = rng.random()
        if r < 0.55 or not live:
            dtype = rng.choice(DTYPES)
            numel = rng.choice([0, 1, rng.randrange(1, 50), rng.randrange(50, 1500)])
            if dtype.itemsize == 1 and numel % 2 == 0:
                numel += 1  # odd byte counts
            nbytes = numel * dtype.itemsize
            expected = model.alloc(nbytes)
            if expected is None:
                before = (arena.stats(), [(b.offset, b.numel) for b in arena.blocks()])
                with pytest.raises(ArenaOutOfMemory) as info:
                    arena.alloc(numel, dtype)
                assert f"requested {nbytes} bytes" in str(info.value)
                assert (arena.stats(), [(b.offset, b.numel) for b in arena.blocks()]) == before
            else:
                b = arena.alloc(numel, dtype)
                assert b.offset == expected and b.numel == numel and b.dtype == dtype
                live.append(b)
                patterns[id(b)] = _fill(b, gen)
        elif r < 0.95:
            b = live.pop(rng.randrange(len(live)))
            model.free(b.offset)
            arena.free(b)
            del patterns[id(b)]
            assert not b.is_live
        else:
            old = {id(b): b.offset for b in live}
            remap = model.compact()
            moved = arena.defragment()
            defrags += 1
            assert moved == sum(
                model.live[remap[o]] for o in old.values() if remap[o] != o
            )  # reserved sizes of the blocks that moved
            for b in live:
                assert b.offset == remap[old[id(b)]]
            check_contents()
            s = arena.stats()
            assert s["largest_free"] == s["free_bytes"] and s["fragmentation"] == 0.0
        _check_arena(arena, model)

    assert defrags > 10
    check_contents()
    for b in live:
        arena.free(b)
        model.free(b.offset)
    s = arena.stats()
    assert s["largest_free"] == capacity and s["in_use"] == 0
    _assert_stats(s, model)


def test_block_views_and_zero_numel(core_cls):
    arena = Arena(4096, alignment=64, core_cls=core_cls)
    b = arena.alloc(12, torch.float32)
    b.tensor.copy_(torch.arange(12.0))
    assert torch.equal(b.view(3, 4), torch.arange(12.0).view(3, 4))
    assert torch.equal(b.view((2, 6)), torch.arange(12.0).view(2, 6))
    z = [arena.alloc(0, torch.float16) for _ in range(3)]
    assert len({x.offset for x in z}) == 3 and all(x.tensor.numel() == 0 for x in z)
    with pytest.raises(ValueError):
        arena.alloc(-1, torch.float32)
    with pytest.raises(ValueError, match="item size"):
        Arena(1024, alignment=4, core_cls=core_cls).alloc(2, torch.float64)
    for bad in (0, 3, 100):
        with pytest.raises(ValueError, match="power of two"):
            Arena(1024, alignment=bad, core_cls=core_cls)
    assert "live_blocks=4" in repr(arena)
    assert arena.is_native == (core_cls is not _PyArenaCore)


def test_bound_parameters_follow_defragment(core_cls):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref = copy.deepcopy(net)
    arena = Arena(1 << 14, alignment=128, core_cls=core_cls)
    params = list(net.parameters())
    ids = [id(p) for p in params]
    blocks, junk = [], []
    for p in params:  # interleave junk so that freeing it leaves holes below every param
        junk.append(arena.alloc(37, torch.float32))
        junk[-1].tensor.fill_(-1.0)
        b = arena.alloc(p.numel(), p.dtype)
        assert b.bind(p) is p
        blocks.append(b)
    for b, p in zip(blocks, params, strict=True):
        assert b.bound == [p]
        assert p.data_ptr() == b.tensor.data_ptr()
    for j in junk:
        arena.free(j)
    old_offsets = [b.offset for b in blocks]

    moved = arena.defragment()
    assert moved > 0 and [b.offset for b in blocks] != old_offsets
    assert [id(p) for p in net.parameters()] == ids
    for b, p, q in zip(blocks, net.parameters(), ref.parameters(), strict=True):
        assert p.is_leaf and p.requires_grad and isinstance(p, torch.nn.Parameter)
        assert p.data_ptr() == arena.buffer.data_ptr() + b.offset
        assert torch.equal(p.detach(), q.detach())

    # Autograd and an optimizer step through the moved storage.
    x = torch.randn(4, 7)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for model, o in ((net, opt), (ref, ref_opt)):
        o.zero_grad()
        model(x).square().sum().backward()
        o.step()
    for b, p, q in zip(blocks, net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
        torch.testing.assert_close(p.detach(), q.detach())
        torch.testing.assert_close(b.view(p.shape), p.detach())  # step wrote into the arena

    # Move again after the step: values follow, and training keeps working.
    arena.free(arena.alloc(1, torch.uint8))  # no-op churn
    first = blocks[0]
    arena.free(first)
    arena.defragment()
    for b, p, q in zip(blocks[1:], params[1:], list(ref.parameters())[1:], strict=True):
        assert p.data_ptr() == arena.buffer.data_ptr() + b.offset
        torch.testing.assert_close(p.detach(), q.detach())

    # Re-binding a tensor to another block moves it there; the old block forgets it.
    spare = arena.alloc(params[1].numel(), params[1].dtype)
    spare.bind(params[1])
    assert blocks[1].bound == [] and spare.bound == [params[1]]
    torch.testing.assert_close(params[1].detach(), list(ref.parameters())[1].detach())
    arena.free(blocks[2])
    arena.defragment()
    assert params[1].data_ptr() == spare.tensor.data_ptr()
    torch.testing.assert_close(params[1].detach(), list(ref.parameters())[1].detach())

    with pytest.raises(ValueError, match="elements"):
        blocks[1].bind(torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="bind a torch.float64"):
        blocks[1].bind(torch.zeros(blocks[1].numel, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="freed"):
        first.bind(params[0])


def test_oom_leaves_state_unchanged_and_reports_stats(core_cls):
    arena = Arena(4096, alignment=256, core_cls=core_cls)
    blocks = [arena.alloc(64, torch.float32) for _ in range(16)]  # 256 bytes each: full
    for b in blocks[::2]:
        arena.free(b)
    gen = torch.Generator().manual_seed(1)
    pats = {id(b): _fill(b, gen) for b in blocks[1::2]}
    before_stats = arena.stats()
    before_blocks = [(b.offset, b.numel, b.dtype) for b in arena.blocks()]
    assert before_stats["fragmentation"] == pytest.approx(1 - 256 / 2048)

    with pytest.raises(ArenaOutOfMemory) as info:
        arena.alloc(100, torch.float32)  # 400 bytes -> 512 reserved > 256 largest run
    err = info.value
    assert isinstance(err, MemoryError)
    msg = str(err)
    for part in (
        "requested 400 bytes",
        "512 after alignment",
        "capacity 4096",
        "in use 2048",
        "free 2048",
        "largest free run 256",
        "fragmentation 87.5%",
        "defragment()",
    ):
        assert part in msg, (part, msg)
    assert err.requested_bytes == 400 and err.reserved_bytes == 512
    assert err.stats == before_stats
    assert arena.stats() == before_stats
    assert [(b.offset, b.numel, b.dtype) for b in arena.blocks()] == before_blocks
    for b in blocks[1::2]:
        assert torch.equal(b.tensor.view(torch.uint8), pats[id(b)])

    with pytest.raises(ArenaOutOfMemory, match="cannot help") as info:
        arena.alloc(5000, torch.uint8)
    assert "capacity 4096" in str(info.value)
    assert arena.stats() == before_stats

    # The core-level error carries the stats too.
    with pytest.raises(core_cls.OOMError) as info:
        arena.core.alloc(400)
    assert "largest free run 256" in str(info.value) and "capacity 4096" in str(info.value)
    assert arena.stats() == before_stats


def test_double_free_and_foreign_block(core_cls):
    a = Arena(4096, alignment=64, core_cls=core_cls)
    other = Arena(4096, alignment=64, core_cls=core_cls)
    blk = a.alloc(10, torch.float32)
    with pytest.raises(ValueError, match="another arena"):
        other.free(blk)
    a.free(blk)
    with pytest.raises(ValueError, match="already freed"):
        a.free(blk)
    again = a.alloc(10, torch.float32)
    assert again.offset == blk.offset  # the stale Block must not free its successor
    with pytest.raises(ValueError, match="already freed"):
        a.free(blk)
    assert again.is_live and a.stats()["live_blocks"] == 1
    with pytest.raises(RuntimeError, match="freed"):
        _ = blk.tensor
    with pytest.raises(TypeError):
        a.free(again.tensor)  # type: ignore[arg-type]
    a.free(again)
    assert a.stats()["num_frees"] == 2 and a.stats()["in_use"] == 0


def test_peak_accounting(core_cls):
    arena = Arena(1 << 14, alignment=256, core_cls=core_cls)
    model = Model(1 << 14, 256)
    rng = random.Random(7)
    live = []
    for _ in range(500):
        if rng.random() < 0.6 or not live:
            n = rng.randrange(0, 700)
            if model.alloc(n) is None:
                with pytest.raises(ArenaOutOfMemory):
                    arena.alloc(n, torch.uint8)
                continue
            live.append(arena.alloc(n, torch.uint8))
        else:
            b = live.pop(rng.randrange(len(live)))
            model.free(b.offset)
            arena.free(b)
        assert arena.stats()["peak_in_use"] == model.peak
    arena.reset_peak()
    assert arena.stats()["peak_in_use"] == model.in_use


def test_concurrent_alloc_free(core_cls):
    arena = Arena(1 << 16, alignment=64, core_cls=core_cls)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[Block] = []
        try:
            for _ in range(400):
                if rng.random() < 0.55 or not mine:
                    try:
                        mine.append(arena.alloc(rng.randrange(0, 600), torch.uint8))
                    except ArenaOutOfMemory:
                        pass
                else:
                    arena.free(mine.pop(rng.randrange(len(mine))))
            for b in mine:
                arena.free(b)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = arena.stats()
    assert s["in_use"] == 0 and s["live_blocks"] == 0 and s["largest_free"] == 1 << 16
    assert s["num_allocs"] == s["num_frees"] > 0


def test_paper_6_3_fragmentation_scenario(core_cls):
    """ZeRO §6.3: long-lived activation checkpoints interleaved with short-lived activations
    fragment memory; a large contiguous request (e.g. a gradient bucket) then fails although
    enough bytes are free in total, and succeeds after defragmentation."""
    kib = 1024
    arena = Arena(896 * kib, alignment=256, core_cls=core_cls)
    gen = torch.Generator().manual_seed(3)
    checkpoints: list[tuple[Block, torch.Tensor]] = []
    activations: list[Block] = []
    for _layer in range(8):
        # Forward of one layer: a large activation (alive until the forward pass ends) and a
        # small checkpoint kept for the backward pass, allocated right after it.
        activations.append(arena.alloc(24 * kib, torch.float32))  # 96 KiB
        ckpt = arena.alloc(4 * kib, torch.bfloat16)  # 8 KiB
        checkpoints.append((ckpt, _fill(ckpt, gen)))
    for act in activations:  # end of forward: the activations die, the checkpoints stay
        arena.free(act)

    s = arena.stats()
    bucket_bytes = 256 * kib
    assert s["free_bytes"] == 832 * kib >= 3 * bucket_bytes  # plenty of memory in total ...
    assert s["largest_free"] < bucket_bytes  # ... but no contiguous run for the bucket
    assert s["fragmentation"] > 0.5
    with pytest.raises(ArenaOutOfMemory, match="defragment"):
        arena.alloc(bucket_bytes // 4, torch.float32)
    assert arena.stats() == s

    moved = arena.defragment()
    assert moved == 8 * 8 * kib  # only the checkpoints move (8 KiB each)
    after = arena.stats()
    assert after["fragmentation"] == 0.0 and after["largest_free"] == s["free_bytes"]
    bucket = arena.alloc(bucket_bytes // 4, torch.float32)
    assert bucket.offset == 8 * 8 * kib
    for ckpt, data in checkpoints:
        assert torch.equal(ckpt.tensor.view(torch.uint8), data)


@pytest.mark.parametrize("alignment", [64, 256, 4096])
def test_absolute_alignment_after_allocs_frees_defragment(core_cls, alignment):
    """Every block's address (not only its offset) is a multiple of the alignment, on CPU
    where torch's allocator aligns buffers to 64 bytes only."""
    for attempt in range(4):  # several arenas: the allocator's base varies between buffers
        arena = Arena(64 * alignment + 4 * attempt * 64, alignment=alignment, core_cls=core_cls)
        assert arena.buffer.data_ptr() % alignment == 0
        blocks = [arena.alloc(n, dt) for n, dt in
                  [(3, torch.float32), (alignment, torch.bfloat16), (17, torch.float64),
                   (1, torch.uint8), (5 * alignment, torch.float16)]]
        for b in blocks:
            assert b.tensor.data_ptr() % alignment == 0
        arena.free(blocks[0])
        arena.free(blocks[2])
        blocks[1].tensor.fill_(7)
        arena.defragment()
        for b in (blocks[1], blocks[3], blocks[4]):
            assert b.tensor.data_ptr() % alignment == 0
        assert bool((blocks[1].tensor == 7).all())
        for n in (9, alignment + 1):
            assert arena.alloc(n, torch.float32).tensor.data_ptr() % alignment == 0
