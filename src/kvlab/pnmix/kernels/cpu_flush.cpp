// PN-Mix group flush on the CPU (docs/design.md, "Kernels", "Flush").
//
// Codes the groups that one append flushes exactly as the torch reference does
// (PNMixCache._encode): the keys rotated back to position 0 for a pre-RoPE codec
// (kvlab.rope.rotate_by_delta, with the cos/sin the Python side takes from kvlab.rope), then
// BitAllocCodec.encode_groups and BitAllocCodec.pack (per-channel min-max with a code width per
// rotary pair, exact sparse outliers, the width layout), the value codec's encode (per-token
// min-max of the values or of their Hadamard rotation, over each block of Dv / G channels when
// the codec has G channel groups) and pack_codes. The same IEEE
// operations in the same precisions: float32 rotation (no fused multiply-add), float64
// code arithmetic, every conversion to float16 through float32 as Tensor.to converts float64.
// Sums are the one place where torch's order could matter; for float16 inputs every float64
// sum formed here (a channel's non-outlier tokens for a 0-bit channel's mean, a token's
// Hadamard rotation) is exact (multiples of 2^-24 below 2^53 for T, Dv <= 8192), so any order
// gives torch's result. Two things could still differ from the reference and are refused:
// the sign of a zero minimum or maximum (which zero torch's min/max reduction keeps depends on
// its order) and non-finite values (NaN payloads). The function returns no tensors when a
// frame key, a value or a frame value is a negative zero or not finite, or a stored scalar is
// not finite; the caller then codes the flush with the torch reference (such inputs are
// rejected by the cache's checks anyway).

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

