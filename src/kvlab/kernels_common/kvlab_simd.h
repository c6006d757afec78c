// SIMD helpers shared by kvlab's compiled CPU kernels (docs/design.md, "Kernels"): the PN-Mix
// attention kernel (pnmix/kernels/cpu_kernel.cpp) and the RoPE-Relay decode kernel
// (relay/kernels/cpu_decode.cpp) include this file; kvlab.native.compile_module puts its folder
// on the include path and hashes it into the build's name.
//
// Eight float32 lanes (GCC/Clang vector extension: AVX registers under -march=native, pairs of
// SSE registers otherwise); element-wise arithmetic, no reassociation, so every sum below has
// one fixed order (the kernels' results depend on it).
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace
