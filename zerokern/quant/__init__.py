"""Compressed optimizer state (issue 27): the pure-PyTorch oracles the kernels must equal.

Nothing here is exported from ``zerokern``; the optimizer imports the parts it needs.

- ``philox``: Philox4x32-10 on int64 tensors (Random123's generator, as Triton's
  ``tl.randint4x`` and cuRAND use it), ``sr_bits16(seed, step, index)``, the random bits of
  ``master="none"`` keyed by the element's index in its parameter (format version 2: one call
  per 8 elements), and version 1's ``sr_bits``.
- ``rounding``: ``stochastic_round_bf16(x, bits)``, fp32 -> bf16 stochastic rounding.
- ``maps``: the dynamic-exponent 8-bit code maps of the Adam moments (signed for ``exp_avg``,
  unsigned for ``exp_avg_sq``, each with a stable id that checkpoints store) and block-wise
  ``dequantize_blockwise`` (blocks of 256, one fp32 scale each) with format version 1's
  ``quantize_blockwise``.
- ``blockwise``: format version 2's ``quantize_blockwise_v2`` (a signed scale and one
  reciprocal per block), what the optimizer and every kernel encode with.
- ``requantize``: ``requantize_blockwise``, the quantizer of fp32 moments stored from outside
  the step (state dicts, ``opt.state``): version 2's, except that a decoded block gets its own
  codes back.
- ``adamw``: the compressed AdamW step of one parameter's shard, the fused kernels' oracle.
"""