namespace kvlab_flush {

using Half = at::Half;

// float64 -> float16 as Tensor.to(torch.float16) converts: through float32 (each step rounds
// to nearest even)
inline Half to_half(double x) { return Half(static_cast<float>(x)); }

inline bool bad(float v) { return !std::isfinite(v) || (v == 0.f && std::signbit(v)); }

// OR code (its low bits) into the little-endian bitstream dst at stream bit `bit`
inline void put_code(uint8_t* dst, int64_t bit, uint32_t code) {
  const uint32_t v = code << (bit & 7);
  dst[bit >> 3] |= static_cast<uint8_t>(v & 0xffu);
  if (v >> 8) dst[(bit >> 3) + 1] |= static_cast<uint8_t>(v >> 8);
}

// torch.round (half to even) of the code ratio, clamped to 0..levels
inline uint8_t code_of(double x, double z, double s, int64_t levels) {
  double c = std::nearbyint((x - z) / s);
  c = c < 0.0 ? 0.0 : c;
  c = c > static_cast<double>(levels) ? static_cast<double>(levels) : c;
  return static_cast<uint8_t>(c);
}

// Keys [T, D] rotated by -position (rotate_by_delta's float32 arithmetic: every product and
// sum rounded to float32 separately), rounded to float16; channels outside the pairs are
// copied. The build allows fused multiply-adds (-ffp-contract=fast); an empty asm statement
// makes each product a value the compiler must form on its own, so none is fused with the sum
// that follows.
inline float product(float a, float b) {
  float v = a * b;
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#else
  volatile float opaque = v;
  v = opaque;
#endif
  return v;
}

void to_frame(const Half* k, const float* cs, const float* sn, const int64_t* first,
              const int64_t* second, int64_t T, int64_t D, int64_t P, Half* out) {
  std::memcpy(out, k, sizeof(Half) * T * D);
  if (cs == nullptr) return;
  for (int64_t t = 0; t < T; ++t) {
    const Half* x = k + t * D;
    Half* y = out + t * D;
    for (int64_t p = 0; p < P; ++p) {
      const float x1 = static_cast<float>(x[first[p]]), x2 = static_cast<float>(x[second[p]]);
      const float c = cs[t * P + p], s = sn[t * P + p];
      y[first[p]] = Half(product(x1, c) - product(x2, s));
      y[second[p]] = Half(product(x1, s) + product(x2, c));
    }
  }
}

// Flat indices t * D + d of the K elements farthest from their channel's lower median
// (outliers.select_outliers: float64 distances, ties to the lower index), ascending: every
// element beyond the K-th largest distance, then the first of those equal to it.
void select_outliers(const std::vector<double>& x, int64_t T, int64_t D, int64_t K,
                     std::vector<double>& dist, std::vector<double>& tmp, int32_t* out) {
  const int64_t n = T * D, mid = (T - 1) / 2;  // torch.median: the lower median
  dist.resize(n);
  tmp.resize(std::max(K, T));
  thread_local std::vector<double> med;
  thread_local std::vector<float> sorted, v;
  med.resize(D);
  if (T <= 64) {
    // every channel's mid + 1 smallest values at once, by insertion with the channels the
    // inner loop (float32: the values are float16, so exact); row j of `sorted` holds each
    // channel's j-th smallest value of the tokens so far
    const int64_t keep = mid + 1;
    sorted.resize(keep * D);
    v.resize(D);
    float* __restrict vp = v.data();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t d = 0; d < D; ++d) vp[d] = static_cast<float>(x[t * D + d]);
      const int64_t rows = std::min(t, keep);
      for (int64_t j = 0; j < rows; ++j) {
        float* __restrict row = sorted.data() + j * D;
        for (int64_t d = 0; d < D; ++d) {
          const float lo = std::min(row[d], vp[d]), hi = std::max(row[d], vp[d]);
          row[d] = lo;
          vp[d] = hi;
        }
      }
      if (t < keep) std::copy(vp, vp + D, sorted.begin() + t * D);
    }
    for (int64_t d = 0; d < D; ++d) med[d] = sorted[mid * D + d];
  } else {
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t t = 0; t < T; ++t) tmp[t] = x[t * D + d];
      std::nth_element(tmp.begin(), tmp.begin() + mid, tmp.begin() + T);
      med[d] = tmp[mid];
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) dist[t * D + d] = std::fabs(x[t * D + d] - med[d]);
  // the K-th largest distance: the top of a min-heap of the K largest
  tmp.assign(dist.begin(), dist.begin() + K);
  std::make_heap(tmp.begin(), tmp.begin() + K, std::greater<double>());
  for (int64_t i = K; i < n; ++i) {
    if (dist[i] > tmp[0]) {
      std::pop_heap(tmp.begin(), tmp.begin() + K, std::greater<double>());
      tmp[K - 1] = dist[i];
      std::push_heap(tmp.begin(), tmp.begin() + K, std::greater<double>());
    }
  }
  const double kth = tmp[0];
  int64_t ties = K;  // places left for distances equal to the K-th
  for (int64_t i = 0; i < n; ++i) ties -= dist[i] > kth;
  for (int64_t i = 0, j = 0; i < n && j < K; ++i) {
    if (dist[i] > kth || (dist[i] == kth && ties-- > 0)) out[j++] = static_cast<int32_t>(i);
  }
}

struct Sizes {
  int64_t N, T, D, Dv, P, bits, K, Kb, Vb, E;
  int64_t Gv;  // value channel groups: one scale and zero per token and Dv / Gv channels
};

