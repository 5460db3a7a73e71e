// Fused AdamW over a flat range with compressed optimizer state (issue 27) on the CPU: the
// range contract of zerokern/ops/adamw_compressed.py, whose torch backend is the oracle this
// kernel equals bit for bit (NaN payloads aside).
//
// One pass per 256-element quantization block, in two sweeps over the block:
//   1. widen grad and param, dequantize (code_map[c] * scale) or widen the moments, apply the
//      fp32 update of kernels.h with its rounding contract (adam_update of cpu_lanes.h, as
//      adam_cpu.cpp; bf16 moments and int8 version 3 with the folded scalars, one division
//      less), write an fp32 param and fp32 moments (a bf16 param's fp32 value and
//      bf16 moments go to 1 KiB stack buffers, rounded at the end). 8-bit moments go to a
//      1 KiB stack buffer per moment while
//      the block's scale is tracked: the maximum of the bit patterns with the sign cleared (for
//      non-negative floats the integer order is the value order and every NaN pattern lies
//      above inf's, so the maximum propagates NaN like torch's amax) and the maximum of the
//      patterns read as signed integers (it equals A's pattern exactly when some element is
//      +A; else the scale is -A: format version 2, zerokern.quant.blockwise).
//   2. (8-bit moments only) n = x * r with r = 1 / scale, one division per block (a scale
//      outside [2^-126, 2^126) divides each element instead, in a scalar loop), then the code.
//   Then (finish_lanes) the 16-bit results that sweep 1 left in fp32: the param's bf16/fp16
//   copy (from the fp32 param just written), a bf16 param's stochastic rounding (from a
//   third buffer) and bf16 moments. Apart from sweep 1 so that their integer rounding does
//   not wait in the out-of-order window behind each chunk's divisions.
// The block stays in L1 between the sweeps, so memory sees each byte once.
//
// Where the time goes. The update's square root and two IEEE divisions, then the table
// lookups: the map value of each code (decode) and the lookup word of each normalised value
// (encode), two of each per element (V::lut, V::lut_hi16). AVX2 assembles them from scalar
// loads: hardware gathers, which it used before, measured about 20 cycles per 8 lanes on
// Zen 3, more than the divisions. AVX-512 keeps its gathers (measured on a Xeon; scalar loads
// there are not measured) and, with VBMI, decodes 64 codes at a time with byte permutes
// (dequant64).
// Version 3 computes its maps (no lookups): there sweep 1 waits on the square root and the
// division (perf samples on Zen 3 pile up on the instructions after vsqrtps / vdivps), and
// integer work interleaved into it measured slower, not free (Zen 3 issues vector integer
// operations from the same scheduler as the waiting divisions), so the integer sweeps are
// made short instead: AVX2 decodes and encodes version 3 in 16-bit lanes.
// Version 1 divided every element by the absmax in sweep 2 (two more divisions per element)
// and evaluated Philox once per element. (Taking the signed maximum in a separate pass over
// the buffered block instead of in sweep 1 measured slower on AVX2.)
//
// The code of n is #{t_k < n} for n >= 0 and #{t_k <= n} for n < 0 (NaN: 0), t the 255
// thresholds of the map. A binary search per element costs eight dependent table lookups; the
// vector code instead reads one precomputed word per element, indexed by the top 16 bits of
// n's pattern W (its bf16 truncation, sign included). Each such bucket holds at most one
// threshold (the maps' thresholds are further apart than a bf16 ulp), so within a bucket the
// code is C or C+1 (C or C-1 for negative n, whose magnitude grows with the low half), with
// the step after some low half `tl`; the word makes one add and one shift give the code:
//   n >= 0: word = C << 16 | (0xFFFF - tl),        code = (word + low) >> 16
//   n <  0: word = (C - 1) << 16 + tl + 1,         code = (word + (low ^ 0xFFFF)) >> 16
// (low = the low 16 bits of n; a bucket without a threshold has tl = 0xFFFF, so nothing
// carries). The words are derived once per distinct table from the exact scalar search, which
// also checks that the table has this shape; a table that does not (never kernel_tables) makes
// the block fall back to the exact search for every element.
//
// Vector code: the per-chunk routines are templates over the lanes of cpu_lanes.h (AVX-512,
// AVX2, scalar), so the three paths share one algorithm; a block runs its 64-element chunks (8-bit
// moments, AVX-512), its 16-lane chunks, then an 8-lane chunk, then single elements. OpenMP
// splits the range on block boundaries.
//
// Stochastic rounding draws, per block, the Philox4x32-10 words of the groups of 8 elements it
// covers (counter (index / 8, step, 0, 0), key (seed lo, seed hi); format version 2: element i
// takes 16 bits of its group's 128), 16 or 8 groups at a time, into a stack buffer first
// (32x32 -> 64-bit products from the even/odd-lane multiplies).
// Compile with contraction off: GCC's default (-ffp-contract=fast) would fuse, e.g., the
// dequantize multiply into the following subtraction, which rounds once where the contract
// rounds twice. (Before the includes, so the intrinsics' bodies carry the same setting and
// still inline.) No errno either: a scalar sqrt of a negative NaN-producing input needs no
// library call.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-math-errno")
#endif
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpu_lanes.h"
#include "cpu_vec.h"
#include "kernels.h"

// The byte permutes of dequant64 need AVX-512 VBMI (Ice Lake on); Skylake-X and Cascade Lake
// have AVX-512 without it and decode by scalar lookups, as AVX2 does.
#if defined(ZK_AVX512) && defined(__AVX512VBMI__)
#define ZK_VBMI 1
#endif

