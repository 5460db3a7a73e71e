// 16-bit <-> fp32 conversions for the CPU kernels, done in registers.
// [Note: 16-bit values are rounded to nearest even] in zerokern/ops/adamw.py.
// Scalar versions are exact bit manipulations (round to nearest even, as torch's
// c10::BFloat16 / c10::Half conversions), used for tails and on CPUs without AVX2/F16C.
// The AVX2 versions produce the same bits 8 lanes at a time.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define ZK_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ZK_AVX512 1
#endif
#endif

namespace zk {

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;  // canonical quiet NaN, as torch produces
  uint32_t u = float_to_bits(f);
  uint32_t bias = 0x7FFFu + ((u >> 16) & 1u);  // round half to even
  return uint16_t((u + bias) >> 16);
}

inline float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal: value = man * 2^-24
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7F800000u | (man << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;            // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;           // overflow (>= 65520) -> inf
  if (a < 0x38800000u) {                                 // result subnormal or zero
    // scale into the subnormal grid; float addition rounds to nearest even for us
    float v = bits_to_float(a) + 0.5f;                   // 0.5 = 2^-1: ulp of f16 subnormal scaled
    // f16 subnormal ulp is 2^-24; adding 2^-1 puts the value's 2^-24 bit at float's lsb
    return sign | uint16_t(float_to_bits(v) - float_to_bits(0.5f));
  }
  uint32_t lsb = (a >> 13) & 1u;
  a += 0xC8000FFFu + lsb;  // rebias exponent (-112 << 23) and round half to even
  return sign | uint16_t(a >> 13);
}

template <typename T> struct Scalar;  // load/store of one element as float
template <> struct Scalar<float> {
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
};

struct BF16 { uint16_t x; };
struct F16 { uint16_t x; };
template <> struct Scalar<BF16> {
  static float load(const BF16* p) { return bf16_to_float(p->x); }
  static void store(BF16* p, float v) { p->x = float_to_bf16(v); }
};
template <> struct Scalar<F16> {
  static float load(const F16* p) { return f16_to_float(p->x); }
  static void store(F16* p, float v) { p->x = float_to_f16(v); }
};

#ifdef ZK_AVX2
template <typename T> struct Vec8;
template <> struct Vec8<float> {
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};
// Round to nearest even as integer operations: the bf16 patterns of 8 floats in the low
// halves of their 32-bit lanes (NaN -> 0x7FC0), ready for a saturating pack.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(isnan));
}
// 16 lanes' low halves (each < 65536) as 16 uint16 in one store: the 256-bit pack interleaves
// the 128-bit halves (a.lo, b.lo, a.hi, b.hi) and one qword permute puts them in order (the
// 128-bit pack of each 8, as Vec8 stores them alone, costs an extract and a pack per 8).
inline void store_u16x16(uint16_t* p, __m256i a, __m256i b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
}
template <> struct Vec8<BF16> {
  static __m256 load(const BF16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(BF16* p, __m256 v) {
    const __m256i r = bf16_bits8(v);
    __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  // 16 values: a then b.
  static void store2(BF16* p, __m256 a, __m256 b) {
    store_u16x16(reinterpret_cast<uint16_t*>(p), bf16_bits8(a), bf16_bits8(b));
  }
  // The same with a non-temporal store (p 32-byte aligned; cpu_stream.h says when).
  static void store2_nt(BF16* p, __m256 a, __m256 b) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_permute4x64_epi64(
                            _mm256_packus_epi32(bf16_bits8(a), bf16_bits8(b)), 0xD8));
  }
};
template <> struct Vec8<F16> {
  static __m256 load(const F16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(F16* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store2(F16* p, __m256 a, __m256 b) { store(p, a); store(p + 8, b); }
};
#endif

#ifdef ZK_AVX512
// 16 lanes: the fused AdamW step is close to compute-bound on two cores (two divisions and a
// square root per element), and AVX-512 cuts its instruction count by a quarter.
template <typename T> struct Vec16;
template <> struct Vec16<float> {
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};
template <> struct Vec16<BF16> {
  static __m512 load(const BF16* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store(BF16* p, __m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, isnan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
};
template <> struct Vec16<F16> {
  static __m512 load(const F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(F16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
#endif

}  // namespace zk
