"""The CUDA kernel's format-version-3 arithmetic without a GPU: csrc/fmt_v3.cuh (the code map
values and the encoder adam_compressed_cuda.cu calls) compiled for the host with g++ and
checked bit for bit against the oracle, zerokern.quant.fmt_v3: every code's value on both
maps, and the codes of fp32 patterns spread over all 2**32 (both signs, zeros, subnormals,
inf, NaN), of every pattern at and next to each rounding edge (half a step above each map
value's pattern) and of test_compressed_format_v3's probe values (every map value, midpoint
and their fp32 neighbours). What only a GPU runs (the warp absmax, the normalisation) is
tested by tests/test_gpu_adamw_compressed.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_compressed_format_v3 import _probe_values

from zerokern.quant.fmt_v3 import code_map_v3, codes_v3

CSRC = Path(__file__).resolve().parent.parent / "csrc"
HARNESS = r"""
#include <cstdio>
#include "fmt_v3.cuh"
// argv: patterns (uint32) in, codes (signed, unsigned bytes per pattern) out, values out
int main(int argc, char** argv) {
  if (argc != 4) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  FILE* vals = std::fopen(argv[3], "wb");
  if (!in || !out || !vals) return 3;
  uint32_t u;
  while (std::fread(&u, 4, 1, in) == 1) {
    const float n = zk::v3::float_of(u);
    const unsigned char c[2] = {static_cast<unsigned char>(zk::v3::code<true>(n)),
                                static_cast<unsigned char>(zk::v3::code<false>(n))};
    std::fwrite(c, 1, 2, out);
  }
  for (uint32_t c = 0; c < 256; ++c) {
    const float v[2] = {zk::v3::value<true>(c), zk::v3::value<false>(c)};
    std::fwrite(v, 4, 2, vals);
  }
  return std::fclose(out) | std::fclose(vals);
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    d = tmp_path_factory.mktemp("fmt_v3_host")
    (d / "harness.cpp").write_text(HARNESS)
    exe = d / "harness"
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", str(CSRC), str(d / "harness.cpp"), "-o",
                    str(exe)], check=True, capture_output=True, text=True)
    return exe


def test_cuda_v3_values_and_codes_equal_the_oracle(harness: Path, tmp_path: Path) -> None:
    spread = torch.arange(0, 2**32, 65537, dtype=torch.int64)
    top = torch.arange(4096, dtype=torch.int64) << 20  # every sign, exponent, 3 mantissa bits
    edges = (top[:, None] + torch.tensor([0, 1, (1 << 19) - 1, 1 << 19, (1 << 19) + 1,
                                          (1 << 20) - 1])).reshape(-1)
    probe = _probe_values().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    specials = torch.tensor([0, 2**31, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                             0x7F800001, 0xFFFFFFFF, 1, 2**31 + 1], dtype=torch.int64)
    pats = torch.cat([spread, edges, probe, specials]).numpy().astype(np.uint32)
    pats.tofile(tmp_path / "pats.bin")
    subprocess.run([str(harness), str(tmp_path / "pats.bin"), str(tmp_path / "codes.bin"),
                    str(tmp_path / "vals.bin")], check=True)
    got = np.fromfile(tmp_path / "codes.bin", dtype=np.uint8).reshape(-1, 2)
    vals = np.fromfile(tmp_path / "vals.bin", dtype=np.uint32).reshape(256, 2)
    n = torch.from_numpy(pats.view(np.int32).copy()).view(torch.float32)
    for col, signed in ((0, True), (1, False)):
        want = codes_v3(n, signed).numpy()
        bad = np.nonzero(got[:, col] != want)[0][:5]
        assert bad.size == 0, (f"signed={signed}: patterns {[hex(int(pats[i])) for i in bad]}"
                               f" give codes {got[bad, col].tolist()}, want {want[bad].tolist()}")
        table = code_map_v3(signed).view(torch.int32).numpy().view(np.uint32)
        assert np.array_equal(vals[:, col], table), f"signed={signed}: map values differ"