namespace zk {
namespace {

constexpr int64_t kBlock = kQuantBlock;
static_assert(kBlock == 256, "the stack buffers and the table layout assume 256");
// Below this many elements threads cost more than they save (as adam_cpu.cpp).
constexpr int64_t kParallelMin = 1 << 15;

// Table layout (zerokern.quant.maps.kernel_tables): per map, 256 code values then 255
// thresholds and +inf.
constexpr int kSignedMap = 0, kSignedThr = 256, kUnsignedMap = 512, kUnsignedThr = 768;

// -- the exact scalar quantizer (the reference the lookup words are derived from) ------------

// #{t_k < x} (x >= 0 or +0/-0) or #{t_k <= x} (x < 0) over the 256-entry threshold table;
// NaN -> 0. A branch-free binary search when the table is sorted, else a plain count.
inline uint32_t code_exact(const float* thr, bool sorted, float x) {
  if (std::isnan(x)) return 0;
  const bool neg = x < 0.0f;
  if (!sorted) {
    uint32_t c = 0;
    for (int k = 0; k < 256; ++k) c += neg ? (thr[k] <= x) : (thr[k] < x);
    return c;
  }
  uint32_t pos = 0;
  for (uint32_t step = 128; step > 0; step >>= 1) {
    const float t = thr[pos + step - 1];
    pos += (neg ? (t <= x) : (t < x)) ? step : 0;
  }
  return pos;
}

// The lookup words of one map (see the header comment), indexed by the top 16 bits of n's
// pattern, sign included: 65536 words (256 KiB), so the index needs no clamp and no sign
// fix-up; only the ~3000 buckets of |n| <= 1 are ever read in practice.
struct QuantWords {
  bool ok = false;     // the table has the one-step-per-bucket shape; else use code_exact
  bool sorted = false;
  std::vector<int32_t> words;
};

inline float from_bits(uint32_t u) { return bits_to_float(u); }

QuantWords build_words(const float* thr) {
  QuantWords q;
  q.sorted = true;
  for (int k = 0; k < 255; ++k)
    if (!(thr[k] <= thr[k + 1])) q.sorted = false;  // also false for a NaN threshold
  if (!q.sorted || !(std::isinf(thr[255]) && thr[255] > 0)) return q;
  q.words.assign(size_t(1) << 16, 0);
  for (uint32_t w = 0; w < (1u << 16); ++w) {
    const bool neg = (w >> 15) != 0;
    if ((w & 0x7FFF) >= 0x7F80) continue;  // inf/NaN patterns: |n| <= 1 or NaN -> code 0
    auto code = [&](uint32_t low) { return code_exact(thr, true, from_bits((w << 16) | low)); };
    // Increasing low half = increasing |n|: the code rises (n >= 0) or falls (n < 0; the
    // pattern of -0.0 codes by the n >= 0 rule, which keeps this monotone).
    const uint32_t lo = code(0), hi = code(0xFFFF);
    const int64_t delta = neg ? int64_t(lo) - int64_t(hi) : int64_t(hi) - int64_t(lo);
    if (delta < 0 || delta > 1) return q;
    uint32_t tl = 0xFFFF;  // largest low half still coding as `lo`
    if (delta == 1) {
      uint32_t a = 0, b = 0xFFFF;  // code(a) == lo, code(b) != lo
      while (b - a > 1) {
        const uint32_t mid = (a + b) / 2;
        (code(mid) == lo ? a : b) = mid;
      }
      tl = a;
    }
    // n >= 0: code = (word + low) >> 16; n < 0: code = (word + (low ^ 0xFFFF)) >> 16.
    const uint32_t word = neg ? ((lo - 1) << 16) + tl + 1 : (lo << 16) + (0xFFFF - tl);
    q.words[w] = int32_t(word);
  }
  q.ok = true;
  return q;
}

// Derived words of both maps for one 1024-float table, cached by the table's contents (the
// tables are always zerokern.quant.maps.kernel_tables in practice: one entry).
struct Derived {
  float key[1024];
  QuantWords m, v;
  // Byte k of every map value, per map (signed, unsigned): dequantize's permute tables.
  alignas(64) uint8_t planes[2][4][256];
};

std::shared_ptr<const Derived> derived_for(const float* tables) {
  static std::mutex mu;
  static std::vector<std::shared_ptr<const Derived>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& d : cache)
    if (std::memcmp(d->key, tables, sizeof(d->key)) == 0) return d;
  auto d = std::make_shared<Derived>();
  std::memcpy(d->key, tables, sizeof(d->key));
  for (int map = 0; map < 2; ++map)
    for (int c = 0; c < 256; ++c) {
      const uint32_t u = float_to_bits(tables[(map ? kUnsignedMap : kSignedMap) + c]);
      for (int k = 0; k < 4; ++k) d->planes[map][k][c] = uint8_t(u >> (8 * k));
    }
  d->m = build_words(tables + kSignedThr);
  d->v = build_words(tables + kUnsignedThr);
  if (cache.size() >= 8) cache.erase(cache.begin());  // bounded; a caller holds its own ref
  cache.push_back(std::move(d));
  return cache.back();
}


#ifdef ZK_VBMI
// The map values of 64 codes: each byte of the value is looked up in its own 256-byte table
// (two 128-byte permutes and a blend on the code's top bit), and the four byte vectors are
// interleaved into 64 floats with in-lane unpacks. Unpacks interleave within 128-bit lanes,
// so the codes are first reordered (a 4x4 transpose of their 4-byte groups) to make the
// unpacked floats come out in element order.
inline void dequant64(const uint8_t* codes, const uint8_t (*planes)[256], __m512 out[4]) {
  // Group 4k + L of the input (elements 16k + 4L .. +3) goes to group 4L + k.
  const __m512i transpose =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i c = _mm512_permutexvar_epi32(transpose, _mm512_loadu_si512(codes));
  const __mmask64 top = _mm512_movepi8_mask(c);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const uint8_t* t = planes[k];
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t), c, _mm512_load_si512(t + 64));
    const __m512i hi =
        _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), c, _mm512_load_si512(t + 192));
    b[k] = _mm512_mask_blend_epi8(top, lo, hi);
  }
  const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}
#endif

// Philox4x32-10's round keys for V's lanes, splatted once per call of the kernel (per round:
// two broadcasts that would otherwise be redone for every V::N counters).
template <class V>
struct PhiloxKeys {
  typename V::I k0[10], k1[10];
  PhiloxKeys(uint32_t a, uint32_t b) {
    for (int r = 0; r < 10; ++r, a += 0x9E3779B9u, b += 0xBB67AE85u) {
      k0[r] = V::seti(a);
      k1[r] = V::seti(b);
    }
  }
};

