"""``python -m zerokern COMMAND ...``: dispatcher for the command-line tools in zerokern/cli/.

Each subcommand lives in its own module with ``add_parser(subparsers)`` (which registers the
subparser and sets ``func=run`` as a default) and ``run(args) -> int``. Only the module of the
command being run is imported, so a command whose module is missing, or slow to import, never
affects the others; ``--help`` lists every command from the registry without importing any.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (command name, module path, one-line help); modules are imported only when run.
COMMANDS: list[tuple[str, str, str]] = [
    (
        "estimate",
        "zerokern.cli.estimate",
        "per-GPU memory and communication of ZeRO stages 0-3 (paper §5.4, §7)",
    ),
    (
        "demo",
        "zerokern.cli.demo",
        "train a small GPT with ZeRO stages 0-3; memory and communication vs the paper",
    ),
    (
        "consolidate",
        "zerokern.cli.consolidate",
        "turn a zerokern checkpoint into a plain fp32 state dict (+ AdamW state), streaming",
    ),
]


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m zerokern" if name in ("", "__main__.py", "-c") else name


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Top-level parser; the full subparser is built only for ``command`` (imported lazily)."""
    parser = argparse.ArgumentParser(
        prog=_prog(), description="zerokern command-line tools: ZeRO stages 1-3 for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_path, help_text in COMMANDS:
        if name != command:
            sub.add_parser(name, help=help_text)  # placeholder: listed in --help, not imported
            continue
        try:
            module = importlib.import_module(module_path)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (module_path + ".").startswith(exc.name + "."):
                raise  # the command's module exists but one of its imports is missing
            parser.exit(2, f"{parser.prog}: error: command {name!r} is not available ({exc})\n")
        module.add_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {name for name, _, _ in COMMANDS}
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in names else None)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
