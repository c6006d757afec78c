// SIMD helpers shared by kvlab's compiled CPU kernels (docs/design.md, "Kernels"): the PN-Mix
// attention kernel (pnmix/kernels/cpu_kernel.cpp) and the RoPE-Relay decode kernel
// (relay/kernels/cpu_decode.cpp) include this file; kvlab.native.compile_module puts its folder
// on the include path and hashes it into the build's name.
//
// Eight float32 lanes (GCC/Clang vector extension: AVX registers under -march=native, pairs of
// SSE registers otherwise); element-wise arithmetic, no reassociation, so every sum below has
// one fixed order (the kernels' results depend on it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// sum_i a[i] * b[i] with eight independent partial sums
inline float dot(const float* a, const float* b, int64_t n) {
  v8f lane = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) lane += load8(a + i) * load8(b + i);
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return hsum8(lane) + tail;
}

// exp(x) for the softmax weights, branch-free so that loops over it vectorize (Cephes expf
// polynomial, relative error about 2e-7; n = round(x / ln 2) by the 1.5 * 2^23 trick, exact
// without fast-math). Inputs below -87.3 give ~1e-38; masked tokens never reach it.
inline float exp_approx(float x) {
  x = x < -87.3365f ? -87.3365f : x;
  x = x > 88.3762f ? 88.3762f : x;
  const float fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}

// out[j] = a . b[j] for four rows b[j] = b + j * stride (four independent chains)
inline void dot4(const float* a, const float* b, int64_t stride, int64_t n, float* out) {
  v8f l0 = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  v8f l1 = l0, l2 = l0, l3 = l0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f x = load8(a + i);
    l0 += x * load8(b + i);
    l1 += x * load8(b + stride + i);
    l2 += x * load8(b + 2 * stride + i);
    l3 += x * load8(b + 3 * stride + i);
  }
  float t0 = 0.f, t1 = 0.f, t2 = 0.f, t3 = 0.f;
  for (; i < n; ++i) {
    t0 += a[i] * b[i];
    t1 += a[i] * b[stride + i];
    t2 += a[i] * b[2 * stride + i];
    t3 += a[i] * b[3 * stride + i];
  }
  out[0] = hsum8(l0) + t0;
  out[1] = hsum8(l1) + t1;
  out[2] = hsum8(l2) + t2;
  out[3] = hsum8(l3) + t3;
}

// ---- GQA tiles: the query rows of one kv head against a tile of its keys / value rows, each
// key or value row read once for every row (register blocking), with the arithmetic of dot4 /
// dot and of a weighted sum in token order: a score is eight lanes of chained multiply-adds
// over the channels in order, summed as hsum8 sums them; a value channel sums its tokens in
// order. So a tile gives the bits of the row-by-row loops it replaces (for D % 8 == 0).

// hsum8 of four accumulators into out[0, 4): (v[k] + v[k + 4]) for every k as one 256-bit add
// of the 128-bit halves, then the pairs (0 + 1) + (2 + 3) by two horizontal adds
inline void hsum8x4(const v8f& a0, const v8f& a1, const v8f& a2, const v8f& a3, float* out) {
#if defined(__AVX2__)
  __m256 r0, r1, r2, r3;
  std::memcpy(&r0, &a0, sizeof(r0));
  std::memcpy(&r1, &a1, sizeof(r1));
  std::memcpy(&r2, &a2, sizeof(r2));
  std::memcpy(&r3, &a3, sizeof(r3));
  const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(r0, r1, 0x20),
                                   _mm256_permute2f128_ps(r0, r1, 0x31));  // [s0 | s1]
  const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(r2, r3, 0x20),
                                   _mm256_permute2f128_ps(r2, r3, 0x31));  // [s2 | s3]
  const __m256 h = _mm256_hadd_ps(s01, s23);
  const __m256 sums = _mm256_hadd_ps(h, h);  // [S0 S2 S0 S2 | S1 S3 S1 S3]
  const __m256 order = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5));
  _mm_storeu_ps(out, _mm256_castps256_ps128(order));
#else
  out[0] = hsum8(a0);
  out[1] = hsum8(a1);
  out[2] = hsum8(a2);
  out[3] = hsum8(a3);
#endif
}