// Philox4x32-10 of the counters (c0 = lanes of `group`, c1 = step, 0, 0) under the key
// (k0, k1) of `key`, K x V::N counters at a time: the four output words. The K chains are
// interleaved round by round: one chain's multiply-shift-xor latency (10 dependent rounds)
// left the pipes idle (AVX2: 8 counters per chain). The counter is built from the element's
// index in its parameter: [Note: stochastic-rounding keys] in zerokern/quant/philox.py.
template <class V, int K>
inline void philox_lanes(const typename V::I (&group)[K], typename V::I step,
                         const PhiloxKeys<V>& key, typename V::I (&out)[K][4]) {
  using I = typename V::I;
  I c0[K], c1[K], c2[K], c3[K];
  for (int q = 0; q < K; ++q) {
    // Round 1 with c2 = c3 = 0: the c2 product is 0.
    I hi0, lo0;
    V::mulhilo(group[q], 0xD2511F53u, hi0, lo0);
    c0[q] = V::xor_(step, key.k0[0]);
    c1[q] = V::seti(0);
    c2[q] = V::xor_(hi0, key.k1[0]);
    c3[q] = lo0;
  }
  for (int r = 1; r < 10; ++r) {
    for (int q = 0; q < K; ++q) {
      I hi0, lo0, hi1, lo1;
      V::mulhilo(c0[q], 0xD2511F53u, hi0, lo0);
      V::mulhilo(c2[q], 0xCD9E8D57u, hi1, lo1);
      c0[q] = V::xor3(hi1, c1[q], key.k0[r]);
      c2[q] = V::xor3(hi0, c3[q], key.k1[r]);
      c1[q] = lo1;
      c3[q] = lo0;
    }
  }
  for (int q = 0; q < K; ++q) {
    out[q][0] = c0[q];
    out[q][1] = c1[q];
    out[q][2] = c2[q];
    out[q][3] = c3[q];
  }
}

// Format version 2's random bits (zerokern.quant.philox.sr_bits16): element i takes half
// i % 2 of word (i / 2) % 4 of Philox at counter (i / 8, step, 0, 0). Groups [t, G) of a
// block (group t is i / 8 = g0 + t) are written as 4 words each, group after group, so that
// as 16-bit halves (little-endian) the bits of index i sit at position i - 8 * g0.
template <class V>
int64_t fill_sr(uint32_t* w, uint32_t g0, int64_t t, int64_t G, uint32_t step,
                const PhiloxKeys<V>& key) {
  using I = typename V::I;
  const I st = V::seti(step);
  // Groups t .. t + V::N - 1 from their Philox words out[k] (word k of each lane).
  auto put = [&](int64_t t, const I (&out)[4]) {
#ifdef ZK_AVX2
    if constexpr (std::is_same_v<V, L8>) {  // the 4 x 8 transpose in registers
      const __m256i a0 = _mm256_unpacklo_epi32(out[0], out[1]);
      const __m256i a1 = _mm256_unpackhi_epi32(out[0], out[1]);
      const __m256i b0 = _mm256_unpacklo_epi32(out[2], out[3]);
      const __m256i b1 = _mm256_unpackhi_epi32(out[2], out[3]);
      // Groups (0 | 4), (1 | 5), (2 | 6), (3 | 7): 128-bit halves.
      const __m256i r0 = _mm256_unpacklo_epi64(a0, b0), r1 = _mm256_unpackhi_epi64(a0, b0);
      const __m256i r2 = _mm256_unpacklo_epi64(a1, b1), r3 = _mm256_unpackhi_epi64(a1, b1);
      __m256i* d = reinterpret_cast<__m256i*>(w + 4 * t);
      _mm256_storeu_si256(d, _mm256_permute2x128_si256(r0, r1, 0x20));
      _mm256_storeu_si256(d + 1, _mm256_permute2x128_si256(r2, r3, 0x20));
      _mm256_storeu_si256(d + 2, _mm256_permute2x128_si256(r0, r1, 0x31));
      _mm256_storeu_si256(d + 3, _mm256_permute2x128_si256(r2, r3, 0x31));
      return;
    }
#endif
    alignas(64) uint32_t tmp[4][V::N];
    for (int k = 0; k < 4; ++k) V::st_u32(tmp[k], out[k]);
    for (int l = 0; l < V::N; ++l)
      for (int k = 0; k < 4; ++k) w[4 * (t + l) + k] = tmp[k][l];
  };
  if constexpr (V::N > 1) {
    for (; t + 2 * V::N <= G; t += 2 * V::N) {
      const I grp[2] = {V::iota(g0 + uint32_t(t)), V::iota(g0 + uint32_t(t + V::N))};
      I out[2][4];
      philox_lanes<V, 2>(grp, st, key, out);
      put(t, out[0]);
      put(t + V::N, out[1]);
    }
  }
  for (; t + V::N <= G; t += V::N) {
    const I grp[1] = {V::iota(g0 + uint32_t(t))};
    I out[1][4];
    philox_lanes<V, 1>(grp, st, key, out);
    put(t, out[0]);
  }
  return t;
}

// -- format version 3: computed maps (zerokern.quant.fmt_v3) ----------------------------------
// A code's value is assembled from its bits and a normalised value's code is a few integer
// operations on its pattern: a magnitude q in 1..127 (signed map, code 128 +- q) or 1..255
// (unsigned map, code q) means the fp32 pattern (q + bias) << 20: 3 mantissa bits, the top q
// exactly 1.0; q = 0 is 0. Rounding the pattern at bit 20 rounds to the nearest value (ties
// away from zero). No table, no search: about 8 integer operations each way per 8 lanes.
constexpr uint32_t kV3SignedBias = 889, kV3UnsignedBias = 761, kV3Half = 1u << 19;

template <class V>
inline typename V::F v3_decode_signed(typename V::I c) {
  const auto k = V::sub(c, V::seti(128));
  const auto a = V::absi(k);
  const auto mag = V::signi(V::template sll<20>(V::add(a, V::seti(kV3SignedBias))), a);
  return V::as_f(V::or_(mag, V::and_(k, V::seti(0x80000000u))));
}

template <class V>
inline typename V::F v3_decode_unsigned(typename V::I c) {
  return V::as_f(V::signi(V::template sll<20>(V::add(c, V::seti(kV3UnsignedBias))), c));
}

// Codes of finite n (a NaN n is coded apart, by the scalar path: see run_blocks).
template <class V>
inline typename V::I v3_encode_signed(typename V::F n) {
  const auto u = V::bits(n);
  const auto a = V::and_(u, V::seti(0x7FFFFFFFu));
  auto q = V::sub(V::template srl<20>(V::add(a, V::seti(kV3Half))), V::seti(kV3SignedBias));
  q = V::mini(V::maxi(q, V::seti(0)), V::seti(127));
  return V::add(V::signi(q, u), V::seti(128));  // u == 0 only for n = +0, where q = 0
}

template <class V>
inline typename V::I v3_encode_unsigned(typename V::F n) {
  const auto w = V::maxi(V::bits(n), V::seti(0));  // negative patterns (-0 too) code as 0
  const auto q = V::sub(V::template srl<20>(V::add(w, V::seti(kV3Half))), V::seti(kV3UnsignedBias));
  return V::mini(V::maxi(q, V::seti(0)), V::seti(255));
}

