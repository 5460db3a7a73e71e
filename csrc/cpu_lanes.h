// Lanes for the CPU kernels: one algorithm written once as a template over a small "lane"
// interface, implemented for AVX-512 (16 lanes), AVX2 (8 lanes) and plain scalars (1 lane),
// so the paths differ only in the instructions. Also the fp32 AdamW update of kernels.h,
// spelled once for every CPU kernel (adam_cpu.cpp, adam_compressed_cpu.cpp).
//
// Include after `#pragma GCC optimize("fp-contract=off")` (before any other include, so the
// intrinsics' bodies carry the same setting and still inline): GCC's default
// -ffp-contract=fast would fuse, e.g., the gradient's scaling multiply into the following
// subtraction, which rounds once where the contract rounds twice.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_vec.h"
#include "kernels.h"

namespace zk {

// -- lanes -------------------------------------------------------------------------------------
// One lane: the scalar path and the tails. I is the 32-bit pattern, M a lane predicate.
struct L1 {
  static constexpr int N = 1;
  using F = float;
  using I = uint32_t;
  using M = bool;
  static F set1(float x) { return x; }
  static I seti(uint32_t x) { return x; }
  static F ld(const float* p) { return *p; }
  static void st(float* p, F v) { *p = v; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }    // a*b + c, one rounding
  static F fnma(F a, F b, F c) { return std::fma(-a, b, c); }  // c - a*b, one rounding
  static I bits(F a) { return float_to_bits(a); }
  static I and_(I a, I b) { return a & b; }
  static I or_(I a, I b) { return a | b; }
  static I add(I a, I b) { return a + b; }
  static I sub(I a, I b) { return a - b; }
  template <int K> static I srl(I a) { return a >> K; }
  template <int K> static I sll(I a) { return a << K; }
  static F as_f(I a) { return bits_to_float(a); }
  static I maxu(I a, I b) { return std::max(a, b); }
  static I maxi(I a, I b) { return uint32_t(std::max(int32_t(a), int32_t(b))); }
  static I mini(I a, I b) { return uint32_t(std::min(int32_t(a), int32_t(b))); }
  static I absi(I a) { return int32_t(a) < 0 ? 0u - a : a; }
  // a where b > 0, -a where b < 0, 0 where b == 0 (b as a signed integer; x86's psignd).
  static I signi(I a, I b) { return int32_t(b) < 0 ? 0u - a : (b == 0 ? 0u : a); }
  static I minu(I a, I b) { return std::min(a, b); }
  // Low 16 bits of u, complemented when the sign bit is set.
  static I low16_flip(I u) { return (u ^ (u >> 31 ? 0xFFFFu : 0u)) & 0xFFFFu; }
  static M ilt(I a, I b) { return int32_t(a) < int32_t(b); }
  static M ieq(I a, I b) { return a == b; }
  static I seli(M m, I t, I f) { return m ? t : f; }
  // Table lookups: t[codes[k]], and t[top 16 bits of x[k]'s pattern], per lane.
  static F lut(const float* t, const uint8_t* codes) { return t[*codes]; }
  static I lut_hi16(const int32_t* t, const float* x) {
    return uint32_t(t[float_to_bits(*x) >> 16]);
  }
  static I ld_u8(const uint8_t* p) { return *p; }
  static void st_u8(uint8_t* p, I v) { *p = uint8_t(v); }
  static I ld_u32(const uint32_t* p) { return *p; }
  static void st_u16(uint16_t* p, I v) { *p = uint16_t(v); }
  static uint32_t hmax(I v) { return v; }
  static int32_t hmaxi(I v) { return int32_t(v); }
  static I ld_u16(const uint16_t* p) { return *p; }
  static I iota(uint32_t base) { return base; }
  static void st_u32(uint32_t* p, I v) { *p = v; }
  static I xor_(I a, I b) { return a ^ b; }
  static I xor3(I a, I b, I c) { return a ^ b ^ c; }
  // High and low words of the 64-bit product x * m.
  static void mulhilo(I x, uint32_t m, I& hi, I& lo) {
    const uint64_t p = uint64_t(x) * m;
    hi = uint32_t(p >> 32);
    lo = uint32_t(p);
  }
  template <typename T> static F ldt(const T* p) { return Scalar<T>::load(p); }
  template <typename T> static void stt(T* p, F v) { Scalar<T>::store(p, v); }
  // Two chunks at once (a at p, b after it): AVX2 packs 16-bit results with one store.
  template <typename T> static void stt2(T* p, F a, F b) { stt(p, a); stt(p + N, b); }
  static void st_u16x2(uint16_t* p, I a, I b) { st_u16(p, a); st_u16(p + N, b); }
};

#ifdef ZK_AVX2
struct L8 {
  static constexpr int N = 8;
  using F = __m256;
  using I = __m256i;
  using M = __m256i;  // all-ones lanes
  static F set1(float x) { return _mm256_set1_ps(x); }
  static I seti(uint32_t x) { return _mm256_set1_epi32(int32_t(x)); }
  static F ld(const float* p) { return _mm256_loadu_ps(p); }
  static void st(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static I bits(F a) { return _mm256_castps_si256(a); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  template <int K> static I srl(I a) { return _mm256_srli_epi32(a, K); }
  template <int K> static I sll(I a) { return _mm256_slli_epi32(a, K); }
  static F as_f(I a) { return _mm256_castsi256_ps(a); }
  static I maxu(I a, I b) { return _mm256_max_epu32(a, b); }
  static I maxi(I a, I b) { return _mm256_max_epi32(a, b); }
  static I mini(I a, I b) { return _mm256_min_epi32(a, b); }
  static I absi(I a) { return _mm256_abs_epi32(a); }
  static I signi(I a, I b) { return _mm256_sign_epi32(a, b); }
  static I minu(I a, I b) { return _mm256_min_epu32(a, b); }
  static I low16_flip(I u) {
    return _mm256_and_si256(_mm256_xor_si256(u, _mm256_srai_epi32(u, 31)),
                            _mm256_set1_epi32(0xFFFF));
  }
  static M ilt(I a, I b) { return _mm256_cmpgt_epi32(b, a); }
  static M ieq(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static I seli(M m, I t, I f) { return _mm256_blendv_epi8(f, t, m); }
  // Scalar loads assembled into a register: a hardware gather of 8 measured about 20 cycles
  // on Zen 3 (int8 step 3.6 -> 2.3 ns per element, 1 thread, with both lookups so).
  static F lut(const float* t, const uint8_t* c) {
    return _mm256_setr_ps(t[c[0]], t[c[1]], t[c[2]], t[c[3]], t[c[4]], t[c[5]], t[c[6]], t[c[7]]);
  }
  static I lut_hi16(const int32_t* t, const float* x) {
    auto at = [&](int k) { return t[float_to_bits(x[k]) >> 16]; };
    return _mm256_setr_epi32(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
  }
  static I ld_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void st_u8(uint8_t* p, I v) {  // low byte of each lane (values < 256)
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(v, pick);
    const __m256i d = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(d));
  }
  static I ld_u32(const uint32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void st_u16(uint16_t* p, I v) {  // low half of each lane (values < 65536)
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static uint32_t hmax(I v) {
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return uint32_t(_mm_cvtsi128_si32(x));
  }
  static int32_t hmaxi(I v) {
    __m128i x = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_max_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_max_epi32(x, _mm_shuffle_epi32(x, 0xB1));
    return _mm_cvtsi128_si32(x);
  }
  static I ld_u16(const uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I iota(uint32_t base) {
    return _mm256_add_epi32(_mm256_set1_epi32(int32_t(base)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static void st_u32(uint32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I xor3(I a, I b, I c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  static void mulhilo(I x, uint32_t m, I& hi, I& lo) {  // even lanes, then odd lanes
    const __m256i mv = _mm256_set1_epi32(int32_t(m));
    const __m256i pe = _mm256_mul_epu32(x, mv), po = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), mv);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
    // The low words in one multiply (Zen 3: faster than a shift and a blend of the products).
    lo = _mm256_mullo_epi32(x, mv);
  }
  template <typename T> static F ldt(const T* p) { return Vec8<T>::load(p); }
  template <typename T> static void stt(T* p, F v) { Vec8<T>::store(p, v); }
  template <typename T> static void stt2(T* p, F a, F b) { Vec8<T>::store2(p, a, b); }
  static void st_u16x2(uint16_t* p, I a, I b) { store_u16x16(p, a, b); }
};
#endif

#ifdef ZK_AVX512
struct L16 {
  static constexpr int N = 16;
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static I seti(uint32_t x) { return _mm512_set1_epi32(int32_t(x)); }
  static F ld(const float* p) { return _mm512_loadu_ps(p); }
  static void st(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static I bits(F a) { return _mm512_castps_si512(a); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  template <int K> static I srl(I a) { return _mm512_srli_epi32(a, K); }
  template <int K> static I sll(I a) { return _mm512_slli_epi32(a, K); }
  static F as_f(I a) { return _mm512_castsi512_ps(a); }
  static I maxu(I a, I b) { return _mm512_max_epu32(a, b); }
  static I maxi(I a, I b) { return _mm512_max_epi32(a, b); }
  static I mini(I a, I b) { return _mm512_min_epi32(a, b); }
  static I absi(I a) { return _mm512_abs_epi32(a); }
  static I signi(I a, I b) {  // AVX-512 has no psignd: two masked moves
    const __m512i z = _mm512_setzero_si512();
    const __m512i r = _mm512_mask_sub_epi32(a, _mm512_cmplt_epi32_mask(b, z), z, a);
    return _mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(b, z), z);
  }
  static I minu(I a, I b) { return _mm512_min_epu32(a, b); }
  static I low16_flip(I u) {  // (u ^ (u >> 31 arithmetic)) & 0xFFFF in one ternary op
    return _mm512_ternarylogic_epi32(u, _mm512_srai_epi32(u, 31), _mm512_set1_epi32(0xFFFF),
                                     0x28);
  }
  static M ilt(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  static M ieq(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static I seli(M m, I t, I f) { return _mm512_mask_blend_epi32(m, f, t); }
  // Gathers here, as measured on the Xeon of issue 39 (AVX-512 VBMI decodes whole chunks with
  // permutes instead, dequant64); whether scalar loads beat them there is not measured.
  static F lut(const float* t, const uint8_t* c) {
    return _mm512_i32gather_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))), t, 4);
  }
  static I lut_hi16(const int32_t* t, const float* x) {
    return _mm512_i32gather_epi32(_mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(x)), 16),
                                  t, 4);
  }
  static I ld_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void st_u8(uint8_t* p, I v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
  static I ld_u32(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static void st_u16(uint16_t* p, I v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
  }
  static uint32_t hmax(I v) { return uint32_t(_mm512_reduce_max_epu32(v)); }
  static int32_t hmaxi(I v) { return _mm512_reduce_max_epi32(v); }
  static I ld_u16(const uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I iota(uint32_t base) {
    return _mm512_add_epi32(_mm512_set1_epi32(int32_t(base)),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static void st_u32(uint32_t* p, I v) { _mm512_storeu_si512(p, v); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I xor3(I a, I b, I c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
  static void mulhilo(I x, uint32_t m, I& hi, I& lo) {  // even lanes, then odd lanes
    const __m512i mv = _mm512_set1_epi32(int32_t(m));
    const __m512i pe = _mm512_mul_epu32(x, mv), po = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), mv);
    hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe, 32), po);
    // (A shift and a blend, not vpmulld: two uops with a 10-cycle latency on Intel.)
    lo = _mm512_mask_blend_epi32(0xAAAA, pe, _mm512_slli_epi64(po, 32));
  }
  template <typename T> static F ldt(const T* p) { return Vec16<T>::load(p); }
  template <typename T> static void stt(T* p, F v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    // The BF16 extension's conversion rounds to nearest even in one instruction but treats
    // subnormal inputs as zero: only vectors without subnormals take it.
    if constexpr (std::is_same_v<T, BF16>) {
      if (_mm512_fpclass_ps_mask(v, 0x20) == 0) {
        const __m256bh r = _mm512_cvtneps_pbh(v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(r));
        return;
      }
    }
#endif
    Vec16<T>::store(p, v);
  }
  template <typename T> static void stt2(T* p, F a, F b) { stt(p, a); stt(p + N, b); }
  static void st_u16x2(uint16_t* p, I a, I b) { st_u16(p, a); st_u16(p + N, b); }
};
#endif

// -- the fp32 AdamW update (kernels.h) ---------------------------------------------------------

// The step's scalars splat to V's lanes once per call of a loop.
template <class V>
struct AdamCoeffs {
  using F = typename V::F;
  F inv_scale, decay, w, one_minus_w, b2, omb2, bc2, eps, step;
  explicit AdamCoeffs(const AdamScalars& s)
      : inv_scale(V::set1(s.inv_grad_scale)), decay(V::set1(s.decay)),
        w(V::set1(s.one_minus_beta1)), one_minus_w(V::set1(1.0f - s.one_minus_beta1)),
        b2(V::set1(s.beta2)), omb2(V::set1(s.one_minus_beta2)), bc2(V::set1(s.bc2_sqrt)),
        eps(V::set1(s.eps)), step(V::set1(s.step_size)) {}
};

// One AdamW update of V::N elements in fp32 with the rounding contract of kernels.h: the
// lerp, the v update and the p update are single fmas, every other operation one IEEE
// rounding. graw is the widened gradient before its scaling; p, m, v are updated in place.
// LERP_LOW (w = 1 - beta1 < 0.5) is a template parameter so loops carry no branch on it.
// FOLDED: the scalars are fold_bias_correction's (zerokern/kernel_contract.py: bf16 moments
// and int8 format version 3), bc2_sqrt == 1, so sqrt(v) / bc2_sqrt is sqrt(v) exactly and
// the division is skipped: one of the two divisions that, with the square root, bound this
// update on a CPU.
template <class V, bool LERP_LOW, bool FOLDED = false>
inline void adam_update(const AdamCoeffs<V>& k, typename V::F graw, typename V::F& p,
                        typename V::F& m, typename V::F& v) {
  using F = typename V::F;
  const F g = V::mul(graw, k.inv_scale);
  p = V::mul(p, k.decay);
  const F d = V::sub(g, m);
  // torch's lerp_: w < 0.5 ? m + w*(g-m) : g - (g-m)*(1-w), each one fma.
  m = LERP_LOW ? V::fma(k.w, d, m) : V::fnma(d, k.one_minus_w, g);
  // mul_(beta2) then addcmul_(g, g, value=1-beta2): v*b2 + ((1-b2)*g)*g, the sum fused.
  v = V::fma(V::mul(k.omb2, g), g, V::mul(v, k.b2));
  const F root = V::sqrt(v);
  const F denom = V::add(FOLDED ? root : V::div(root, k.bc2), k.eps);
  // addcdiv_(m, denom, value=-step_size): p - step_size * (m / denom), fused.
  p = V::fnma(k.step, V::div(m, denom), p);
}

}  // namespace zk
