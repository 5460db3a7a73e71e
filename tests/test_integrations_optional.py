"""The trainer integrations are optional: importing zerokern imports none of transformers,
accelerate or lightning, and an integration whose package is missing says which one to install.
Run in fresh interpreters, with the package hidden by a None entry in sys.modules (what an
uninstalled package looks like to import)."""

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


@pytest.mark.parametrize("module, hidden, package", [
    ("transformers", "transformers", "transformers"),
    ("transformers", "accelerate", "accelerate"),
    ("accelerate", "accelerate", "accelerate"),
    ("lightning", "pytorch_lightning", "pytorch-lightning"),
])
def test_a_missing_package_is_named(module, hidden, package):
    r = _python(f"import sys; sys.modules[{hidden!r}] = None\n"
                f"try:\n    import zerokern.integrations.{module}\n"
                "except ImportError as e:\n    print('ImportError:', e)\n")
    assert r.returncode == 0, r.stderr
    assert f"needs the '{package}' package" in r.stdout, r.stdout
    assert f"pip install {package}" in r.stdout