#ifdef ZK_AVX2
// Version 3 in 16-bit lanes, 16 elements per instruction instead of 8 (AVX2; the int8 step
// is bound by its instruction count there, not by one unit). Both directions need only the
// top 16 bits of an fp32 pattern: decoding makes (q + bias) << 20, whose low 16 bits are 0;
// encoding rounds at bit 20, and (a + 2^19) >> 20 == ((a >> 16) + 8) >> 4 because the low 16
// bits of a (< 2^16) cannot carry past bit 19 once the half is added.

// 32 codes in two 16-bit-lane vectors in packus order (elements [0-3, 8-11 | 4-7, 12-15] and
// 16 on likewise) as 32 bytes in element order: one more pack, one permute.
inline void store_codes16x2(uint8_t* p, __m256i a, __m256i b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permutevar8x32_epi32(_mm256_packus_epi16(a, b),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The top halves of x0's and x1's patterns (elements 0-7 and 8-15) as 16-bit lanes, in the
// order [0-3, 8-11 | 4-7, 12-15] that packus gives (store_codes16x2 undoes it).
inline __m256i hi16_pack(__m256 x0, __m256 x1) {
  return _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(x0), 16),
                             _mm256_srli_epi32(_mm256_castps_si256(x1), 16));
}

// v3_encode_signed / v3_encode_unsigned of 16 finite values from their top halves h.
inline __m256i v3_code16_signed(__m256i h) {
  const __m256i a = _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF));
  __m256i q = _mm256_sub_epi16(_mm256_srli_epi16(_mm256_add_epi16(a, _mm256_set1_epi16(8)), 4),
                               _mm256_set1_epi16(int16_t(kV3SignedBias)));
  q = _mm256_min_epi16(_mm256_max_epi16(q, _mm256_setzero_si256()), _mm256_set1_epi16(127));
  // h == 0 only for n = +0 or below 2^-126, where q = 0 already.
  return _mm256_add_epi16(_mm256_sign_epi16(q, h), _mm256_set1_epi16(128));
}

inline __m256i v3_code16_unsigned(__m256i h) {
  const __m256i w = _mm256_max_epi16(h, _mm256_setzero_si256());  // sign set (-0 too): 0
  const __m256i q = _mm256_sub_epi16(
      _mm256_srli_epi16(_mm256_add_epi16(w, _mm256_set1_epi16(8)), 4),
      _mm256_set1_epi16(int16_t(kV3UnsignedBias)));
  return _mm256_min_epi16(_mm256_max_epi16(q, _mm256_setzero_si256()), _mm256_set1_epi16(255));
}

// 16 codes at p, widened to 16-bit lanes in the order [0-3, 8-11 | 4-7, 12-15], so that
// unpacking them below each zero half gives elements 0-7, then 8-15.
inline __m256i ld_codes16(const uint8_t* p) {
  return _mm256_permute4x64_epi64(
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 0xD8);
}

// Patterns h << 16 of the 16-bit lanes h (ld_codes16's order): elements 0-7, then 8-15.
inline void widen_hi16(__m256i h, __m256& lo, __m256& hi) {
  const __m256i z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}

// v3_decode_signed / v3_decode_unsigned of 16 codes at p: the map values, fp32.
inline void v3_decode16_signed(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i k = _mm256_sub_epi16(ld_codes16(p), _mm256_set1_epi16(128));
  const __m256i a = _mm256_abs_epi16(k);
  const __m256i mag = _mm256_sign_epi16(
      _mm256_slli_epi16(_mm256_add_epi16(a, _mm256_set1_epi16(int16_t(kV3SignedBias))), 4), a);
  widen_hi16(_mm256_or_si256(mag, _mm256_and_si256(k, _mm256_set1_epi16(int16_t(0x8000)))), lo,
             hi);
}

inline void v3_decode16_unsigned(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i c = ld_codes16(p);
  widen_hi16(_mm256_sign_epi16(
                 _mm256_slli_epi16(_mm256_add_epi16(c, _mm256_set1_epi16(int16_t(kV3UnsignedBias))), 4),
                 c),
             lo, hi);
}
#endif

// One block's codes, V::N at a time: n = x * r, then the code, written as bytes.
template <class V>
int64_t v3_code_lanes(const float* mb, const float* vb, float m_r, float v_r, uint8_t* mc,
                      uint8_t* vc, int64_t j, int64_t L) {
  const auto mr = V::set1(m_r), vr = V::set1(v_r);
#ifdef ZK_AVX2
  if constexpr (std::is_same_v<V, L8>) {  // one 32-byte store per 32 codes, not four
    for (; j + 32 <= L; j += 32) {  // 16-bit lanes: half the integer instructions
      __m256i cm[2], cv[2];
      for (int q = 0; q < 2; ++q) {
        const float* m = mb + j + 16 * q;
        const float* v = vb + j + 16 * q;
        cm[q] = v3_code16_signed(hi16_pack(V::mul(V::ld(m), mr), V::mul(V::ld(m + 8), mr)));
        cv[q] = v3_code16_unsigned(hi16_pack(V::mul(V::ld(v), vr), V::mul(V::ld(v + 8), vr)));
      }
      store_codes16x2(mc + j, cm[0], cm[1]);
      store_codes16x2(vc + j, cv[0], cv[1]);
    }
  }
#endif
  for (; j + V::N <= L; j += V::N) {
    V::st_u8(mc + j, v3_encode_signed<V>(V::mul(V::ld(mb + j), mr)));
    V::st_u8(vc + j, v3_encode_unsigned<V>(V::mul(V::ld(vb + j), vr)));
  }
  return j;
}

constexpr bool is_u8(MomentFmt f) { return f == MomentFmt::U8 || f == MomentFmt::U8V3; }
// The formats whose update takes kernel_contract.fold_bias_correction's scalars (bf16 moments
// and int8 version 3): bc2_sqrt == 1, so the kernel skips that division (cpu_lanes.h, FOLDED).
constexpr bool folded(MomentFmt f) { return f == MomentFmt::BF16 || f == MomentFmt::U8V3; }

// -- the kernel --------------------------------------------------------------------------------

// What the param is and where it goes.
enum class PMode : int { F32 = 0, F32_LPBF16 = 1, F32_LPF16 = 2, BF16_SR = 3 };

