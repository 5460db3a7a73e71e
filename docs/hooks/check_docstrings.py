"""MkDocs hook: every public API object that the reference pages render has a docstring.

mkdocstrings is configured with ``show_if_no_docstring: false``, so an undocumented public
function would silently vanish from the API reference. This hook finds every ``::: target``
block under ``docs/``, loads the package with griffe (statically, as mkdocstrings does) and
logs a warning for:

- a target without a docstring;
- a public member of a rendered class or module (a function, method, class or property whose
  name does not start with ``_``) without one; plain data attributes are exempt, describe
  them in their class's docstring;
- a name exported by ``zerokern.__all__`` or ``zerokern.ops.__all__`` that no reference page
  renders.

``mkdocs build --strict`` turns these warnings into a failed build.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("mkdocs.hooks.check_docstrings")

PACKAGE = "zerokern"
# Modules whose __all__ must be covered by the reference pages.
EXPORTING = ("zerokern", "zerokern.ops")
_TARGET = re.compile(r"^:::\s+(\S+)\s*$")


def _targets(docs_dir: Path) -> list[tuple[str, dict[str, Any], str]]:
    """(identifier, options, page) for every ``::: identifier`` block of the docs."""
    found = []
    for page in sorted(docs_dir.rglob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            m = _TARGET.match(line)
            if not m:
                continue
            block = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and not nxt.startswith("    "):
                    break
                block.append(nxt[4:])
            data = yaml.safe_load("\n".join(block)) or {}
            found.append((m.group(1), data.get("options") or {}, str(page.relative_to(docs_dir))))
    return found


def _needs_docstring(obj: Any) -> bool:
    if obj.is_function or obj.is_class or obj.is_module:
        return True
    return obj.is_attribute and "property" in obj.labels


def _members(obj: Any, options: dict[str, Any]) -> list[tuple[str, Any]]:
    """The public members mkdocstrings would render for ``obj`` (a class or module)."""
    wanted = options.get("members")
    if wanted is False or not (obj.is_class or obj.is_module):
        return []
    if obj.is_class and options.get("inherited_members"):
        pool = dict(obj.all_members)
    else:
        pool = dict(obj.members)
    if obj.is_module:
        exported = obj.exports
        if exported is not None:
            names = [str(n) for n in exported]
            pool = {n: pool[n] for n in names if n in pool}
        else:
            pool = {n: m for n, m in pool.items() if not m.is_alias}
    if isinstance(wanted, list):
        pool = {n: pool[n] for n in wanted if n in pool}
    out = []
    for name, member in pool.items():
        if name.startswith("_"):
            continue
        try:
            target = member.final_target if member.is_alias else member
        except Exception:  # an alias to something outside the package (torch, ...)
            continue
        if not target.path.startswith(PACKAGE + "."):
            continue
        out.append((name, target))
    return out


def check(docs_dir: Path, search_path: Path) -> list[str]:
    """Every problem found, one line each (empty: all documented)."""
    import griffe

    pkg = griffe.load(PACKAGE, search_paths=[str(search_path)], resolve_aliases=True,
                      resolve_external=False)
    problems: list[str] = []
    rendered: set[str] = set()
    for ident, options, page in _targets(docs_dir):
        try:
            obj = pkg[ident[len(PACKAGE) + 1:]] if ident != PACKAGE else pkg
            obj = obj.final_target if obj.is_alias else obj
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            problems.append(f"{page}: '::: {ident}' does not resolve ({exc})")
            continue
        rendered.add(obj.path)
        if not obj.docstring:
            problems.append(f"{page}: {ident} has no docstring")
        for name, member in _members(obj, options):
            rendered.add(member.path)
            if _needs_docstring(member) and not member.docstring:
                problems.append(f"{page}: {ident}.{name} ({member.path}) has no docstring")
    for module_path in EXPORTING:
        module = pkg if module_path == PACKAGE else pkg[module_path[len(PACKAGE) + 1:]]
        for name in module.exports or ():
            name = str(name)
            if name.startswith("__"):
                continue
            member = module[name]
            try:
                path = (member.final_target if member.is_alias else member).path
            except Exception:  # noqa: BLE001
                path = member.path
            if path not in rendered and f"{module_path}.{name}" not in rendered:
                problems.append(f"{module_path}.{name} is exported but no reference page "
                                f"renders it (add '::: {module_path}.{name}' to docs/reference)")
    return problems


def on_pre_build(config: Any, **_: Any) -> None:
    docs_dir = Path(config["docs_dir"])
    for line in check(docs_dir, Path(config["config_file_path"]).parent):
        log.warning("undocumented API: %s", line)


if __name__ == "__main__":  # python docs/hooks/check_docstrings.py: the same check, alone
    import sys

    root = Path(__file__).resolve().parents[2]
    lines = check(root / "docs", root)
    print("\n".join(lines) or "every rendered public API object has a docstring")
    sys.exit(1 if lines else 0)