// Codes one group (index n); false when the result might differ from the reference's.
// `outliers` [N, K] (the groups' outlier indices as select_outliers gives them) or null
bool encode_group(const Sizes& z, int64_t n, const Half* keys, const float* cs, const float* sn,
                  const int64_t* first, const int64_t* second, const uint8_t* table,
                  const Half* values, bool hadamard, const int32_t* outliers, uint8_t* kcodes,
                  Half* kscal, uint8_t* payload, uint8_t* vcodes, Half* vscal) {
  const int64_t T = z.T, D = z.D, Dv = z.Dv, P = z.P, K = z.K, TD = T * D;
  // ---- keys in the codec's frame
  std::vector<Half> frame(TD);
  to_frame(keys + n * TD, cs ? cs + n * T * P : nullptr, sn ? sn + n * T * P : nullptr, first,
           second, T, D, P, frame.data());
  std::vector<double> x(TD);
  for (int64_t i = 0; i < TD; ++i) {
    const float v = static_cast<float>(frame[i]);
    if (bad(v)) return false;
    x[i] = v;
  }
  // ---- per-channel widths and the width layout's bit offsets (channel_bit_offsets)
  std::vector<int64_t> w(D, z.bits), off(D, 0), chan(D);
  if (table != nullptr) {
    for (int64_t p = 0; p < P; ++p) w[first[p]] = w[second[p]] = table[n * P + p];
  }
  std::iota(chan.begin(), chan.end(), 0);
  std::stable_sort(chan.begin(), chan.end(), [&](int64_t a, int64_t b) { return w[a] > w[b]; });
  int64_t used = 0;
  for (int64_t d : chan) {
    off[d] = used;
    used += w[d];
  }
  if (used > z.bits * D) return false;  // a table over its budget (never stored by the cache)
  // ---- outliers
  std::vector<uint8_t> excl(TD, 0);
  if (K > 0) {
    std::vector<double> dist, tmp;
    std::vector<int32_t> order(K);
    if (outliers != nullptr) {
      std::memcpy(order.data(), outliers + n * K, sizeof(int32_t) * K);
    } else {
      select_outliers(x, T, D, K, dist, tmp, order.data());
    }
    uint8_t* pv = payload + n * z.E;
    uint8_t* pi = pv + K * static_cast<int64_t>(sizeof(Half));
    for (int64_t j = 0; j < K; ++j) {
      const int32_t i = order[j];
      excl[i] = 1;
      const int16_t idx = static_cast<int16_t>(i);
      std::memcpy(pv + j * sizeof(Half), &frame[i], sizeof(Half));
      std::memcpy(pi + j * sizeof(int16_t), &idx, sizeof(int16_t));
    }
  }
  // ---- per-channel min-max (width_codec.BitAllocCodec._dense, outliers.minmax_excluding)
  uint8_t* kc = kcodes + n * z.Kb;
  Half* scale = kscal + n * 2 * D;
  Half* zero = scale + D;
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t d = 0; d < D; ++d) {
    double lo = inf, hi = -inf, sum = 0.0, count = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = t * D + d;
      const double kept = excl[i] ? 0.0 : 1.0;
      sum += x[i] * kept;
      count += kept;
      if (!excl[i]) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
      }
    }
    if (w[d] == 0) {  // the mean of the non-outlier tokens, scale 0, no codes
      scale[d] = Half(0.f);
      zero[d] = to_half(count > 0.0 ? sum / std::max(count, 1.0) : 0.0);
      if (!std::isfinite(static_cast<float>(zero[d]))) return false;
      continue;
    }
    const int64_t levels = (int64_t{1} << w[d]) - 1;
    if (lo > hi) lo = hi = 0.0;  // every token an outlier
    zero[d] = to_half(lo);
    scale[d] = to_half((hi - lo) / static_cast<double>(levels));
    const double z64 = static_cast<float>(zero[d]), s64 = static_cast<float>(scale[d]);
    if (!std::isfinite(z64) || !std::isfinite(s64)) return false;
    if (!(s64 > 0.0)) continue;  // codes 0
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = t * D + d;
      if (excl[i]) continue;
      const uint8_t c = code_of(x[i], z64, s64, levels);
      if (c) put_code(kc, t * z.bits * D + off[d], c);
    }
  }
  // ---- values: per-token (and per channel group) min-max of the values or of v H
  // (values.HadamardValueCodec.frame)
  const int64_t levels = (int64_t{1} << z.bits) - 1;
  const Half* v = values + n * T * Dv;
  uint8_t* vc = vcodes + n * z.Vb;
  const int64_t Gv = z.Gv, C = Dv / Gv;
  Half* vs = vscal + n * 2 * T * Gv;  // [scale(T, Gv) | zero(T, Gv)], token-major
  std::vector<double> r(Dv);
  const double norm = 1.0 / std::sqrt(static_cast<double>(Dv));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < Dv; ++j) {
      const float f = static_cast<float>(v[t * Dv + j]);
      if (bad(f)) return false;
      r[j] = f;
    }
    if (hadamard) {  // fast Walsh-Hadamard transform: exact sums, the Sylvester sign matrix
      for (int64_t h = 1; h < Dv; h <<= 1) {
        for (int64_t i = 0; i < Dv; i += 2 * h) {
          for (int64_t j = i; j < i + h; ++j) {
            const double a = r[j], b = r[j + h];
            r[j] = a + b;
            r[j + h] = a - b;
          }
        }
      }
      for (int64_t j = 0; j < Dv; ++j) {
        const float f = static_cast<float>(to_half(r[j] * norm));
        if (bad(f)) return false;
        r[j] = f;
      }
    }
    for (int64_t g = 0; g < Gv; ++g) {  // min-max of each channel group's block
      const int64_t j0 = g * C, j1 = j0 + C;
      double lo = r[j0], hi = r[j0];
      for (int64_t j = j0 + 1; j < j1; ++j) {
        lo = r[j] < lo ? r[j] : lo;
        hi = r[j] > hi ? r[j] : hi;
      }
      Half& zero = vs[(T + t) * Gv + g];
      Half& scale = vs[t * Gv + g];
      zero = to_half(lo);
      scale = to_half((hi - lo) / static_cast<double>(levels));
      const double z64 = static_cast<float>(zero), s64 = static_cast<float>(scale);
      if (!std::isfinite(z64) || !std::isfinite(s64)) return false;
      if (!(s64 > 0.0)) continue;
      for (int64_t j = j0; j < j1; ++j) {
        const uint8_t c = code_of(r[j], z64, s64, levels);
        if (c) put_code(vc, (t * Dv + j) * z.bits, c);
      }
    }
  }
  return true;
}

}  // namespace kvlab_flush