struct Ctx {
  void* param;
  const void* grad;
  void* m;
  void* v;
  float* m_absmax;
  float* v_absmax;
  void* lp;
  const int64_t* sr_index;
  uint32_t k0, k1, step;
  const float* tables;
  const Derived* words;  // U8 only
  AdamScalars s;
  int64_t n;
};

// Stochastic rounding of p to bf16 with the low 16 bits of r (zerokern.quant.rounding):
// magnitude + r truncated, finite values saturating at the largest finite bf16, the sign
// kept, NaN -> 0x7FC0.
template <class V>
inline typename V::I sr_bf16(typename V::F p, typename V::I r) {
  using I = typename V::I;
  const I u = V::bits(p);
  const I mag = V::and_(u, V::seti(0x7FFFFFFFu));
  const I sign = V::template srl<16>(V::and_(u, V::seti(0x80000000u)));
  I out = V::template srl<16>(V::add(mag, V::and_(r, V::seti(0xFFFFu))));
  const I fin = V::or_(V::minu(out, V::seti(0x7F7Fu)), sign);
  out = V::seli(V::ieq(mag, V::seti(0x7F800000u)), V::or_(V::seti(0x7F80u), sign),
                V::seti(0x7FC0u));
  return V::seli(V::ilt(mag, V::seti(0x7F800000u)), fin, out);
}

// Code of one n from the lookup words: word[top 16 bits] + low 16 bits (flipped for n < 0),
// shifted down (code_lanes below does the same V::N at a time).
inline uint32_t quantize1(const int32_t* words, float x) {
  const uint32_t u = float_to_bits(x);
  return (uint32_t(words[u >> 16]) + L1::low16_flip(u)) >> 16;
}

// Sweep 1 over elements [j, L) of the block at i0, V::N at a time; returns where it stopped.
// 8-bit moments land in mb/vb with their running absmax patterns in am/av and the running
// maximum of their patterns as signed integers in pm/pv (for the scale's sign).
template <class V, typename G, PMode PM, MomentFmt MF, bool LERP_LOW>
int64_t sweep_update(const Ctx& c, int64_t i0, int64_t j, int64_t L, float m_scale,
                     float v_scale, float* mb, float* vb, float* pb, const uint16_t* sr,
                     uint32_t& am,
                     uint32_t& av, int32_t& pm, int32_t& pv) {
  using F = typename V::F;
  using I = typename V::I;
  const AdamCoeffs<V> k(c.s);
  const F msc = V::set1(m_scale), vsc = V::set1(v_scale);
  const I abs_mask = V::seti(0x7FFFFFFFu);
  I acc_m = V::seti(0), acc_v = V::seti(0);
  I acc_pm = V::seti(0x80000000u), acc_pv = V::seti(0x80000000u);
  // Local copies: the stores below may alias anything, so members of c would be reloaded.
  const G* const g = static_cast<const G*>(c.grad);
  void* const param = c.param;
  void* const m = c.m;
  void* const v = c.v;
  // The update of the V::N elements at jj whose moments are already widened to mi, vi
  // (updated in place): the new param, not yet stored.
  auto update = [&](int64_t jj, F& mi, F& vi) {
    const int64_t i = i0 + jj;
    F pi;
    if constexpr (PM == PMode::BF16_SR) {
      pi = V::template ldt<BF16>(static_cast<const BF16*>(param) + i);
    } else {
      pi = V::ld(static_cast<const float*>(param) + i);
    }
    adam_update<V, LERP_LOW, folded(MF)>(k, V::template ldt<G>(g + i), pi, mi, vi);
    return pi;
  };
  // 8-bit moments go to the block buffers, their maxima tracked.
  auto buffer = [&](int64_t jj, F mi, F vi) {
    V::st(mb + jj, mi);
    V::st(vb + jj, vi);
    acc_m = V::maxu(acc_m, V::and_(V::bits(mi), abs_mask));
    acc_v = V::maxu(acc_v, V::and_(V::bits(vi), abs_mask));
    if constexpr (MF == MomentFmt::U8) {  // version 3's scale is the absmax: no sign
      acc_pm = V::maxi(acc_pm, V::bits(mi));
      acc_pv = V::maxi(acc_pv, V::bits(vi));
    }
  };
  // The stores of one chunk. 16-bit results (the param's copy or its stochastic rounding,
  // bf16 moments) go to the block buffers (the fp32 param to itself) first and are rounded by
  // finish_lanes.
  auto put = [&](int64_t jj, F pi, F mi, F vi) {
    const int64_t i = i0 + jj;
    if constexpr (PM == PMode::BF16_SR) {
      V::st(pb + jj, pi);
    } else {
      V::st(static_cast<float*>(param) + i, pi);
    }
    if constexpr (MF == MomentFmt::F32) {
      V::st(static_cast<float*>(m) + i, mi);
      V::st(static_cast<float*>(v) + i, vi);
    } else if constexpr (MF == MomentFmt::BF16) {
      V::st(mb + jj, mi);
      V::st(vb + jj, vi);
    } else {
      buffer(jj, mi, vi);
    }
  };
  auto put2 = [&](int64_t jj, F p0, F m0, F v0, F p1, F m1, F v1) {
    put(jj, p0, m0, v0);
    put(jj + V::N, p1, m1, v1);
  };
  auto body = [&](int64_t jj, F mi, F vi) {
    const F pi = update(jj, mi, vi);
    put(jj, pi, mi, vi);
  };
  // The moments of the V::N elements at jj, widened to fp32.
  auto load_moments = [&](int64_t jj, F& mi, F& vi) {
    const int64_t i = i0 + jj;
    if constexpr (MF == MomentFmt::F32) {
      mi = V::ld(static_cast<const float*>(m) + i);
      vi = V::ld(static_cast<const float*>(v) + i);
    } else if constexpr (MF == MomentFmt::BF16) {
      mi = V::template ldt<BF16>(static_cast<const BF16*>(m) + i);
      vi = V::template ldt<BF16>(static_cast<const BF16*>(v) + i);
    } else if constexpr (MF == MomentFmt::U8V3) {
      mi = V::mul(v3_decode_signed<V>(V::ld_u8(static_cast<const uint8_t*>(m) + i)), msc);
      vi = V::mul(v3_decode_unsigned<V>(V::ld_u8(static_cast<const uint8_t*>(v) + i)), vsc);
    } else {
      mi = V::mul(V::lut(c.tables + kSignedMap, static_cast<const uint8_t*>(m) + i), msc);
      vi = V::mul(V::lut(c.tables + kUnsignedMap, static_cast<const uint8_t*>(v) + i), vsc);
    }
  };
#ifdef ZK_VBMI
  if constexpr (MF == MomentFmt::U8 && std::is_same_v<V, L16>) {
    // 64 codes at a time through byte-table permutes: unlike gathers, they overlap with the
    // divisions and square roots that bound this loop.
    const Derived& dw = *c.words;
    for (; j + 64 <= L; j += 64) {
      __m512 mq[4], vq[4];
      dequant64(static_cast<const uint8_t*>(m) + i0 + j, dw.planes[0], mq);
      dequant64(static_cast<const uint8_t*>(v) + i0 + j, dw.planes[1], vq);
      for (int q = 0; q < 4; ++q) body(j + 16 * q, V::mul(mq[q], msc), V::mul(vq[q], vsc));
    }
  }
#endif
  for (; j + 2 * V::N <= L; j += 2 * V::N) {
    F m0, v0, m1, v1;
#ifdef ZK_AVX2
    if constexpr (MF == MomentFmt::U8V3 && std::is_same_v<V, L8>) {  // 16 codes at a time
      v3_decode16_signed(static_cast<const uint8_t*>(m) + i0 + j, m0, m1);
      v3_decode16_unsigned(static_cast<const uint8_t*>(v) + i0 + j, v0, v1);
      m0 = V::mul(m0, msc);
      m1 = V::mul(m1, msc);
      v0 = V::mul(v0, vsc);
      v1 = V::mul(v1, vsc);
    } else
#endif
    {
      load_moments(j, m0, v0);
      load_moments(j + V::N, m1, v1);
    }
    const F p0 = update(j, m0, v0);
    const F p1 = update(j + V::N, m1, v1);
    put2(j, p0, m0, v0, p1, m1, v1);
  }
  for (; j + V::N <= L; j += V::N) {
    F mi, vi;
    load_moments(j, mi, vi);
    body(j, mi, vi);
  }
  if constexpr (is_u8(MF)) {
    am = std::max(am, V::hmax(acc_m));
    av = std::max(av, V::hmax(acc_v));
    pm = std::max(pm, V::hmaxi(acc_pm));
    pv = std::max(pv, V::hmaxi(acc_pv));
  }
  return j;
}

