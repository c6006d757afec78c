// Exact decode attention on the CPU: one query token per sequence over float32 keys and values
// stored per (sequence, kv head) segment (docs/design.md, "RoPE-Relay: Attention", "Compiled
// decode kernel"). Two entry points read the same layout:
//
// * ragged_decode: the RoPE-Relay store's flat buffers, segment m (= b * H_kv + h) owning rows
//   [m * stride, m * stride + lengths[m]) of keys [N, D] and values [N, Dv];
// * dense_decode: a dense cache's [B * H_kv, capacity, D] buffers (any segment stride, rows
//   contiguous), every segment holding the same number of tokens.
//
// The G = H_q / H_kv query heads of a segment (GQA) read its keys and values once from memory:
// a block of tokens is scored for every head while it sits in the core's caches, then, after
// the softmax, a block of values is accumulated for every head. Per (head, token) and per
// (head, channel) the arithmetic and its order are those of a loop over the heads one at a time
// (the scores by dot4 / dot, the weighted sums in token order), so the result does not depend on
// the blocking or the threads. Softmax in float32, max-subtracted: with exact_exp, std::exp
// (ragged_decode: the relay reference's bits); otherwise exp_approx, eight lanes at a time
// (kvlab_simd.h: relative error about 2e-7). Summation order differs from SDPA's, so results
// agree with it to float32 rounding, not bit for bit.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kvlab_simd.h"  // v8f, dot, dot4, exp_approx, score_tile, value_tile (kernels_common)

namespace {

// tokens per block: a block's keys (or values) stay in the core's L2 while every head reads it
constexpr int64_t kBlock = 128;

// p = exp(scale * x - max) in place over x[0, n); returns sum p (eight lanes, then the tail)
template <bool kExact>
float softmax_weights(float* x, int64_t n, float scale) {
  float top = -std::numeric_limits<float>::infinity();
  if (kExact) {
    for (int64_t i = 0; i < n; ++i) {
      x[i] *= scale;
      top = std::max(top, x[i]);
    }
  } else {  // eight lanes (vectorizes)
    float most[8];
    for (int j = 0; j < 8; ++j) most[j] = top;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) {
        x[i + j] *= scale;
        most[j] = most[j] < x[i + j] ? x[i + j] : most[j];
      }
    }
    for (; i < n; ++i) {
      x[i] *= scale;
      top = std::max(top, x[i]);
    }
    for (int j = 0; j < 8; ++j) top = std::max(top, most[j]);
  }
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      x[i + j] = kExact ? std::exp(x[i + j] - top) : exp_approx(x[i + j] - top);
      lane[j] += x[i + j];
    }
  }
  float tail = 0.f;
  for (; i < n; ++i) {
    x[i] = kExact ? std::exp(x[i] - top) : exp_approx(x[i] - top);
    tail += x[i];
  }
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7])) +
         tail;
}

// acc[0, n) += sum_{t < rows} w[t] * x[t * n, t * n + n): the accumulation of one head's
// weighted value rows, a block of tokens at a time (acc starts at zero; in token order per
// channel): 64 channels in eight registers, then 8 at a time, then one
void accumulate_rows(const float* w, const float* x, int64_t rows, int64_t n, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= n; d += 64) {
    v8f a[8];
    for (int j = 0; j < 8; ++j) a[j] = load8(acc + d + 8 * j);
    for (int64_t t = 0; t < rows; ++t) {
      const float wt = w[t];
      const float* xt = x + t * n + d;
      for (int j = 0; j < 8; ++j) a[j] += wt * load8(xt + 8 * j);
    }
    for (int j = 0; j < 8; ++j) store8(acc + d + 8 * j, a[j]);
  }
  for (; d + 8 <= n; d += 8) {
    v8f a = load8(acc + d);
    for (int64_t t = 0; t < rows; ++t) a += w[t] * load8(x + t * n + d);
    store8(acc + d, a);
  }
  for (; d < n; ++d) {
    float a = acc[d];
    for (int64_t t = 0; t < rows; ++t) a += w[t] * x[t * n + d];
    acc[d] = a;
  }
}

// out[0, n) = acc[0, n) * inv, with the chunking of accumulate_rows (the same products)
void finish_rows(const float* acc, int64_t n, float inv, float* out) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) store8(out + d, load8(acc + d) * inv);
  for (; d < n; ++d) out[d] = acc[d] * inv;
}

struct Segments {
  const float* q;  // [M, G, D]
  const float* k;  // segment m at k + m * k_seg, token t at + t * D
  const float* v;  // segment m at v + m * v_seg, token t at + t * Dv
  int64_t k_seg, v_seg, M, G, D, Dv;
  float scale;
};

