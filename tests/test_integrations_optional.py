"""The trainer integrations are optional: importing zerokern imports none of transformers,
accelerate or lightning, and an integration whose package is missing says which one to install.
Run in fresh interpreters (or children forked from one that imported only torch and
zerokern), with the package hidden by a None entry in sys.modules (what an uninstalled package
looks like to import)."""

from __future__ import annotations

import subprocess
import sys

import pytest

OPTIONAL = ("transformers", "accelerate", "pytorch_lightning", "lightning")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_importing_zerokern_imports_no_trainer_package():
    r = _python("import sys, zerokern, zerokern.integrations; "
                f"print([m for m in {OPTIONAL!r} if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


CASES = [
    ("transformers", "transformers", "transformers"),
    ("transformers", "accelerate", "accelerate"),
    ("accelerate", "accelerate", "accelerate"),
    ("lightning", "pytorch_lightning", "pytorch-lightning"),
]

# One interpreter imports torch and zerokern once, then forks a child per case: each child
# starts from that state (none of the optional packages imported), hides its package and
# imports the integration, as a fresh interpreter would, without paying torch's import again.
_FORKED = """
import json, os, sys
import torch, zerokern
cases = json.loads(sys.argv[1])
for module, hidden, _ in cases:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        sys.modules[hidden] = None
        try:
            __import__(f"zerokern.integrations.{module}")
            msg = "imported"
        except ImportError as e:
            msg = f"ImportError: {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        print(json.dumps(f.read()))
    os.waitpid(pid, 0)
"""


@pytest.fixture(scope="module")
def missing_package_messages() -> list[str]:
    import json

    r = subprocess.run([sys.executable, "-c", _FORKED, json.dumps(CASES)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == len(CASES), r.stdout + r.stderr
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{m}-{h}" for m, h, _ in CASES])
def test_a_missing_package_is_named(case, missing_package_messages):
    package = CASES[case][2]
    out = missing_package_messages[case]
    assert f"needs the '{package}' package" in out, out
    assert f"pip install {package}" in out