// Sweep 2 (8-bit moments), n = x * r (format version 2: one reciprocal per block,
// zerokern.quant.blockwise), in two passes over the block buffered in L1:
//   a. n = x * r in place, V::N at a time;
//   b. code = (word + low half, flipped for n < 0) >> 16, the word looked up by n's top 16
//      bits (V::lut_hi16), V::N at a time, stored as bytes.
template <class V>
int64_t normalise_lanes(float* mb, float* vb, float m_r, float v_r, int64_t j, int64_t L) {
  using F = typename V::F;
  const F mr = V::set1(m_r), vr = V::set1(v_r);
  for (; j + V::N <= L; j += V::N) {
    V::st(mb + j, V::mul(V::ld(mb + j), mr));
    V::st(vb + j, V::mul(V::ld(vb + j), vr));
  }
  return j;
}

template <class V>
int64_t code_lanes(const Derived& dw, const float* mb, const float* vb, uint8_t* mc,
                   uint8_t* vc, int64_t j, int64_t L) {
  const int32_t* tm = dw.m.words.data();
  const int32_t* tv = dw.v.words.data();
  for (; j + V::N <= L; j += V::N) {
    const auto um = V::bits(V::ld(mb + j)), uv = V::bits(V::ld(vb + j));
    V::st_u8(mc + j, V::template srl<16>(V::add(V::lut_hi16(tm, mb + j), V::low16_flip(um))));
    V::st_u8(vc + j, V::template srl<16>(V::add(V::lut_hi16(tv, vb + j), V::low16_flip(uv))));
  }
  return j;
}

// The signed scale of a block (zerokern.quant.blockwise.block_scales) from the maximum of its
// magnitude patterns (`amag`) and of its patterns as signed integers (`imax`): +A when some
// element is +A (its pattern is then the largest non-negative one), else -A; NaN as is.
inline float block_scale(uint32_t amag, int32_t imax) {
  if (amag > 0x7F800000u || amag == 0 || imax == int32_t(amag)) return bits_to_float(amag);
  return bits_to_float(amag | 0x80000000u);
}

// How a block's values are normalised: n = x * r when 2^-126 <= |d| < 2^126 (r = 1 / d, one
// division per block), else n = x / d (d = the scale, 1 for a zero scale).
struct Norm {
  float d, r;
  bool recip;
  explicit Norm(float scale) {
    d = scale == 0.0f ? 1.0f : scale;
    const float a = std::fabs(d);
    recip = a >= 0x1p-126f && a < 0x1p126f;
    r = 1.0f / d;
  }
  float operator()(float x) const { return recip ? x * r : x / d; }
};

// The 16-bit stores of a block that sweep 1 left in fp32 (its put): the param's 16-bit copy
// from the fp32 param, or its stochastic rounding from pb, and bf16 moments from mb, vb; two
// chunks at a time where AVX2 packs 16 lanes per store. Apart from sweep 1 because its
// integer rounding would wait in the out-of-order window for the last division of each chunk
// and starve the divider (Zen 3, 1 thread, in L1: bf16 moments 1.33 -> 1.20 ns per element;
// rounding each chunk a few chunks behind its update, in the same loop, measured slower).
template <class V, PMode PM, MomentFmt MF>
int64_t finish_lanes(const Ctx& c, int64_t i0, int64_t j, int64_t L, const float* mb,
                     const float* vb, const float* pb, const uint16_t* sr) {
  constexpr int N = V::N;
  for (; j + 2 * N <= L; j += 2 * N) {
    const int64_t i = i0 + j;
    if constexpr (PM == PMode::BF16_SR) {
      V::st_u16x2(static_cast<uint16_t*>(c.param) + i, sr_bf16<V>(V::ld(pb + j), V::ld_u16(sr + j)),
                  sr_bf16<V>(V::ld(pb + j + N), V::ld_u16(sr + j + N)));
    } else if constexpr (PM == PMode::F32_LPBF16 || PM == PMode::F32_LPF16) {
      using LP = std::conditional_t<PM == PMode::F32_LPBF16, BF16, F16>;
      const float* p = static_cast<const float*>(c.param) + i;
      V::template stt2<LP>(static_cast<LP*>(c.lp) + i, V::ld(p), V::ld(p + N));
    }
    if constexpr (MF == MomentFmt::BF16) {
      V::template stt2<BF16>(static_cast<BF16*>(c.m) + i, V::ld(mb + j), V::ld(mb + j + N));
      V::template stt2<BF16>(static_cast<BF16*>(c.v) + i, V::ld(vb + j), V::ld(vb + j + N));
    }
  }
  for (; j + N <= L; j += N) {
    const int64_t i = i0 + j;
    if constexpr (PM == PMode::BF16_SR) {
      V::st_u16(static_cast<uint16_t*>(c.param) + i, sr_bf16<V>(V::ld(pb + j), V::ld_u16(sr + j)));
    } else if constexpr (PM == PMode::F32_LPBF16 || PM == PMode::F32_LPF16) {
      using LP = std::conditional_t<PM == PMode::F32_LPBF16, BF16, F16>;
      const float* p = static_cast<const float*>(c.param) + i;
      V::template stt<LP>(static_cast<LP*>(c.lp) + i, V::ld(p));
    }
    if constexpr (MF == MomentFmt::BF16) {
      V::template stt<BF16>(static_cast<BF16*>(c.m) + i, V::ld(mb + j));
      V::template stt<BF16>(static_cast<BF16*>(c.v) + i, V::ld(vb + j));
    }
  }
  return j;
}