// heads [g0, g1) of segment m over its n tokens into out [G, Dv] rows g0..g1
template <bool kExact>
void segment_heads(const Segments& s, int64_t m, int64_t g0, int64_t g1, int64_t n, float* out,
                   std::vector<float>& p, std::vector<float>& acc) {
  const int64_t D = s.D, Dv = s.Dv, heads = g1 - g0;
  const float* km = s.k + m * s.k_seg;
  const float* vm = s.v + m * s.v_seg;
  p.resize(heads * n);
  // scores: every head over a block of keys (token i as dot4 / dot compute it)
  const float* qs = s.q + (m * s.G + g0) * D;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    if (D % 8 == 0) {  // the same bits as the loop below
      score_tile(qs, heads, D, km + b0 * D, b1 - b0, p.data() + b0, n, n / 4 * 4 - b0);
      continue;
    }
    for (int64_t g = 0; g < heads; ++g) {
      const float* qg = qs + g * D;
      float* pg = p.data() + g * n;
      int64_t i = b0;
      for (; i + 4 <= b1; i += 4) dot4(qg, km + i * D, D, D, pg + i);
      for (; i < b1; ++i) pg[i] = dot(qg, km + i * D, D);
    }
  }
  std::vector<float> inv(heads);
  for (int64_t g = 0; g < heads; ++g)
    inv[g] = 1.f / softmax_weights<kExact>(p.data() + g * n, n, s.scale);
  // values: every head over a block of value rows, accumulating in token order
  acc.assign(heads * Dv, 0.f);
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t rows = std::min(n, b0 + kBlock) - b0;
    if (Dv % 64 == 0) {  // the same bits as the loop below (value_tile's note)
      value_tile(p.data() + b0, n, heads, vm + b0 * Dv, rows, Dv, acc.data());
      continue;
    }
    for (int64_t g = 0; g < heads; ++g)
      accumulate_rows(p.data() + g * n + b0, vm + b0 * Dv, rows, Dv, acc.data() + g * Dv);
  }
  for (int64_t g = 0; g < heads; ++g)
    finish_rows(acc.data() + g * Dv, Dv, inv[g], out + (m * s.G + g0 + g) * Dv);
}

// every segment: lengths[m] tokens each (lengths.size() == M, or one length for all)
void run_segments(const Segments& s, const std::vector<int64_t>& lengths, bool exact, float* out) {
  const int64_t M = s.M, G = s.G;
  auto length = [&](int64_t m) { return lengths.size() == 1 ? lengths[0] : lengths[m]; };
  int64_t longest = 1;
  for (int64_t n : lengths) longest = std::max(longest, n);
  // tasks: (segment, chunk of heads); more than one chunk only when there are more threads
  // than segments. Threads only for enough work: at least ~2^18 multiply-adds per task.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::min<int64_t>(G, std::max<int64_t>(1, (threads + M - 1) / M));
  const int64_t per = (G + chunks - 1) / chunks;
  const int64_t work = longest * (s.D + s.Dv) * per;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, work));
  at::parallel_for(0, M * chunks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / chunks, c = task % chunks;
      const int64_t g0 = std::min(G, c * per), g1 = std::min(G, g0 + per);
      if (g0 >= g1) continue;
      if (exact) {
        segment_heads<true>(s, m, g0, g1, length(m), out, p, acc);
      } else {
        segment_heads<false>(s, m, g0, g1, length(m), out, p, acc);
      }
    }
  });
}

}  // namespace

// query [M, G, D], keys [N, D], values [N, Dv]: float32, contiguous, N >= M * stride;
// lengths: M ints in [1, stride]. Returns [M, G, Dv] float32 (std::exp softmax).
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
  const Segments s{query.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
                   stride * D, stride * Dv, M, G, D, Dv, static_cast<float>(scale)};
  run_segments(s, lengths, true, out.data_ptr<float>());
  return out;
}

// query [M, G, D] float32 contiguous; keys [M, S, D] and values [M, S, Dv] float32 with
// contiguous rows (stride(2) == 1, stride(1) == D or Dv; any segment stride); the first
// `length` tokens of every segment (1 <= length <= S). Returns [M, G, Dv] float32
// (exp_approx softmax).
torch::Tensor dense_decode(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                           int64_t length, double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.dim() == 3,
              "dense_decode: query [M, G, D], keys [M, S, D], values [M, S, Dv]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
                  values.scalar_type() == torch::kFloat32,
              "dense_decode: float32 only");
  TORCH_CHECK(query.is_contiguous(), "dense_decode: contiguous query only");
  const int64_t M = query.size(0), G = query.size(1), D = query.size(2);
  const int64_t Dv = values.size(2);
  TORCH_CHECK(keys.size(0) == M && values.size(0) == M && keys.size(2) == D &&
                  values.size(1) == keys.size(1),
              "dense_decode: shapes");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == D && values.stride(2) == 1 &&
                  values.stride(1) == Dv,
              "dense_decode: token rows must be contiguous");
  TORCH_CHECK(length >= 1 && length <= keys.size(1), "dense_decode: length ", length);
  auto out = torch::empty({M, G, Dv}, query.options());
  const Segments s{query.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
                   keys.stride(0), values.stride(0), M, G, D, Dv, static_cast<float>(scale)};
  run_segments(s, {length}, false, out.data_ptr<float>());
  return out;
}
