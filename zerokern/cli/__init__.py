"""Command-line subcommands of ``python -m zerokern`` (one module per subcommand).

Each module provides ``add_parser(subparsers)`` and ``run(args) -> int``; the dispatcher in
``zerokern/__main__.py`` lists them and imports only the one that is asked for.
"""