template <typename G, PMode PM, MomentFmt MF, bool LERP_LOW>
void run_blocks(const Ctx& c, int64_t b_begin, int64_t b_end) {
  alignas(64) float mb[kBlock];
  alignas(64) float vb[kBlock];
  alignas(64) float pb[kBlock];
  // 16 random bits per element: up to 33 Philox groups of 8 elements cover a block.
  alignas(64) uint32_t srw[4 * 40] = {};  // (initialised: GCC cannot see fill_sr write it)
  const uint16_t* sr = nullptr;
  // (Built for every mode; only BF16_SR reads them: a few dozen stores per call.)
  const PhiloxKeys<L1> key1(c.k0, c.k1);
#ifdef ZK_AVX512
  const PhiloxKeys<L16> key16(c.k0, c.k1);
#endif
#ifdef ZK_AVX2
  const PhiloxKeys<L8> key8(c.k0, c.k1);
#endif
  for (int64_t b = b_begin; b < b_end; ++b) {
    const int64_t i0 = b * kBlock, L = std::min(kBlock, c.n - i0);
    if constexpr (PM == PMode::BF16_SR) {
      const uint32_t base = uint32_t(c.sr_index[b]);
      const uint32_t g0 = base >> 3;
      const int64_t ng = int64_t((base + uint32_t(L) - 1) >> 3) - int64_t(g0) + 1;
      int64_t t = 0;
#ifdef ZK_AVX512
      t = fill_sr<L16>(srw, g0, t, ng, c.step, key16);
#endif
#ifdef ZK_AVX2
      t = fill_sr<L8>(srw, g0, t, ng, c.step, key8);
#endif
      fill_sr<L1>(srw, g0, t, ng, c.step, key1);
      sr = reinterpret_cast<const uint16_t*>(srw) + (base & 7u);
    }
    float m_scale = 0.0f, v_scale = 0.0f;
    if constexpr (is_u8(MF)) {
      m_scale = c.m_absmax[b];
      v_scale = c.v_absmax[b];
    }
    uint32_t am = 0, av = 0;
    int32_t pm = INT32_MIN, pv = INT32_MIN;
    int64_t j = 0;
#ifdef ZK_AVX512
    j = sweep_update<L16, G, PM, MF, LERP_LOW>(c, i0, j, L, m_scale, v_scale, mb, vb, pb, sr,
                                               am, av, pm, pv);
#endif
#ifdef ZK_AVX2
    j = sweep_update<L8, G, PM, MF, LERP_LOW>(c, i0, j, L, m_scale, v_scale, mb, vb, pb, sr,
                                              am, av, pm, pv);
#endif
    sweep_update<L1, G, PM, MF, LERP_LOW>(c, i0, j, L, m_scale, v_scale, mb, vb, pb, sr, am, av,
                                          pm, pv);
    if constexpr (PM != PMode::F32 || MF == MomentFmt::BF16) {
      j = 0;
#ifdef ZK_AVX512
      j = finish_lanes<L16, PM, MF>(c, i0, j, L, mb, vb, pb, sr);
#endif
#ifdef ZK_AVX2
      j = finish_lanes<L8, PM, MF>(c, i0, j, L, mb, vb, pb, sr);
#endif
      finish_lanes<L1, PM, MF>(c, i0, j, L, mb, vb, pb, sr);
    }
    if constexpr (MF == MomentFmt::U8V3) {
      // The absmax (NaN: the largest NaN pattern, sign cleared). A NaN or inf element makes
      // it non-finite, which takes the scalar path: so the lanes only ever see finite n.
      const float ms = bits_to_float(am), vs = bits_to_float(av);
      c.m_absmax[b] = ms;
      c.v_absmax[b] = vs;
      const Norm mn(ms), vn(vs);
      uint8_t* mc = static_cast<uint8_t*>(c.m) + i0;
      uint8_t* vc = static_cast<uint8_t*>(c.v) + i0;
      if (mn.recip && vn.recip) {
        j = 0;
#ifdef ZK_AVX512
        j = v3_code_lanes<L16>(mb, vb, mn.r, vn.r, mc, vc, j, L);
#endif
#ifdef ZK_AVX2
        j = v3_code_lanes<L8>(mb, vb, mn.r, vn.r, mc, vc, j, L);
#endif
        v3_code_lanes<L1>(mb, vb, mn.r, vn.r, mc, vc, j, L);
      } else {
        for (int64_t k = 0; k < L; ++k) {
          const float nm = mn(mb[k]), nv = vn(vb[k]);
          mc[k] = std::isnan(nm) ? 128 : uint8_t(v3_encode_signed<L1>(nm));
          vc[k] = std::isnan(nv) ? 0 : uint8_t(v3_encode_unsigned<L1>(nv));
        }
      }
    }
    if constexpr (MF == MomentFmt::U8) {
      const float ms = block_scale(am, pm), vs = block_scale(av, pv);
      c.m_absmax[b] = ms;
      c.v_absmax[b] = vs;
      const Norm mn(ms), vn(vs);
      uint8_t* mc = static_cast<uint8_t*>(c.m) + i0;
      uint8_t* vc = static_cast<uint8_t*>(c.v) + i0;
      const Derived& dw = *c.words;
      if (dw.m.ok && dw.v.ok && mn.recip && vn.recip) {
        j = 0;
#ifdef ZK_AVX512
        j = normalise_lanes<L16>(mb, vb, mn.r, vn.r, j, L);
#endif
#ifdef ZK_AVX2
        j = normalise_lanes<L8>(mb, vb, mn.r, vn.r, j, L);
#endif
        normalise_lanes<L1>(mb, vb, mn.r, vn.r, j, L);
        j = 0;
#ifdef ZK_AVX512
        j = code_lanes<L16>(dw, mb, vb, mc, vc, j, L);
#endif
#ifdef ZK_AVX2
        j = code_lanes<L8>(dw, mb, vb, mc, vc, j, L);
#endif
        code_lanes<L1>(dw, mb, vb, mc, vc, j, L);
      } else {  // a scale outside the reciprocal's range, or a table without lookup words
        for (int64_t k = 0; k < L; ++k) {
          const float nm = mn(mb[k]), nv = vn(vb[k]);
          mc[k] = uint8_t(dw.m.ok ? quantize1(dw.m.words.data(), nm)
                                  : code_exact(c.tables + kSignedThr, dw.m.sorted, nm));
          vc[k] = uint8_t(dw.v.ok ? quantize1(dw.v.words.data(), nv)
                                  : code_exact(c.tables + kUnsignedThr, dw.v.sorted, nv));
        }
      }
    }
  }
}

