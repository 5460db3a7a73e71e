"""Optional integrations with trainers: ``zerokern.integrations.transformers`` (HF Trainer),
``zerokern.integrations.accelerate`` and ``zerokern.integrations.lightning``.

Importing zerokern or this package imports none of those packages; each integration module
imports its own and raises ImportError naming the package (and how to install it) when it is
missing.
"""
