"""What the Triton kernel tests (tests/test_triton_*.py) share: they run without a GPU, in
subprocesses, and assert on what those print.

* Interpreter: TRITON_INTERPRET must be set before triton is first imported, and other tests
  of this pytest process (or conftest) may have imported it already, so the kernels run in a
  subprocess started with TRITON_INTERPRET=1: ``python tests/triton_common.py interp
  test_triton_adamw test_triton_sq_norm ...`` imports each named test module there and runs
  the checks its ``CHECKS["interp"]`` lists. Nothing on the pytest side imports triton with
  the interpreter, so the files can be collected in any order, alone or with the suite.
* Compile: ``python tests/triton_common.py compile test_triton_compile`` runs
  ``CHECKS["compile"]`` in a subprocess without the interpreter (no GPU needed, only ptxas).

A check fills a dict; the script prints one JSON line, ``{"modules": {name: dict}}`` (or
``{"skip": why}``), and each test module's fixture hands its own dict to its tests. One
subprocess per mode serves every module the session selected: conftest starts them right
after collection (start_scripts), in the background, since they take 30-40 s of one core that
the rest of the suite leaves partly idle; a fixture whose module none of them covers starts
its own. Under pytest-xdist the workers share them through files (``_Script``): each script
runs once per run, not once per worker.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
# A bound against a hung interpreter, not a speed check: the interpreter subprocess runs every
# Triton file's cases in one process, and on a loaded 2-core machine (this session: load 15-20)
# it passed 600 s with the quantized-communication codec's cases added.
TIMEOUT_S = 1800
# fixture name -> script mode: a test that asks for the fixture needs that subprocess
FIXTURE_MODES = {"interp": "interp", "compiled": "compile"}


# ----------------------------------------------------------------------------------------
# Script side: helpers of the checks
# ----------------------------------------------------------------------------------------


class Group:
    """Collects failures of one group of cases."""

    def __init__(self):
        self.cases = 0
        self.failures: list[str] = []

    def check(self, name, fn, *args):
        self.cases += 1
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - every failure is reported by name
            self.failures.append(f"{name}: {type(e).__name__}: {e}"[:2000])

    def result(self):
        return {"cases": self.cases, "failures": self.failures}


def bits(t):
    """The bit pattern of t, as an integer tensor of its element size."""
    import torch

    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _run_checks(mode: str, modules: list[str]) -> None:
    if mode == "interp":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("run with TRITON_INTERPRET=1")
        import torch

        from zerokern.kernels.triton import interpreter_problem

        why = interpreter_problem()
        if why is not None:
            print(json.dumps({"skip": why}))
            return
        torch.set_num_threads(int(os.environ.get("ZEROKERN_TEST_THREADS", 0))
                              or min(2, os.cpu_count() or 1))
    results = {}
    for name in modules:
        out, times = {}, {}
        for check, fn in importlib.import_module(name).CHECKS[mode]:
            t0 = time.perf_counter()
            fn(out)
            times[check] = round(time.perf_counter() - t0, 2)
            if "skip" in out:
                break
        out["seconds"] = times
        results[name] = out
    print(json.dumps({"modules": results}))


# ----------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------


class _Script:
    """One subprocess running the checks of `modules` in `mode`, and its parsed output.

    With ``shared`` (a folder all pytest-xdist workers of the run see), the subprocess is
    shared too: every worker collects every test, so each would start the same script; the
    first to create its lock file starts it, writing its output and exit status there, and
    every worker (that one included) reads them from there."""

    def __init__(self, mode: str, modules: list[str], shared: Path | None = None):
        import tempfile

        env = dict(os.environ)
        env["TRITON_INTERPRET"] = "1" if mode == "interp" else "0"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.mode = mode
        self.t0 = time.monotonic()
        self.parsed: dict | None = None
        self.proc: subprocess.Popen | None = None
        cmd = [sys.executable, str(HERE), mode, *modules]
        if shared is None:
            self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.out,
                                         stderr=self.err, text=True)
            return
        shared.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha1(" ".join(modules).encode()).hexdigest()[:16]
        stem = shared / f"{mode}-{key}"  # the same modules: the same files in every worker
        self.files = {k: Path(f"{stem}.{k}") for k in ("out", "err", "rc")}
        try:
            os.close(os.open(f"{stem}.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another worker started it
        # The shell writes the exit status once the script has ended (renamed into place,
        # so a reader never sees it half written); its own session, so a timeout kills both.
        # `timeout` bounds the script itself: the worker that started it may never wait for
        # it (--dist loadfile sends the Triton files elsewhere), and the waiting workers do not
        # own it, so without it a hung script would outlive the run and every reader would
        # wait out TIMEOUT_S; with it they read rc 124 (or 137) and fail at once.
        env.update(ZK_OUT=str(self.files["out"]), ZK_ERR=str(self.files["err"]),
                   ZK_RC=str(self.files["rc"]), ZK_TIMEOUT=str(TIMEOUT_S))
        script = ('timeout -k 10 "$ZK_TIMEOUT" "$@" >"$ZK_OUT" 2>"$ZK_ERR"; '
                  'echo $? >"$ZK_RC.part"; mv "$ZK_RC.part" "$ZK_RC"')
        self.proc = subprocess.Popen(["sh", "-c", script, "sh", *cmd], cwd=ROOT, env=env,
                                     start_new_session=True)

    def _wait_shared(self) -> tuple[int | None, str, str]:
        rc_file = self.files["rc"]
        while not rc_file.exists():
            if time.monotonic() - self.t0 > TIMEOUT_S + 30:  # the script's own limit first
                if self.proc is not None:
                    os.killpg(self.proc.pid, 9)
                    self.proc.wait()
                return None, "", f"timed out after {TIMEOUT_S} s"
            time.sleep(0.2)
        if self.proc is not None:
            self.proc.wait()
        return (int(rc_file.read_text()), self.files["out"].read_text(),
                self.files["err"].read_text())

    def result(self) -> dict:
        if self.parsed is not None:
            return self.parsed
        if hasattr(self, "files"):
            rc, stdout, stderr = self._wait_shared()
        else:
            assert self.proc is not None
            try:
                self.proc.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - self.t0)))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.out.seek(0)
            self.err.seek(0)
            rc, stdout, stderr = self.proc.returncode, self.out.read(), self.err.read()
        lines = stdout.strip().splitlines()
        if rc != 0 or not lines:
            pytest.fail(f"`{self.mode}` subprocess failed (rc={rc}):\n{stderr[-6000:]}")
        self.parsed = json.loads(lines[-1])
        return self.parsed


_STARTED: dict[tuple[str, str], _Script] = {}  # (mode, module) -> the script covering it
_SHARED: list[Path] = []  # the folder shared by this run's xdist workers, once known


def _start(mode: str, modules: list[str]) -> None:
    todo = sorted({m for m in modules if (mode, m) not in _STARTED})
    if todo:
        script = _Script(mode, todo, _SHARED[0] if _SHARED else None)
        for m in todo:
            _STARTED[mode, m] = script


def start_scripts(items, shared: Path | None = None) -> None:
    """Start, in the background, one subprocess per mode for every module whose selected
    tests ask for its fixture (conftest calls this right after collection). ``shared``: a
    folder every pytest-xdist worker of this run sees, through which they share the
    subprocesses (see _Script)."""
    if shared is not None:
        _SHARED[:] = [shared]
    wanted: dict[str, list[str]] = {}
    for item in items:
        mod = getattr(item, "module", None)
        for fixture in getattr(item, "fixturenames", ()):
            if mod is not None and fixture in FIXTURE_MODES:
                wanted.setdefault(FIXTURE_MODES[fixture], []).append(Path(mod.__file__).stem)
    for mode, modules in wanted.items():
        _start(mode, modules)


def results(mode: str, module_file: str) -> dict:
    """The dict `module_file`'s checks filled in `mode` (skips the caller's tests when the
    script could not run its kernels)."""
    pytest.importorskip("triton")
    if mode == "interp":
        pytest.importorskip("numpy")
    name = Path(module_file).stem
    _start(mode, [name])
    res = _STARTED[mode, name].result()
    if "skip" in res:
        pytest.skip(res["skip"])
    out = res["modules"][name]
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def assert_group(res, key, min_cases):
    g = res[key]
    assert not g["failures"], f"{len(g['failures'])} of {g['cases']} failed:\n" + "\n".join(
        g["failures"][:20]
    )
    assert g["cases"] >= min_cases, g


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("interp", "compile"):
        sys.exit(f"usage: {sys.argv[0]} interp|compile TEST_MODULE...")
    _run_checks(sys.argv[1], sys.argv[2:])