template <typename G, PMode PM, MomentFmt MF, bool LERP_LOW>
void launch(const Ctx& c) {
  const int64_t nb = (c.n + kBlock - 1) / kBlock;
  if (c.n < kParallelMin) {
    run_blocks<G, PM, MF, LERP_LOW>(c, 0, nb);
    return;
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = (nb + nt - 1) / nt;
    const int64_t b = std::min(nb, t * per), e = std::min(nb, b + per);
    run_blocks<G, PM, MF, LERP_LOW>(c, b, e);
  }
}

template <typename G, PMode PM, MomentFmt MF>
void pick_lerp(const Ctx& c) {
  if (c.s.one_minus_beta1 < 0.5f) return launch<G, PM, MF, true>(c);
  return launch<G, PM, MF, false>(c);
}

template <typename G, PMode PM>
void pick_moments(const Ctx& c, MomentFmt mf) {
  switch (mf) {
    case MomentFmt::F32: return pick_lerp<G, PM, MomentFmt::F32>(c);
    case MomentFmt::BF16: return pick_lerp<G, PM, MomentFmt::BF16>(c);
    case MomentFmt::U8: return pick_lerp<G, PM, MomentFmt::U8>(c);
    case MomentFmt::U8V3: return pick_lerp<G, PM, MomentFmt::U8V3>(c);
  }
  throw std::invalid_argument("adamw_compressed_cpu: unknown moment format");
}

template <typename G>
void pick_param(const Ctx& c, PMode pm, MomentFmt mf) {
  switch (pm) {
    case PMode::F32: return pick_moments<G, PMode::F32>(c, mf);
    case PMode::F32_LPBF16: return pick_moments<G, PMode::F32_LPBF16>(c, mf);
    case PMode::F32_LPF16: return pick_moments<G, PMode::F32_LPF16>(c, mf);
    case PMode::BF16_SR: return pick_moments<G, PMode::BF16_SR>(c, mf);
  }
  throw std::invalid_argument("adamw_compressed_cpu: unknown param mode");
}

}  // namespace

void adamw_compressed_cpu(const CompressedArgs& a, const AdamScalars& s) {
  if (a.n <= 0) return;
  PMode pm;
  if (a.pdt == DType::BF16) {
    if (a.param_lp != nullptr)
      throw std::invalid_argument("adamw_compressed_cpu: param_lp needs an fp32 param");
    if (a.sr_index == nullptr)
      throw std::invalid_argument("adamw_compressed_cpu: a bf16 param needs sr_index");
    pm = PMode::BF16_SR;
  } else if (a.pdt == DType::F32) {
    if (a.param_lp == nullptr) pm = PMode::F32;
    else if (a.lpdt == DType::BF16) pm = PMode::F32_LPBF16;
    else if (a.lpdt == DType::F16) pm = PMode::F32_LPF16;
    else throw std::invalid_argument("adamw_compressed_cpu: param_lp must be bf16 or fp16");
  } else {
    throw std::invalid_argument("adamw_compressed_cpu: param must be fp32 or bf16");
  }
  Ctx c{};
  std::shared_ptr<const Derived> words;  // keeps the derived tables alive for this call
  c.param = a.param;
  c.grad = a.grad;
  c.m = a.exp_avg;
  c.v = a.exp_avg_sq;
  c.m_absmax = a.exp_avg_absmax;
  c.v_absmax = a.exp_avg_sq_absmax;
  c.lp = a.param_lp;
  c.sr_index = a.sr_index;
  c.k0 = uint32_t(a.seed);
  c.k1 = uint32_t(a.seed >> 32);
  c.step = a.step;
  c.tables = a.tables;
  c.s = s;
  c.n = a.n;
  if (a.mfmt == MomentFmt::U8) {
    if (a.exp_avg_absmax == nullptr || a.exp_avg_sq_absmax == nullptr || a.tables == nullptr)
      throw std::invalid_argument("adamw_compressed_cpu: 8-bit moments need absmax and tables");
    words = derived_for(a.tables);
    c.words = words.get();
  } else if (a.mfmt == MomentFmt::U8V3) {
    if (a.exp_avg_absmax == nullptr || a.exp_avg_sq_absmax == nullptr)
      throw std::invalid_argument("adamw_compressed_cpu: 8-bit moments need absmax");
  }
  // The kernel skips the division by bc2_sqrt (cpu_lanes.h, FOLDED): only exact with 1.
  if (folded(a.mfmt) && s.bc2_sqrt != 1.0f)
    throw std::invalid_argument("adamw_compressed_cpu: bf16 moments and format version 3 take "
                                "the folded scalars (fold_bias_correction: bc2_sqrt == 1)");
  switch (a.gdt) {
    case DType::F32: return pick_param<float>(c, pm, a.mfmt);
    case DType::BF16: return pick_param<BF16>(c, pm, a.mfmt);
    case DType::F16: return pick_param<F16>(c, pm, a.mfmt);
  }
  throw std::invalid_argument("adamw_compressed_cpu: unsupported grad dtype");
}

}  // namespace zk