// p[g * ps + t] = q[g * D, g * D + D) . k[t * D, t * D + D) for g < NH, t < NT (D % 8 == 0)
template <int NH, int NT>
inline void score_block(const float* q, int64_t D, const float* k, float* p, int64_t ps) {
  v8f c[NH][NT];
  for (int g = 0; g < NH; ++g)
    for (int t = 0; t < NT; ++t) c[g][t] = v8f{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t j = 0; j < D; j += 8) {
    v8f kt[NT];
    for (int t = 0; t < NT; ++t) kt[t] = load8(k + t * D + j);
    for (int g = 0; g < NH; ++g) {
      const v8f x = load8(q + g * D + j);
      for (int t = 0; t < NT; ++t) c[g][t] += x * kt[t];
    }
  }
  constexpr int N = NH * NT;
  float s[N];
  const v8f* flat = &c[0][0];
  int i = 0;
  for (; i + 4 <= N; i += 4) hsum8x4(flat[i], flat[i + 1], flat[i + 2], flat[i + 3], s + i);
  if constexpr (N % 4 != 0) {
    for (; i < N; ++i) s[i] = hsum8(flat[i]);
  }
  for (int g = 0; g < NH; ++g)
    for (int t = 0; t < NT; ++t) p[g * ps + t] = s[g * NT + t];
}

template <int NH>
inline void score_heads(const float* q, int64_t D, const float* k, int64_t T, float* p,
                        int64_t ps) {
  // 12 accumulators (three groups of four for hsum8x4), or 8 for two rows
  constexpr int NT = NH == 4 ? 3 : 4;
  int64_t t = 0;
  for (; t + NT <= T; t += NT) score_block<NH, NT>(q, D, k + t * D, p + t, ps);
  for (; t < T; ++t) score_block<NH, 1>(q, D, k + t * D, p + t, ps);
}

// p[g * ps + t] = q_g . k_t for query rows g < G (q [G, D]) and keys t < T (k [T, D]), D a
// multiple of 8: keys t < tail with dot4's bits, keys t >= tail by dot itself (the callers'
// row loops take their last n % 4 keys by dot, whose compiled sums may round differently)
inline void score_tile(const float* q, int64_t G, int64_t D, const float* k, int64_t T, float* p,
                       int64_t ps, int64_t tail) {
  const int64_t n = std::min(T, std::max<int64_t>(tail, 0));
  // rows in blocks of three or four (a multiple of three in threes)
  int64_t g = 0;
  while (g < G) {
    const int64_t left = G - g;
    const float* qg = q + g * D;
    float* pg = p + g * ps;
    if (left % 3 == 0 || left == 5) {
      score_heads<3>(qg, D, k, n, pg, ps);
      g += 3;
    } else if (left >= 4) {
      score_heads<4>(qg, D, k, n, pg, ps);
      g += 4;
    } else if (left == 2) {
      score_heads<2>(qg, D, k, n, pg, ps);
      g += 2;
    } else {
      score_heads<1>(qg, D, k, n, pg, ps);
      g += 1;
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t t = n; t < T; ++t) p[h * ps + t] = dot(q + h * D, k + t * D, D);
}

// acc[g * Dv + d] += sum_t w[g * ws + t] * v[t * Dv + d] for g < NH, d in [d0, d0 + 8 NC),
// tokens in order
template <int NH, int NC>
inline void value_block(const float* w, int64_t ws, const float* v, int64_t T, int64_t Dv,
                        int64_t d0, float* acc) {
  v8f a[NH][NC];
  for (int g = 0; g < NH; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = load8(acc + g * Dv + d0 + 8 * c);
  for (int64_t t = 0; t < T; ++t) {
    v8f x[NC];
    for (int c = 0; c < NC; ++c) x[c] = load8(v + t * Dv + d0 + 8 * c);
    for (int g = 0; g < NH; ++g) {
      const float wt = w[g * ws + t];
      for (int c = 0; c < NC; ++c) a[g][c] += wt * x[c];
    }
  }
  for (int g = 0; g < NH; ++g)
    for (int c = 0; c < NC; ++c) store8(acc + g * Dv + d0 + 8 * c, a[g][c]);
}

template <int NH>
inline void value_heads(const float* w, int64_t ws, const float* v, int64_t T, int64_t Dv,
                        float* acc) {
  for (int64_t d = 0; d + 32 <= Dv; d += 32) value_block<NH, 4>(w, ws, v, T, Dv, d, acc);
}

// acc[g * Dv + d] += sum_t w[g * ws + t] * v[t * Dv + d] for query rows g < G and value rows
// t < T (v [T, Dv]); Dv a multiple of 32. Each channel is a chain of fused multiply-adds over
// the tokens in order: the bits of the kernels' weighted-sum loops over 64 channels at a time
// in eight accumulators (for Dv % 64 == 0). Not of their loops with one accumulator (eight
// channels at a time, dot): GCC tuned for Zen keeps a single multiply-add chain in a loop as a
// multiply, then an add, which rounds differently.
inline void value_tile(const float* w, int64_t ws, int64_t G, const float* v, int64_t T,
                       int64_t Dv, float* acc) {
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) value_heads<3>(w + g * ws, ws, v, T, Dv, acc + g * Dv);
  if (G - g == 2) value_heads<2>(w + g * ws, ws, v, T, Dv, acc + g * Dv);
  if (G - g == 1) value_heads<1>(w + g * ws, ws, v, T, Dv, acc + g * Dv);
}

}  // namespace
