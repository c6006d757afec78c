// RoPE-Relay decode attention on the CPU: one query token per sequence over the ragged store
// (docs/design.md, "RoPE-Relay: Attention", "Compiled decode kernel").
//
// Reads the store's flat buffers in place: segment m (= b * H_kv + h) owns rows
// [m * stride, m * stride + lengths[m]) of keys [N, D] and values [N, Dv] (float32, rows
// contiguous); each of its G = H_q / H_kv query heads (GQA) reads them (a segment's rows stay
// in cache between its heads). Exact softmax in float32 (std::exp, max-subtracted), the formula
// SDPA computes; summation order differs from SDPA's, so results agree to float32 rounding, not
// bit for bit. (segment, head) pairs run in parallel (at::parallel_for) when torch has more
// than one intra-op thread and the step is large enough.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kvlab_simd.h"  // v8f, load8, store8, hsum8, dot, dot4 (kernels_common)

namespace {

// p = exp(scale * x - max) in place over x[0, n); returns sum p (eight lanes, then the tail)
float softmax_weights(float* x, int64_t n, float scale) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    x[i] *= scale;
    top = std::max(top, x[i]);
  }
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      x[i + j] = std::exp(x[i + j] - top);
      lane[j] += x[i + j];
    }
  }
  float tail = 0.f;
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - top);
    tail += x[i];
  }
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7])) +
         tail;
}

// out[0, n) = sum_t w[t] * x[t, 0, n) * inv: 64 channels at a time in eight registers
// (independent chains), then 8 at a time, then one
void weighted_rows(const float* w, const float* x, int64_t rows, int64_t n, float inv,
                   float* out) {
  int64_t d = 0;
  for (; d + 64 <= n; d += 64) {
    v8f a[8];
    for (int j = 0; j < 8; ++j) a[j] = v8f{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t t = 0; t < rows; ++t) {
      const float wt = w[t];
      const float* xt = x + t * n + d;
      for (int j = 0; j < 8; ++j) a[j] += wt * load8(xt + 8 * j);
    }
    for (int j = 0; j < 8; ++j) store8(out + d + 8 * j, a[j] * inv);
  }
  for (; d + 8 <= n; d += 8) {
    v8f a = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t t = 0; t < rows; ++t) a += w[t] * load8(x + t * n + d);
    store8(out + d, a * inv);
  }
  for (; d < n; ++d) {
    float a = 0.f;
    for (int64_t t = 0; t < rows; ++t) a += w[t] * x[t * n + d];
    out[d] = a * inv;
  }
}

}  // namespace

// query [M, G, D], keys [N, D], values [N, Dv]: float32, contiguous, N >= M * stride;
// lengths: M ints in [1, stride]. Returns [M, G, Dv] float32.
torch::Tensor ragged_decode(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                            int64_t stride, std::vector<int64_t> lengths, double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 2 && values.dim() == 2,
              "ragged_decode: query [M, G, D], keys [N, D], values [N, Dv]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
                  values.scalar_type() == torch::kFloat32,
              "ragged_decode: float32 only");
  TORCH_CHECK(query.is_contiguous() && keys.is_contiguous() && values.is_contiguous(),
              "ragged_decode: contiguous tensors only");
  const int64_t M = query.size(0), G = query.size(1), D = query.size(2);
  const int64_t Dv = values.size(1);
  TORCH_CHECK(keys.size(1) == D && values.size(0) == keys.size(0), "ragged_decode: shapes");
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == M && stride >= 1 &&
                  M * stride <= keys.size(0),
              "ragged_decode: lengths / stride do not fit the buffers");
  for (int64_t n : lengths) TORCH_CHECK(n >= 1 && n <= stride, "ragged_decode: length ", n);
  auto out = torch::empty({M, G, Dv}, query.options());
  const float* q = query.data_ptr<float>();
  const float* k = keys.data_ptr<float>();
  const float* v = values.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // threads only for enough work: at least ~2^18 multiply-adds per task (a decode step of a
  // small model is a few microseconds per head, less than waking a thread pool)
  int64_t longest = 1;
  for (int64_t n : lengths) longest = std::max(longest, n);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (longest * (D + Dv)));
  at::parallel_for(0, M * G, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t mg = begin; mg < end; ++mg) {
      const int64_t m = mg / G, n = lengths[m];
      const float* qg = q + mg * D;
      const float* km = k + m * stride * D;
      p.resize(n);
      int64_t i = 0;
      for (; i + 4 <= n; i += 4) dot4(qg, km + i * D, D, D, p.data() + i);
      for (; i < n; ++i) p[i] = dot(qg, km + i * D, D);
      const float total = softmax_weights(p.data(), n, s);
      weighted_rows(p.data(), v + m * stride * Dv, n, Dv, 1.f / total, o + mg * Dv);
    }
  });
  return out;
}