// Code N flushed groups (docs/design.md, "Kernels", "Flush").
//   keys [N, T, D] float16 (storage-rounded, as gathered), rope_cos/rope_sin float32 [N, T, P]
//   (rotate_by_delta's tables for -position) or empty (keys already in the codec's frame),
//   pair_first/pair_second int64 [P], widths uint8 [N, P] (per-pair code widths) or empty
//   (every channel `bits`), values [N, T, Dv] float16 (Dv a power of two when hadamard),
//   outliers K per group, outlier_index int32 [N, K] (each group's outliers as the flush
//   would select them: table_terms' second output) or empty (selected here), value_groups G
//   (one value scale and zero per token and Dv / G channels; G divides Dv).
// Returns {key_codes uint8 [N, ceil(T D bits / 8)], key_scalars float16 [N, 2D] ([scale |
//   zero]), payload uint8 [N, K * 4] ([values | int16 indices]), value_codes uint8 [N, ceil(T
//   Dv bits / 8)], value_scalars float16 [N, 2TG] ([scale(T, G) | zero(T, G)])}, or an empty
//   list when the reference must
//   code these groups (a negative zero or non-finite input, a non-finite stored scalar).
std::vector<torch::Tensor> encode_groups(torch::Tensor keys, torch::Tensor rope_cos,
                                         torch::Tensor rope_sin, torch::Tensor pair_first,
                                         torch::Tensor pair_second, torch::Tensor widths,
                                         torch::Tensor values, int64_t bits, int64_t outliers,
                                         bool hadamard, torch::Tensor outlier_index,
                                         int64_t value_groups) {
  using kvlab_flush::Half;
  TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu(), "keys and values on the CPU");
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kHalf && keys.is_contiguous(),
              "keys must be contiguous float16 [N, T, D]");
  TORCH_CHECK(values.dim() == 3 && values.scalar_type() == at::kHalf && values.is_contiguous() &&
                  values.size(0) == keys.size(0) && values.size(1) == keys.size(1),
              "values must be contiguous float16 [N, T, Dv]");
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits must lie in 1..8");
  kvlab_flush::Sizes z{};
  z.N = keys.size(0);
  z.T = keys.size(1);
  z.D = keys.size(2);
  z.Dv = values.size(2);
  z.P = pair_first.numel();
  z.bits = bits;
  z.K = outliers;
  z.Kb = (z.T * z.D * bits + 7) / 8;
  z.Vb = (z.T * z.Dv * bits + 7) / 8;
  z.E = z.K * static_cast<int64_t>(sizeof(Half) + sizeof(int16_t));
  z.Gv = value_groups;
  TORCH_CHECK(z.T >= 1 && z.T <= 8192 && z.Dv >= 1 && z.Dv <= 8192,
              "group tokens and value head dim must lie in 1..8192");
  TORCH_CHECK(z.K >= 0 && z.K < z.T * z.D && z.T * z.D <= (1 << 15),
              "outliers must lie in 0..T*D-1 with T*D <= 2^15");
  TORCH_CHECK(!hadamard || (z.Dv & (z.Dv - 1)) == 0, "Hadamard values need a power-of-two Dv");
  TORCH_CHECK(z.Gv >= 1 && z.Dv % z.Gv == 0, "value groups must divide the value head dim");
  TORCH_CHECK(pair_first.scalar_type() == at::kLong && pair_second.scalar_type() == at::kLong &&
                  pair_first.is_contiguous() && pair_second.is_contiguous() &&
                  pair_second.numel() == z.P,
              "pair indices must be contiguous int64 [P]");
  const int64_t* first = pair_first.data_ptr<int64_t>();
  const int64_t* second = pair_second.data_ptr<int64_t>();
  for (int64_t p = 0; p < z.P; ++p)
    TORCH_CHECK(first[p] >= 0 && first[p] < z.D && second[p] >= 0 && second[p] < z.D,
                "pair indices must lie in 0..D-1");
  const bool rot = rope_cos.numel() > 0;
  if (rot) {
    for (const auto* t : {&rope_cos, &rope_sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                      t->size(0) == z.N && t->size(1) == z.T && t->size(2) == z.P,
                  "rope_cos/rope_sin must be contiguous float32 [N, T, P]");
  }
  const bool has_table = widths.numel() > 0;
  if (has_table) {
    TORCH_CHECK(widths.scalar_type() == at::kByte && widths.is_contiguous() &&
                    widths.numel() == z.N * z.P,
                "widths must be contiguous uint8 [N, P]");
    const uint8_t* w = widths.data_ptr<uint8_t>();
    for (int64_t i = 0; i < z.N * z.P; ++i) TORCH_CHECK(w[i] <= 8, "widths must be <= 8");
  }
  const bool given = outlier_index.numel() > 0;
  if (given) {
    TORCH_CHECK(outlier_index.scalar_type() == at::kInt && outlier_index.is_contiguous() &&
                    outlier_index.numel() == z.N * z.K,
                "outlier_index must be contiguous int32 [N, K]");
    const int32_t* o = outlier_index.data_ptr<int32_t>();
    for (int64_t n = 0; n < z.N; ++n)
      for (int64_t j = 0; j < z.K; ++j)
        TORCH_CHECK(o[n * z.K + j] >= (j ? o[n * z.K + j - 1] + 1 : 0) &&
                        o[n * z.K + j] < z.T * z.D,
                    "outlier_index rows must be ascending indices in 0..T*D-1");
  }
  const auto u8 = keys.options().dtype(at::kByte);
  auto kcodes = torch::zeros({z.N, z.Kb}, u8);
  auto kscal = torch::empty({z.N, 2 * z.D}, keys.options());
  auto payload = torch::empty({z.N, z.E}, u8);
  auto vcodes = torch::zeros({z.N, z.Vb}, u8);
  auto vscal = torch::empty({z.N, 2 * z.T * z.Gv}, keys.options());
  for (int64_t n = 0; n < z.N; ++n) {
    const bool exact = kvlab_flush::encode_group(
        z, n, reinterpret_cast<const Half*>(keys.data_ptr()),
        rot ? rope_cos.data_ptr<float>() : nullptr, rot ? rope_sin.data_ptr<float>() : nullptr,
        first, second, has_table ? widths.data_ptr<uint8_t>() : nullptr,
        reinterpret_cast<const Half*>(values.data_ptr()), hadamard,
        given ? outlier_index.data_ptr<int32_t>() : nullptr, kcodes.data_ptr<uint8_t>(),
        reinterpret_cast<Half*>(kscal.data_ptr()), payload.data_ptr<uint8_t>(),
        vcodes.data_ptr<uint8_t>(), reinterpret_cast<Half*>(vscal.data_ptr()));
    if (!exact) return {};
  }
  return {kcodes, kscal, payload, vcodes, vscal};
}
