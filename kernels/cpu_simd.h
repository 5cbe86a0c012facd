// The SIMD vocabulary the CPU kernels share (cpu_rowdot.cc, cpu_attention.cc): one vector of
// floats and the few operations their loops use, for the host's widest unit, chosen at
// compile time by -march=native. AVX-512F: 32 registers of 16 floats; AVX2 with FMA: 16
// registers of 8 floats. Any other CPU stops here with a clear error (kernels/cpu_build.py
// checks the CPU's flags first, so a user sees that reason instead of a compiler's).
#pragma once

#include <immintrin.h>

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16, kRegisters = 32;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float MaxOf(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec Round(Vec v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec Pow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
// out[i] = Sum(v[i]) for all kLanes vectors at once: a transposing tree of adds, 45
// instructions for 16 sums where 16 Sum()s take about three times that.
inline Vec SumEach(const Vec* v) {
  Vec t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)  // 128-bit blocks of (v[2j], v[2j+1], v[2j], v[2j+1]) partials
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // blocks of (v[4j], .., v[4j + 3]) partials
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)  // two blocks of partials per group of four vectors
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8, kRegisters = 16;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set1(float x) { return _mm256_set1_ps(x); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float MaxOf(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline Vec Round(Vec v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec Pow2(Vec p, Vec n) {  // p * 2^n for integral n in [-126, 127]: add n to the exponent
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
// out[i] = Sum(v[i]) for all kLanes vectors at once (a transposing tree of adds).
inline Vec SumEach(const Vec* v) {
  Vec t[4], u[2];
  for (int j = 0; j < 4; ++j)
    t[j] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm256_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 2; ++j)
    u[j] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                       _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#else
// The message is checked by tests/kernels/test_cpu_build.py.
#error "the specjax CPU kernels need AVX-512F, or AVX2 with FMA (-march=native on such a CPU)"
#endif

// An optimisation barrier that makes the compiler hold v in a register from here on, so
// that it cannot fold v's load into every instruction that reads v (a load per use instead
// of one load). It emits no instruction and changes no value.
inline void KeepInRegister(Vec& v) { asm("" : "+v"(v)); }

// exp(x) for x <= 0 (a softmax's shifted scores), within 2 ulp of expf for x >= -87; below,
// where expf's result would be denormal or 0, it returns exp(-87) ~ 1.6e-38, which no sum of
// at least one exp(0) = 1 can tell from 0. Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a
// degree-7 polynomial in r, then the exponent scaled by n.
inline Vec ExpNonPositive(Vec x) {
  x = Max(x, Set1(-87.0f));
  const Vec n = Round(Mul(x, Set1(1.44269504088896341f)));
  Vec r = Fma(n, Set1(-0.693359375f), x);
  r = Fma(n, Set1(2.12194440e-4f), r);
  Vec p = Set1(1.9875691500e-4f);
  p = Fma(p, r, Set1(1.3981999507e-3f));
  p = Fma(p, r, Set1(8.3334519073e-3f));
  p = Fma(p, r, Set1(4.1665795894e-2f));
  p = Fma(p, r, Set1(1.6666665459e-1f));
  p = Fma(p, r, Set1(5.0000001201e-1f));
  p = Fma(p, Mul(r, r), Add(r, Set1(1.0f)));
  return Pow2(p, n);
}
