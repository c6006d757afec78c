// PN-Mix packed attention on the CPU (docs/design.md, "Kernels").
//
// Reads a PackedStore's buffers in place (docs/design.md, "Storage format"): exact sinks and
// residual in the storage dtype, bit-packed key/value codes and their per-group scalars, the
// per-row host counts, the mix mask. One task per (row, split): an online softmax over its
// slice of the stream — the exact tokens (sinks + residual) as one segment, then one quantized
// group at a time — then the splits of a row are merged. GQA: the rep * Q query rows of a kv
// head share every decoded key.
//
// Numerics follow the torch reference (kvlab.pnmix.attention.packed_attention_reference):
// keys decode to float32 exactly as KeyCodec.decode does, zero + code * scale, minus the row's
// reference key mu; values are read as sum_t (p_t s_t) c_t + sum_t p_t z_t. No fast-math. The
// build allows fused multiply-adds (-ffp-contract=fast): code * scale is exact in float32 (a
// code has at most 8 significant bits, a float16/bfloat16 scale at most 11), so the fused
// zero + code * scale rounds once, exactly as the reference's two operations; the non-exact
// products of a decode, a phase level's c * (span / L) and a Phase–Norm key's r * cos, are
// rounded explicitly. Phase cos/sin are taken in double and rounded (the reference takes
// float32 cos/sin: the two agree to about one float32 ulp of the level's cosine). Dot products
// and sums use other orders than torch's: they agree to float32 rounding.
//
// A group's keys are decoded on a [T, D] float tile in the reference's steps
// (attention.decode_key_block, apply_key_payload, rotate_to_positions): (1) the codec's
// decode (per-channel with per-pair modes, per-channel with per-pair code widths, or per
// token), (2) the codec's exact sparse entries written back (the payload: K storage-dtype
// values, then K int16 flat indices t * D + d), (3) for a position-aware (pre-RoPE) codec,
// each key rotated to its position offset + S + g * T + t with the float32 cos/sin table the
// Python side builds from kvlab.rope (angles in float64, as rotate_by_delta), computed
// without fused multiply-adds so that the rotated keys are the reference's bit for bit; then
// the tile is centred by mu and scored. Values: a value codec that codes a rotated frame
// (Hadamard) has the quantized groups' weighted sums kept apart from the exact tokens' and
// mapped back once per query row (x @ H^T) at the end, as the reference's _Partials.merge.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kvlab_simd.h"  // v8f, load8, store8, hsum8, dot, dot4, exp_approx (kernels_common)

namespace {

constexpr int64_t kKeysPerChannel = 0;  // scalars [scale(D) | zero(D)], pair modes per pair
constexpr int64_t kKeysPerToken = 1;    // scalars [scale(T) | zero(T)]
constexpr int64_t kKeysWidths = 2;      // scalars [scale(D) | zero(D)], per-pair code widths
constexpr int64_t kPairCartesian = 0;
constexpr int64_t kPairPhaseNorm = 1;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// quantized groups a row attends before the next row takes its turn (run, one split)
constexpr int64_t kGroupBlock = 8;

typedef int32_t v8i __attribute__((vector_size(32)));  // v8f: kvlab_simd.h

// max / sum of x[0, n) with eight independent lanes (vectorizes without reassociation flags)
inline float lane_max(const float* x, int64_t n) {
  float lane[8] = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lane[j] = std::max(lane[j], x[i + j]);
  }
  for (; i < n; ++i) lane[0] = std::max(lane[0], x[i]);
  float top = lane[0];
  for (int j = 1; j < 8; ++j) top = std::max(top, lane[j]);
  return top;
}

inline float lane_sum(const float* x, int64_t n) {
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lane[j] += x[i + j];
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += x[i];
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7])) +
         tail;
}

// acc[0, n) += sum_t w[t] * x[t * ld + (0, n)] (ld: the row stride, n when omitted): 64 output
// channels at a time in eight registers (independent chains), then 8 at a time, then one
inline void accumulate(const float* w, const float* x, int64_t rows, int64_t n, float* acc,
                       int64_t ld) {
  int64_t d = 0;
  for (; d + 64 <= n; d += 64) {
    v8f a[8];
    for (int j = 0; j < 8; ++j) a[j] = load8(acc + d + 8 * j);
    for (int64_t t = 0; t < rows; ++t) {
      const float wt = w[t];
      const float* xt = x + t * ld + d;
      for (int j = 0; j < 8; ++j) a[j] += wt * load8(xt + 8 * j);
    }
    for (int j = 0; j < 8; ++j) store8(acc + d + 8 * j, a[j]);
  }
  for (; d + 8 <= n; d += 8) {
    v8f a = load8(acc + d);
    for (int64_t t = 0; t < rows; ++t) a += w[t] * load8(x + t * ld + d);
    store8(acc + d, a);
  }
  for (; d < n; ++d) {
    float a = acc[d];
    for (int64_t t = 0; t < rows; ++t) a += w[t] * x[t * ld + d];
    acc[d] = a;
  }
}

inline void accumulate(const float* w, const float* x, int64_t rows, int64_t n, float* acc) {
  accumulate(w, x, rows, n, acc, n);
}

inline uint32_t load_le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// Float codes of a little-endian bitstream (docs/design.md, "Storage format"): code k occupies
// stream bits [k * bits, (k + 1) * bits). Writes the first n codes to dst. Whole 32-bit words
// (2 and 4 bits) or 3-byte chunks (3 bits) are unpacked with constant shifts (vectorized);
// the tail code by code, never reading past ceil(n * bits / 8) bytes.
inline void unpack_codes(const uint8_t* src, int64_t n, int bits, float* dst) {
  int64_t k = 0;
  if (bits == 2) {
    const v8i lo = {0, 2, 4, 6, 8, 10, 12, 14};
    const v8i hi = lo + 16;
    for (; k + 16 <= n; k += 16) {
      const v8i w = v8i{} + static_cast<int32_t>(load_le32(src + k / 4));
      store8(dst + k, __builtin_convertvector((w >> lo) & 3, v8f));
      store8(dst + k + 8, __builtin_convertvector((w >> hi) & 3, v8f));
    }
  } else if (bits == 4) {
    const v8i sh = {0, 4, 8, 12, 16, 20, 24, 28};
    for (; k + 8 <= n; k += 8) {
      const v8i w = v8i{} + static_cast<int32_t>(load_le32(src + k / 2));
      store8(dst + k, __builtin_convertvector((w >> sh) & 15, v8f));
    }
  } else if (bits == 3) {
    const v8i sh = {0, 3, 6, 9, 12, 15, 18, 21};
    for (; k + 8 <= n; k += 8) {
      const uint8_t* p = src + 3 * (k / 8);
      const int32_t word = static_cast<int32_t>(p[0]) | (static_cast<int32_t>(p[1]) << 8) |
                           (static_cast<int32_t>(p[2]) << 16);
      const v8i w = v8i{} + word;
      store8(dst + k, __builtin_convertvector((w >> sh) & 7, v8f));
    }
  }
  const int64_t nbytes = (n * bits + 7) / 8;
  const uint32_t mask = (1u << bits) - 1u;
  for (; k < n; ++k) {
    const int64_t bit = k * bits;
    const int64_t byte = bit >> 3;
    uint32_t v = src[byte];
    if (byte + 1 < nbytes) v |= static_cast<uint32_t>(src[byte + 1]) << 8;
    dst[k] = static_cast<float>((v >> (bit & 7)) & mask);
  }
}

template <typename S>
struct Inputs {
  // query rows: [B, H, M, D] float32, already scaled; mu: [B, H, D] float32
  const float* q;
  const float* mu;
  const S* sink_k;
  const S* sink_v;
  const S* res_k;
  const S* res_v;
  const uint8_t* key_codes;
  const S* key_scalars;
  const uint8_t* value_codes;
  const S* value_scalars;    // [.., 2 T Gv]: [scale(T, Gv) | zero(T, Gv)], token-major
  const int64_t* sink_len;   // [B * H]
  const int64_t* group_cnt;  // [B * H]
  const int64_t* res_len;    // [B * H]
  const bool* mask;          // [B, H, P] mix mask (True = second codec) or nullptr
  const int64_t* pair_first;
  const int64_t* pair_second;
  const float* sink_logits;  // [H * rep] learned sinks or nullptr
  const uint8_t* widths;     // [B, H, P] per-pair code widths (kKeysWidths) or nullptr
  const uint8_t* payload;    // [B, H, G_cap, E] per-group exact entries or nullptr
  int64_t E, K;              // payload bytes per group, entries per group
  const float* rope_cos;     // [rope_rows, P] cos of (rope_base + row) * inv_freq, or nullptr
  const float* rope_sin;
  int64_t rope_base, rope_rows;
  const int64_t* pos_offset;  // [B * H] RoPE position offsets (rotation) or nullptr
  int64_t sink_tokens;        // group slot g starts at stream index sink_tokens + g * T
  const float* hadamard;      // [Dv, Dv] value output transform or nullptr
  int64_t mode_first, mode_second, key_kind;
  int64_t res_extra;  // tokens to add to every residual count (a decode step's own token)
  int64_t B, H, M, Q, rep, D, Dv, S_cap, R_cap, G_cap, T, bits, Kb, Vb, Sk, P;
  int64_t Gv;  // value channel groups: one scale and zero per token and Dv / Gv channels
  bool causal;
  float softcap;  // <= 0: none
};

// Softmax partials of one task: running max m, sum l, the quantized groups' code accumulator
// acc [M, Dv] and zero-point accumulator accz [M, Gv] (their values: acc + accz of the
// channel's group, in the value codec's frame), and the exact tokens' accumulator acce [M, Dv]
// (docs/design.md "Attention").
struct Partial {
  std::vector<float> m, l, acc, accz, acce;
  int64_t Gv = 1;
  void init(int64_t M, int64_t Dv, int64_t groups) {
    Gv = groups;
    m.assign(M, kNegInf);
    l.assign(M, 0.f);
    acc.assign(M * Dv, 0.f);
    accz.assign(M * Gv, 0.f);
    acce.assign(M * Dv, 0.f);
  }
  // multiply row m's sums by a (a new running maximum)
  void rescale(int64_t row, int64_t Dv, float a) {
    l[row] *= a;
    for (int64_t g = 0; g < Gv; ++g) accz[row * Gv + g] *= a;
    float* o = acc.data() + row * Dv;
    float* e = acce.data() + row * Dv;
    for (int64_t d = 0; d < Dv; ++d) {
      o[d] *= a;
      e[d] *= a;
    }
  }
};

// accz[m * stride] += sum_t p[m * T + t] * zero[t] for every row m: each row's sum in token
// order, as a multiply, then an add (what the compiled row loop does: GCC keeps a loop's single
// chain of multiply-adds unfused on Zen), the rows' chains interleaved so they overlap
__attribute__((optimize("fp-contract=off"))) void zero_sums(const float* p, const float* zero,
                                                            int64_t M, int64_t T, float* accz,
                                                            int64_t stride) {
  float z[64];
  for (int64_t m0 = 0; m0 < M; m0 += 64) {
    const int64_t rows = std::min<int64_t>(64, M - m0);
    for (int64_t m = 0; m < rows; ++m) z[m] = 0.f;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t m = 0; m < rows; ++m) z[m] = z[m] + p[(m0 + m) * T + t] * zero[t];
    for (int64_t m = 0; m < rows; ++m) accz[(m0 + m) * stride] += z[m];
  }
}

// rotate_keys (half layout: pairs (p, p + P)) with row t of the cos/sin tables at cs/sn + t * P,
// then every channel minus mu: the same operations, in one pass over the tile
__attribute__((optimize("fp-contract=off"))) void rotate_centre_half(float* k, int64_t T,
                                                                     int64_t D, int64_t P,
                                                                     const float* cs,
                                                                     const float* sn,
                                                                     const float* mu) {
  for (int64_t t = 0; t < T; ++t) {
    float* x = k + t * D;
    float* y = x + P;
    const float* c = cs + t * P;
    const float* s = sn + t * P;
    int64_t p = 0;
    for (; p + 8 <= P; p += 8) {
      const v8f x1 = load8(x + p), x2 = load8(y + p), cv = load8(c + p), sv = load8(s + p);
      const v8f a = x1 * cv, b = x2 * sv, e = x1 * sv, f = x2 * cv;
      store8(x + p, (a - b) - load8(mu + p));
      store8(y + p, (e + f) - load8(mu + P + p));
    }
    for (; p < P; ++p) {
      const float x1 = x[p], x2 = y[p];
      const float a = x1 * c[p], b = x2 * s[p];
      const float e = x1 * s[p], f = x2 * c[p];
      x[p] = (a - b) - mu[p];
      y[p] = (e + f) - mu[P + p];
    }
    for (int64_t d = 2 * P; d < D; ++d) x[d] -= mu[d];
  }
}

// Rotate the rotary pairs (first[p], second[p]) of keys [T, D] by the table rows cs/sn
// (row t at t * P): y1 = x1 cos - x2 sin, y2 = x1 sin + x2 cos, every product and sum rounded
// to float32 separately, as kvlab.rope's float32 rotation (no fused multiply-add).
__attribute__((optimize("fp-contract=off"))) void rotate_keys(
    float* k, int64_t T, int64_t D, const int64_t* first, const int64_t* second, int64_t P,
    const float* const* cs_rows, const float* const* sn_rows, bool half) {
  if (half) {  // pairs (p, p + P): eight pairs at a time
    for (int64_t t = 0; t < T; ++t) {
      float* x = k + t * D;
      float* y = x + P;
      const float* cs = cs_rows[t];
      const float* sn = sn_rows[t];
      int64_t p = 0;
      for (; p + 8 <= P; p += 8) {
        const v8f x1 = load8(x + p), x2 = load8(y + p), c = load8(cs + p), s = load8(sn + p);
        const v8f a = x1 * c, b = x2 * s, e = x1 * s, f = x2 * c;
        store8(x + p, a - b);
        store8(y + p, e + f);
      }
      for (; p < P; ++p) {
        const float x1 = x[p], x2 = y[p];
        const float a = x1 * cs[p], b = x2 * sn[p];
        const float e = x1 * sn[p], f = x2 * cs[p];
        x[p] = a - b;
        y[p] = e + f;
      }
    }
    return;
  }
  for (int64_t t = 0; t < T; ++t) {
    float* kt = k + t * D;
    const float* cs = cs_rows[t];
    const float* sn = sn_rows[t];
    for (int64_t p = 0; p < P; ++p) {
      const float x1 = kt[first[p]], x2 = kt[second[p]];
      const float a = x1 * cs[p], b = x2 * sn[p];
      const float c = x1 * sn[p], e = x2 * cs[p];
      kt[first[p]] = a - b;
      kt[second[p]] = c + e;
    }
  }
}

// The working buffers of RowTask's groups and exact segment; one per thread, shared by the
// row tasks it runs one after another
struct Scratch {
  std::vector<int64_t> idx;
  std::vector<const float*> cs_rows, sn_rows;
  std::vector<float> keys, codes, p, w, vals, scale, zero;
};

template <typename S>
class RowTask {
 public:
  RowTask(const Inputs<S>& in, int64_t row, Scratch& scratch)
      : in_(in),
        row_(row),
        idx_(scratch.idx),
        cs_rows_(scratch.cs_rows),
        sn_rows_(scratch.sn_rows),
        keys_(scratch.keys),
        codes_(scratch.codes),
        p_(scratch.p),
        w_(scratch.w),
        vals_(scratch.vals),
        scale_(scratch.scale),
        zero_(scratch.zero) {
    const int64_t M = in.M, D = in.D;
    q_ = in.q + row * M * D;
    mu_ = in.mu + row * D;
    s_len_ = in.sink_len[row];
    g_cnt_ = in.group_cnt[row];
    r_len_ = in.res_len[row] + in.res_extra;
    const int64_t n = s_len_ + g_cnt_ * in.T + r_len_;
    limit_.resize(M);
    for (int64_t m = 0; m < M; ++m) {
      limit_[m] = in.causal ? n - in.Q + (m % in.Q) + 1 : n;  // visible: stream index < limit
    }
    if (in.softcap > 0.f || in.sink_logits != nullptr) {
      q_mu_.resize(M);
      for (int64_t m = 0; m < M; ++m) q_mu_[m] = dot(q_ + m * D, mu_, D);
    }
    if (in.key_kind == kKeysPerChannel) {
      for (int64_t p = 0; p < in.P; ++p) {
        const bool second = in.mask != nullptr && in.mask[row * in.P + p];
        if ((second ? in.mode_second : in.mode_first) == kPairPhaseNorm) pn_pairs_.push_back(p);
      }
    }
    if (in.key_kind == kKeysWidths) plan_widths();
    half_pairs_ = true;
    for (int64_t p = 0; p < in.P; ++p)
      half_pairs_ = half_pairs_ && in.pair_first[p] == p && in.pair_second[p] == p + in.P;
  }

  int64_t groups() const { return g_cnt_; }

  // the exact segment (sinks, then residual) into `out`
  void exact(Partial& out) {
    const Inputs<S>& in = in_;
    const int64_t E = s_len_ + r_len_;
    if (E == 0) return;
    const int64_t D = in.D, Dv = in.Dv, M = in.M;
    keys_.resize(E * D);
    idx_.resize(E);
    for (int64_t i = 0; i < E; ++i) {
      const S* src = i < s_len_ ? in.sink_k + (row_ * in.S_cap + i) * D
                                : in.res_k + (row_ * in.R_cap + (i - s_len_)) * D;
      float* dst = keys_.data() + i * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) - mu_[d];
      idx_[i] = i < s_len_ ? i : s_len_ + g_cnt_ * in.T + (i - s_len_);
    }
    if (!score(E, out)) return;
    vals_.resize(E * Dv);
    for (int64_t i = 0; i < E; ++i) {
      const S* src = i < s_len_ ? in.sink_v + (row_ * in.S_cap + i) * Dv
                                : in.res_v + (row_ * in.R_cap + (i - s_len_)) * Dv;
      for (int64_t d = 0; d < Dv; ++d) vals_[i * Dv + d] = static_cast<float>(src[d]);
    }
    for (int64_t m = 0; m < M; ++m)
      accumulate(p_.data() + m * E, vals_.data(), E, Dv, out.acce.data() + m * Dv);
  }

  // quantized groups [g0, g1) into `out`
  void groups(int64_t g0, int64_t g1, Partial& out) {
    const Inputs<S>& in = in_;
    const int64_t T = in.T, D = in.D, Dv = in.Dv, M = in.M;
    keys_.resize(T * D);
    codes_.resize(T * std::max(D, Dv) + 8);
    w_.resize(M * T);
    idx_.resize(T);
    scale_.resize(std::max(D, T));
    zero_.resize(std::max(D, T));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t slot = row_ * in.G_cap + g;
      const int64_t first = s_len_ + g * T;
      for (int64_t t = 0; t < T; ++t) idx_[t] = first + t;
      decode_keys(in.key_codes + slot * in.Kb, in.key_scalars + slot * in.Sk);
      if (in.K > 0) apply_payload(in.payload + slot * in.E);
      if (in.rope_cos != nullptr && half_pairs_) {
        const int64_t base = in.pos_offset[row_] + in.sink_tokens + g * T - in.rope_base;
        rotate_centre_half(keys_.data(), T, D, in.P, in.rope_cos + base * in.P,
                           in.rope_sin + base * in.P, mu_);
      } else {
        if (in.rope_cos != nullptr) rotate(in.sink_tokens + g * T);
        centre();
      }
      if (!score(T, out)) continue;
      // values, per channel group j (channels [j C, (j + 1) C), C = Dv / Gv):
      // acc[:, group j] += (p * s_j) @ codes[:, group j], accz[:, j] += p . z_j
      unpack_codes(in.value_codes + slot * in.Vb, T * Dv, static_cast<int>(in.bits), codes_.data());
      const int64_t Gv = in.Gv, C = Dv / Gv;
      const S* vs = in.value_scalars + slot * 2 * T * Gv;
      for (int64_t j = 0; j < Gv; ++j) {
        for (int64_t t = 0; t < T; ++t) {
          scale_[t] = static_cast<float>(vs[t * Gv + j]);
          zero_[t] = static_cast<float>(vs[(T + t) * Gv + j]);
        }
        // w = p * s for every row, the zero-point sums (each row's in token order, the rows'
        // chains interleaved), then each row's weighted sum of the codes (the tile is in L1)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t t = 0; t < T; ++t) w_[m * T + t] = p_[m * T + t] * scale_[t];
        zero_sums(p_.data(), zero_.data(), M, T, out.accz.data() + j, Gv);
        for (int64_t m = 0; m < M; ++m)
          accumulate(w_.data() + m * T, codes_.data() + j * C, T, C, out.acc.data() + m * Dv + j * C,
                     Dv);
      }
    }
  }

  // learned sinks: one more logit per query row, no value
  void sinks(Partial& out) {
    const Inputs<S>& in = in_;
    if (in.sink_logits == nullptr) return;
    const int64_t h = row_ % in.H;
    for (int64_t m = 0; m < in.M; ++m) {
      float s = in.sink_logits[h * in.rep + m / in.Q];
      if (!(in.softcap > 0.f)) s -= q_mu_[m];  // into the centred logits' frame
      merge_segment(out, m, s, 1.f, nullptr, nullptr, nullptr);
    }
  }

  // merge a segment (max sm, sum sl, accumulators: acc [Dv], accz [Gv], acce [Dv], each
  // nullptr for zeros) into out's row m
  void merge_segment(Partial& out, int64_t m, float sm, float sl, const float* acc,
                     const float* accz, const float* acce) {
    const int64_t Dv = in_.Dv;
    const float cur = out.m[m];
    const float top = std::max(cur, sm);
    if (top == kNegInf) return;
    const float a = std::exp(cur - top);
    const float b = std::exp(sm - top);
    out.l[m] = out.l[m] * a + sl * b;
    for (int64_t j = 0; j < out.Gv; ++j)
      out.accz[m * out.Gv + j] = out.accz[m * out.Gv + j] * a + (accz ? accz[j] * b : 0.f);
    float* o = out.acc.data() + m * Dv;
    for (int64_t d = 0; d < Dv; ++d) o[d] = o[d] * a + (acc ? acc[d] * b : 0.f);
    float* e = out.acce.data() + m * Dv;
    for (int64_t d = 0; d < Dv; ++d) e[d] = e[d] * a + (acce ? acce[d] * b : 0.f);
    out.m[m] = top;
  }

 private:
  // Per channel of this row: where its code sits inside a token of the width layout
  // (width_codec.channel_bit_offsets: widths descending, then channel index ascending; token
  // stride bits * D bits) as a byte, a shift and a mask.
  void plan_widths() {
    const Inputs<S>& in = in_;
    const int64_t D = in.D;
    std::vector<int64_t> w(D, in.bits);
    for (int64_t p = 0; p < in.P; ++p) {
      const int64_t v = in.widths[row_ * in.P + p];
      w[in.pair_first[p]] = v;
      w[in.pair_second[p]] = v;
    }
    std::vector<int64_t> order(D);
    for (int64_t d = 0; d < D; ++d) order[d] = d;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return w[a] > w[b]; });
    std::vector<int64_t> offset(D);
    int64_t start = 0;
    for (const int64_t d : order) {
      offset[d] = start;
      start += w[d];
    }
    ch_byte_.resize(D);
    ch_byte32_.resize(D);
    ch_shift_.resize(D);
    ch_mask_.resize(D);
    max_byte_ = 0;
    for (int64_t d = 0; d < D; ++d) {
      ch_byte_[d] = offset[d] >> 3;
      ch_byte32_[d] = static_cast<int32_t>(ch_byte_[d]);
      max_byte_ = std::max(max_byte_, ch_byte_[d]);
      ch_shift_[d] = static_cast<uint32_t>(offset[d] & 7);
      ch_mask_[d] = (1u << w[d]) - 1u;
    }
    plan_shuffles();
  }

  // The byte shuffles of unpack_widths_shuffled: a token's code for channel d lies in its
  // bytes ch_byte_[d] and ch_byte_[d] + 1 (shift <= 7, width <= 8). Sources are the token's
  // 16 bytes from offset 8k (k < sources_, each within the token); channel d reads source
  // min(byte / 8, sources_ - 1), which holds both its bytes, or the first and nothing after
  // the token's end (a code never extends past it). Per chunk of eight channels and source,
  // a 32-byte vpshufb control (bytes 4i, 4i + 1 of lane i: the two bytes; the rest 0x80, zero)
  // and whether any lane of the chunk reads that source.
  void plan_shuffles() {
    const Inputs<S>& in = in_;
    const int64_t D = in.D, stride = in.bits * D;
    sources_ = 0;
#if defined(__AVX2__)
    const int64_t tb = stride / 8;
    if (stride % 8 != 0 || D % 8 != 0 || (tb != 16 && tb != 24 && tb != 32)) return;
    const int64_t K = (tb - 16) / 8 + 1;
    const int64_t chunks = D / 8;
    shuffle_.assign(chunks * K * 32, 0x80);
    shuffle_used_.assign(chunks * K, 0);
    for (int64_t d = 0; d < D; ++d) {
      const int64_t b = ch_byte_[d];
      const int64_t k = std::min<int64_t>(b / 8, K - 1);
      const int64_t c = d / 8, lane = d % 8;
      uint8_t* ctl = shuffle_.data() + (c * K + k) * 32 + 4 * lane;
      ctl[0] = static_cast<uint8_t>(b - 8 * k);
      if (b + 1 < tb && b + 1 - 8 * k < 16) ctl[1] = static_cast<uint8_t>(b + 1 - 8 * k);
      shuffle_used_[c * K + k] = 1;
    }
    sources_ = K;
#endif
  }

#if defined(__AVX2__)
  // (1) for the width layout with a shuffle plan: codes of the group's tokens decoded straight
  // into keys_ [T, D]: zero + code * scale (exact product, one rounding, as decode_keys)
  void decode_widths_shuffled(const uint8_t* packed, const float* sc, const float* ze) {
    const Inputs<S>& in = in_;
    const int64_t T = in.T, D = in.D, tb = in.bits * D / 8, K = sources_, chunks = D / 8;
    float* k = keys_.data();
    for (int64_t c = 0; c < chunks; ++c) {  // a chunk's controls and scalars stay in registers
      __m256i ctl[3];
      int64_t used[3], n = 0;
      for (int64_t j = 0; j < K; ++j) {
        if (!shuffle_used_[c * K + j]) continue;
        ctl[n] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(shuffle_.data() + (c * K + j) * 32));
        used[n++] = j;
      }
      const __m256i sh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&ch_shift_[8 * c]));
      const __m256i mk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&ch_mask_[8 * c]));
      const __m256 scale = _mm256_loadu_ps(sc + 8 * c), zero = _mm256_loadu_ps(ze + 8 * c);
      for (int64_t t = 0; t < T; ++t) {
        const uint8_t* tok = packed + t * tb;
        __m256i v = _mm256_setzero_si256();
        for (int64_t i = 0; i < n; ++i) {
          const __m256i src = _mm256_broadcastsi128_si256(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(tok + 8 * used[i])));
          v = _mm256_or_si256(v, _mm256_shuffle_epi8(src, ctl[i]));
        }
        const __m256 code = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, sh), mk));
        // zero + code * scale: the product is exact, so fused or not it rounds once
        _mm256_storeu_ps(k + t * D + 8 * c, _mm256_fmadd_ps(code, scale, zero));
      }
    }
  }
#endif

  // codes of a group in the width layout into codes_ [T, D] (floats)
  void unpack_widths(const uint8_t* packed) {
    const Inputs<S>& in = in_;
    const int64_t T = in.T, D = in.D, stride = in.bits * D, nbytes = in.Kb;
    float* dst = codes_.data();
    int64_t t = 0;
    if (stride % 8 == 0) {  // byte-aligned tokens: one unaligned 32-bit load per code
      const int64_t tb = stride / 8;
      // tokens whose every 4-byte load stays inside the group's bytes
      const int64_t room = nbytes - max_byte_ - 4;
      const int64_t safe = room < 0 ? 0 : std::min<int64_t>(T, room / tb + 1);
      const int32_t* byte = ch_byte32_.data();
      const uint32_t* sh = ch_shift_.data();
      const uint32_t* mask = ch_mask_.data();
      for (; t < safe; ++t) {
        const uint8_t* tok = packed + t * tb;
        float* o = dst + t * D;
        int64_t d = 0;
#if defined(__AVX2__)
        // eight channels at a time: gather their 32-bit windows, shift, mask, convert
        for (; d + 8 <= D; d += 8) {
          const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(byte + d));
          const __m256i sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh + d));
          const __m256i mv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask + d));
          const __m256i v = _mm256_i32gather_epi32(reinterpret_cast<const int*>(tok), at, 1);
          const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(v, sv), mv);
          _mm256_storeu_ps(o + d, _mm256_cvtepi32_ps(c));
        }
#endif
        for (; d < D; ++d) {
          uint32_t v;
          std::memcpy(&v, tok + byte[d], 4);
          o[d] = static_cast<float>(static_cast<int32_t>((v >> sh[d]) & mask[d]));
        }
      }
    }
    for (; t < T; ++t) {
      const int64_t bit0 = t * stride;
      const uint8_t* tok = packed + (bit0 >> 3);
      const uint32_t sh0 = static_cast<uint32_t>(bit0 & 7);
      const int64_t left = nbytes - (bit0 >> 3);  // bytes readable from tok
      for (int64_t d = 0; d < D; ++d) {
        // the code lies within 2 bytes from tok + byte (shift <= 7, width <= 8)
        const int64_t byte = ch_byte_[d] + ((sh0 + ch_shift_[d]) >> 3);
        const uint32_t sh = (sh0 + ch_shift_[d]) & 7;
        uint32_t v = tok[byte];
        if (byte + 1 < left) v |= static_cast<uint32_t>(tok[byte + 1]) << 8;
        dst[t * D + d] = static_cast<float>((v >> sh) & ch_mask_[d]);
      }
    }
  }

  // (2) the group's exact sparse entries written over keys_ (payload: K values, K indices)
  void apply_payload(const uint8_t* payload) {
    const Inputs<S>& in = in_;
    const int64_t K = in.K;
    const uint8_t* idx = payload + K * static_cast<int64_t>(sizeof(S));
    float* k = keys_.data();
    const int64_t n = in.T * in.D;
    for (int64_t i = 0; i < K; ++i) {
      S v;
      int16_t j;
      std::memcpy(&v, payload + i * sizeof(S), sizeof(S));
      std::memcpy(&j, idx + 2 * i, 2);
      const int64_t at = static_cast<int64_t>(static_cast<uint16_t>(j));
      if (at < n) k[at] = static_cast<float>(v);
    }
  }

  // (3) rotate keys_ row t to stream index `first + t` of this row
  void rotate(int64_t first) {
    const Inputs<S>& in = in_;
    const int64_t T = in.T, P = in.P;
    cs_rows_.resize(T);
    sn_rows_.resize(T);
    const int64_t base = in.pos_offset[row_] + first - in.rope_base;
    for (int64_t t = 0; t < T; ++t) {
      cs_rows_[t] = in.rope_cos + (base + t) * P;
      sn_rows_[t] = in.rope_sin + (base + t) * P;
    }
    rotate_keys(keys_.data(), T, in.D, in.pair_first, in.pair_second, P, cs_rows_.data(),
                sn_rows_.data(), half_pairs_);
  }

  // keys_ [T, D] minus mu
  void centre() {
    const int64_t T = in_.T, D = in_.D;
    float* k = keys_.data();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) k[t * D + d] -= mu_[d];
  }

  // (1) the codec's decode of one group into keys_ [T, D] (float32, as KeyCodec.decode)
  void decode_keys(const uint8_t* packed, const S* scalars) {
    const Inputs<S>& in = in_;
    const int64_t T = in.T, D = in.D;
    const int64_t n = T * D;
#if defined(__AVX2__)
    if (in.key_kind == kKeysWidths && sources_ > 0) {
      float* sc = scale_.data();
      float* ze = zero_.data();
      for (int64_t d = 0; d < D; ++d) {
        sc[d] = static_cast<float>(scalars[d]);
        ze[d] = static_cast<float>(scalars[D + d]);
      }
      decode_widths_shuffled(packed, sc, ze);
      return;
    }
#endif
    if (in.key_kind == kKeysWidths) {
      unpack_widths(packed);
    } else {
      unpack_codes(packed, n, static_cast<int>(in.bits), codes_.data());
    }
    const float* c = codes_.data();
    float* k = keys_.data();
    if (in.key_kind == kKeysPerToken) {
      for (int64_t t = 0; t < T; ++t) {
        const float s = static_cast<float>(scalars[t]);
        const float z = static_cast<float>(scalars[T + t]);
        for (int64_t d = 0; d < D; ++d) k[t * D + d] = z + c[t * D + d] * s;
      }
      return;
    }
    float* sc = scale_.data();
    float* ze = zero_.data();
    for (int64_t d = 0; d < D; ++d) {
      sc[d] = static_cast<float>(scalars[d]);
      ze[d] = static_cast<float>(scalars[D + d]);
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) k[t * D + d] = ze[d] + c[t * D + d] * sc[d];
    if (pn_pairs_.empty()) return;
    const int64_t levels = (int64_t{1} << in.bits) - 1;
    float cos_t[256], sin_t[256];
    for (const int64_t p : pn_pairs_) {
      const int64_t f = in.pair_first[p], s = in.pair_second[p];
      // phase levels offset + c * (span / L) (quantizers.phase_levels), then cos/sin
      const float step = sc[s] / static_cast<float>(levels);
      for (int64_t v = 0; v <= levels; ++v) {
        volatile float product = static_cast<float>(v) * step;  // rounded, never fused
        const float lv = ze[s] + product;
        cos_t[v] = static_cast<float>(std::cos(static_cast<double>(lv)));
        sin_t[v] = static_cast<float>(std::sin(static_cast<double>(lv)));
      }
      for (int64_t t = 0; t < T; ++t) {
        const float r = ze[f] + c[t * D + f] * sc[f];
        const int64_t phase = static_cast<int64_t>(c[t * D + s]);
        volatile float a = r * cos_t[phase];  // rounded before centring, never fused
        volatile float b = r * sin_t[phase];
        k[t * D + f] = a;
        k[t * D + s] = b;
      }
    }
  }

  // logits of keys_ [W, D] (centred) for every query row, masked by stream index idx_, then
  // the online-softmax update of `out` and the weights p_ [M, W]. Returns whether any weight
  // is nonzero.
  bool score(int64_t W, Partial& out) {
    const Inputs<S>& in = in_;
    const int64_t M = in.M, D = in.D, Dv = in.Dv;
    p_.resize(M * W);
    bool any = false;
    const float* k = keys_.data();
    // every row sees every key (a decode step's groups): all rows' logits in one GQA tile,
    // each with the bits of the row loop below (dot4 for the first W / 4 * 4 keys, then dot)
    bool tiled = W > 0 && D % 8 == 0;
    for (int64_t m = 0; m < M && tiled; ++m) tiled = idx_[W - 1] < limit_[m];
    if (tiled) score_tile(q_, M, D, k, W, p_.data(), W, W / 4 * 4);
    for (int64_t m = 0; m < M; ++m) {
      const float* qm = q_ + m * D;
      float* lg = p_.data() + m * W;
      int64_t visible = tiled ? W : 0;
      while (visible < W && idx_[visible] < limit_[m]) ++visible;  // idx_ increases
      int64_t t = tiled ? visible : 0;
      for (; t + 4 <= visible; t += 4) dot4(qm, k + t * D, D, D, lg + t);
      for (; t < visible; ++t) lg[t] = dot(qm, k + t * D, D);
      if (in.softcap > 0.f) {
        const float cap = in.softcap;
        for (int64_t t = 0; t < visible; ++t) lg[t] = cap * std::tanh((lg[t] + q_mu_[m]) / cap);
      }
      const float top = lane_max(lg, visible);
      if (visible == 0) {
        std::fill(lg, lg + W, 0.f);
        continue;
      }
      any = true;
      const float cur = out.m[m];
      const float next = std::max(cur, top);
      if (next > cur && cur != kNegInf) out.rescale(m, Dv, std::exp(cur - next));
      out.m[m] = next;
      for (int64_t t = 0; t < visible; ++t) lg[t] = exp_approx(lg[t] - next);
      std::fill(lg + visible, lg + W, 0.f);
      out.l[m] += lane_sum(lg, visible);
    }
    return any;
  }

  const Inputs<S>& in_;
  int64_t row_;
  // per-group working buffers (Scratch: shared by the tasks of one thread)
  std::vector<int64_t>& idx_;
  std::vector<const float*>&cs_rows_, &sn_rows_;
  std::vector<float>&keys_, &codes_, &p_, &w_, &vals_, &scale_, &zero_;
  const float* q_;
  const float* mu_;
  int64_t s_len_, g_cnt_, r_len_;
  bool half_pairs_ = false;
  std::vector<int64_t> limit_, pn_pairs_, ch_byte_;
  std::vector<uint32_t> ch_shift_, ch_mask_;
  std::vector<int32_t> ch_byte32_;
  int64_t max_byte_ = 0;
  int64_t sources_ = 0;  // > 0: the width layout decodes by byte shuffles (plan_shuffles)
  std::vector<uint8_t> shuffle_, shuffle_used_;
  std::vector<float> q_mu_;
};

// out row m = (T(acc + accz) + acce) / l (accz: the channel's group's), T the value output
// transform (x @ H^T; H is symmetric) or the identity
void finish(const Partial& part, int64_t M, int64_t Dv, const float* hadamard, float* out) {
  const float tiny = std::numeric_limits<float>::min();
  const int64_t Gv = part.Gv, C = Dv / Gv;
  std::vector<float> coded(Dv), mapped(Dv);
  for (int64_t m = 0; m < M; ++m) {
    const float l = std::max(part.l[m], tiny);
    for (int64_t d = 0; d < Dv; ++d) coded[d] = part.acc[m * Dv + d] + part.accz[m * Gv + d / C];
    if (hadamard != nullptr) {
      std::fill(mapped.begin(), mapped.end(), 0.f);
      accumulate(coded.data(), hadamard, Dv, Dv, mapped.data());
    } else {
      mapped = coded;
    }
    for (int64_t d = 0; d < Dv; ++d) out[m * Dv + d] = (mapped[d] + part.acce[m * Dv + d]) / l;
  }
}

template <typename S>
void run(const Inputs<S>& in, int64_t splits, float* out) {
  const int64_t rows = in.B * in.H;
  const int64_t M = in.M, Dv = in.Dv;
  if (splits <= 1) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      // the rows of a task advance through their groups together, a block at a time, so that
      // rows at equal positions (the kv heads and sequences of a batch) read the same cos/sin
      // rows while they are in cache; each row's partial sees its segments in the same order
      Scratch scratch;
      std::vector<RowTask<S>> tasks;
      tasks.reserve(end - begin);
      std::vector<Partial> parts(end - begin);
      int64_t most = 0;
      for (int64_t row = begin; row < end; ++row) {
        tasks.emplace_back(in, row, scratch);
        parts[row - begin].init(M, Dv, in.Gv);
        tasks.back().exact(parts[row - begin]);
        most = std::max(most, tasks.back().groups());
      }
      for (int64_t g0 = 0; g0 < most; g0 += kGroupBlock) {
        for (size_t i = 0; i < tasks.size(); ++i) {
          const int64_t n = tasks[i].groups();
          if (g0 < n) tasks[i].groups(g0, std::min(n, g0 + kGroupBlock), parts[i]);
        }
      }
      for (int64_t row = begin; row < end; ++row) {
        tasks[row - begin].sinks(parts[row - begin]);
        finish(parts[row - begin], M, Dv, in.hadamard, out + row * M * Dv);
      }
    });
    return;
  }
  // split-K: task (row, split) handles a contiguous share of the row's groups; split 0 also
  // the exact segment; the partials of a row are merged afterwards (FlashDecoding).
  std::vector<Partial> parts(rows * splits);
  at::parallel_for(0, rows * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task_id = begin; task_id < end; ++task_id) {
      const int64_t row = task_id / splits, split = task_id % splits;
      RowTask<S> task(in, row, scratch);
      Partial& part = parts[task_id];
      part.init(M, Dv, in.Gv);
      const int64_t n = task.groups();
      const int64_t per = (n + splits - 1) / splits;
      const int64_t g0 = std::min(n, split * per), g1 = std::min(n, g0 + per);
      if (split == 0) task.exact(part);
      task.groups(g0, g1, part);
    }
  });
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t row = begin; row < end; ++row) {
      RowTask<S> task(in, row, scratch);
      Partial& total = parts[row * splits];
      for (int64_t s = 1; s < splits; ++s) {
        const Partial& p = parts[row * splits + s];
        for (int64_t m = 0; m < M; ++m)
          task.merge_segment(total, m, p.m[m], p.l[m], p.acc.data() + m * Dv,
                             p.accz.data() + m * in.Gv, p.acce.data() + m * Dv);
      }
      task.sinks(total);
      finish(total, M, Dv, in.hadamard, out + row * M * Dv);
    }
  });
}

void check_buffer(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions");
}

template <typename S>
const S* ptr(const torch::Tensor& t) {
  return reinterpret_cast<const S*>(t.data_ptr());
}

// The layer's buffers and codec description, as the Python side passes them.
struct Layer {
  torch::Tensor sink_k, sink_v, key_codes, key_scalars, value_codes, value_scalars, res_k, res_v;
  torch::Tensor counts;  // int64 [3, B, H]: sinks, groups, residual
  torch::Tensor mask;    // bool [B, H, P] or empty
  torch::Tensor pair_first, pair_second;  // int64 [P]
  torch::Tensor sink_logits;              // float32 [H * rep] or empty
  int64_t key_kind, mode_first, mode_second, bits, group_tokens;
  // issue-8 codecs (empty tensors when unused): per-pair widths uint8 [B, H, P]; key payload
  // uint8 [B, H, G_cap, E]; cos/sin float32 [rows, P] of positions rope_base + row; position
  // offsets int64 [B, H]; the value output transform float32 [Dv, Dv]
  torch::Tensor widths, payload, rope_cos, rope_sin, pos_offset, hadamard;
  int64_t rope_base, sink_tokens;

  void check(int64_t D) const {
    check_buffer(sink_k, "sink_keys", 4);
    check_buffer(sink_v, "sink_values", 4);
    check_buffer(key_codes, "key_codes", 4);
    check_buffer(key_scalars, "key_scalars", 4);
    check_buffer(value_codes, "value_codes", 4);
    check_buffer(value_scalars, "value_scalars", 4);
    check_buffer(res_k, "residual_keys", 4);
    check_buffer(res_v, "residual_values", 4);
    check_buffer(counts, "counts", 3);
    TORCH_CHECK(counts.scalar_type() == at::kLong, "counts must be int64");
    TORCH_CHECK(key_codes.scalar_type() == at::kByte && value_codes.scalar_type() == at::kByte,
                "codes must be uint8");
    TORCH_CHECK(bits >= 1 && bits <= 8, "bits must lie in 1..8");
    TORCH_CHECK(key_kind == kKeysPerChannel || key_kind == kKeysPerToken ||
                    key_kind == kKeysWidths,
                "unknown key kind");
    const auto dtype = sink_k.scalar_type();
    TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
                "storage dtype must be float16 or bfloat16");
    for (const auto* t : {&sink_v, &key_scalars, &value_scalars, &res_k, &res_v})
      TORCH_CHECK(t->scalar_type() == dtype, "every storage buffer must share one dtype");
    const int64_t B = res_k.size(0), H = res_k.size(1), T = group_tokens;
    const int64_t Dv = sink_v.size(3), P = pair_first.numel();
    TORCH_CHECK(res_k.size(3) == D && sink_k.size(3) == D, "key buffers must have head_dim D");
    TORCH_CHECK(counts.size(0) == 3 && counts.size(1) == B && counts.size(2) == H,
                "counts must be [3, B, H]");
    TORCH_CHECK(mask.numel() == 0 || (mask.scalar_type() == at::kBool && mask.is_contiguous() &&
                                      mask.numel() == B * H * P),
                "mask must be bool [B, H, P] or empty");
    TORCH_CHECK(pair_first.scalar_type() == at::kLong && pair_second.scalar_type() == at::kLong &&
                    pair_first.is_contiguous() && pair_second.is_contiguous() &&
                    pair_second.numel() == P,
                "pair indices must be contiguous int64 [P]");
    TORCH_CHECK(key_codes.size(3) == (T * D * bits + 7) / 8, "key_codes bytes mismatch");
    TORCH_CHECK(value_codes.size(3) == (T * Dv * bits + 7) / 8, "value_codes bytes mismatch");
    TORCH_CHECK(T >= 1 && value_scalars.size(3) % (2 * T) == 0 && value_scalars.size(3) > 0 &&
                    Dv % (value_scalars.size(3) / (2 * T)) == 0,
                "value_scalars must be [.., 2 T G] with G value channel groups dividing Dv");
    TORCH_CHECK(key_scalars.size(3) == (key_kind == kKeysPerToken ? 2 * T : 2 * D),
                "key scalars must be [.., 2T] (per token) or [.., 2D] (per channel)");
    TORCH_CHECK(sink_logits.numel() == 0 || (sink_logits.scalar_type() == at::kFloat &&
                                             sink_logits.is_contiguous()),
                "sink_logits must be contiguous float32 or empty");
    TORCH_CHECK(key_kind != kKeysWidths ||
                    (widths.scalar_type() == at::kByte && widths.is_contiguous() &&
                     widths.numel() == B * H * P),
                "per-pair widths must be uint8 [B, H, P]");
    if (key_kind == kKeysWidths) {
      const uint8_t* w = widths.data_ptr<uint8_t>();
      for (int64_t i = 0; i < B * H * P; ++i) TORCH_CHECK(w[i] <= 8, "widths must be <= 8");
    }
    if (payload.numel()) {
      check_buffer(payload, "key_payload", 4);
      TORCH_CHECK(payload.scalar_type() == at::kByte && payload.size(0) == B &&
                      payload.size(1) == H && payload.size(2) == key_codes.size(2),
                  "key_payload must be uint8 [B, H, G_cap, E]");
      TORCH_CHECK(payload.size(3) % (sink_k.element_size() + 2) == 0,
                  "key_payload bytes must be K * (element size + 2)");
    }
    if (rope_cos.numel()) {
      check_buffer(rope_cos, "rope_cos", 2);
      check_buffer(rope_sin, "rope_sin", 2);
      check_buffer(pos_offset, "position_offsets", 2);
      TORCH_CHECK(rope_cos.scalar_type() == at::kFloat && rope_sin.scalar_type() == at::kFloat &&
                      rope_cos.size(1) == P && rope_sin.sizes() == rope_cos.sizes(),
                  "rope_cos/rope_sin must be float32 [rows, P]");
      TORCH_CHECK(pos_offset.scalar_type() == at::kLong && pos_offset.numel() == B * H,
                  "position offsets must be int64 [B, H]");
      // every group position lies in the table (the Python side sizes it)
      const int64_t* off = pos_offset.data_ptr<int64_t>();
      const int64_t* g = counts.data_ptr<int64_t>() + B * H;
      for (int64_t r = 0; r < B * H; ++r) {
        if (g[r] == 0) continue;
        const int64_t lo = off[r] + sink_tokens - rope_base;
        const int64_t hi = lo + g[r] * T;
        TORCH_CHECK(lo >= 0 && hi <= rope_cos.size(0), "positions beyond the cos/sin table");
      }
    }
    if (hadamard.numel()) {
      check_buffer(hadamard, "hadamard", 2);
      TORCH_CHECK(hadamard.scalar_type() == at::kFloat && hadamard.size(0) == Dv &&
                      hadamard.size(1) == Dv,
                  "the value transform must be float32 [Dv, Dv]");
    }
  }
};

// Attention of query rows q [B, H, M, D] (float32, scaled) with reference keys mu [B, H, D]
// over `layer`, each residual count plus res_extra; writes out [B, H, M, Dv].
void attend(const Layer& layer, const float* q, const float* mu, int64_t M, int64_t queries,
            bool causal, double softcap, int64_t splits, int64_t res_extra, float* out) {
  const int64_t B = layer.res_k.size(0), H = layer.res_k.size(1), D = layer.res_k.size(3);
  TORCH_CHECK(queries >= 1 && M % queries == 0, "query rows must be rep * Q");
  const int64_t rep = M / queries;
  TORCH_CHECK(layer.sink_logits.numel() == 0 || layer.sink_logits.numel() == H * rep,
              "sink_logits must be [H_q]");
  auto fill = [&](auto tag) {
    using S = decltype(tag);
    Inputs<S> in{};
    in.q = q;
    in.mu = mu;
    in.sink_k = ptr<S>(layer.sink_k);
    in.sink_v = ptr<S>(layer.sink_v);
    in.res_k = ptr<S>(layer.res_k);
    in.res_v = ptr<S>(layer.res_v);
    in.key_codes = layer.key_codes.data_ptr<uint8_t>();
    in.key_scalars = ptr<S>(layer.key_scalars);
    in.value_codes = layer.value_codes.data_ptr<uint8_t>();
    in.value_scalars = ptr<S>(layer.value_scalars);
    const int64_t* c = layer.counts.data_ptr<int64_t>();
    in.sink_len = c;
    in.group_cnt = c + B * H;
    in.res_len = c + 2 * B * H;
    in.res_extra = res_extra;
    in.mask = layer.mask.numel() ? layer.mask.data_ptr<bool>() : nullptr;
    in.pair_first = layer.pair_first.data_ptr<int64_t>();
    in.pair_second = layer.pair_second.data_ptr<int64_t>();
    in.sink_logits = layer.sink_logits.numel() ? layer.sink_logits.data_ptr<float>() : nullptr;
    in.widths = layer.key_kind == kKeysWidths ? layer.widths.data_ptr<uint8_t>() : nullptr;
    in.E = layer.payload.numel() ? layer.payload.size(3) : 0;
    in.K = in.E / (static_cast<int64_t>(sizeof(S)) + 2);
    in.payload = in.K > 0 ? layer.payload.data_ptr<uint8_t>() : nullptr;
    const bool rot = layer.rope_cos.numel() > 0;
    in.rope_cos = rot ? layer.rope_cos.data_ptr<float>() : nullptr;
    in.rope_sin = rot ? layer.rope_sin.data_ptr<float>() : nullptr;
    in.rope_base = layer.rope_base;
    in.rope_rows = rot ? layer.rope_cos.size(0) : 0;
    in.pos_offset = rot ? layer.pos_offset.data_ptr<int64_t>() : nullptr;
    in.sink_tokens = layer.sink_tokens;
    in.hadamard = layer.hadamard.numel() ? layer.hadamard.data_ptr<float>() : nullptr;
    in.mode_first = layer.mode_first;
    in.mode_second = layer.mode_second;
    in.key_kind = layer.key_kind;
    in.B = B;
    in.H = H;
    in.M = M;
    in.Q = queries;
    in.rep = rep;
    in.D = D;
    in.Dv = layer.sink_v.size(3);
    in.S_cap = layer.sink_k.size(2);
    in.R_cap = layer.res_k.size(2);
    in.G_cap = layer.key_codes.size(2);
    in.T = layer.group_tokens;
    in.bits = layer.bits;
    in.Kb = layer.key_codes.size(3);
    in.Vb = layer.value_codes.size(3);
    in.Gv = layer.value_scalars.size(3) / (2 * layer.group_tokens);
    in.Sk = layer.key_scalars.size(3);
    in.P = layer.pair_first.numel();
    in.causal = causal;
    in.softcap = softcap > 0 ? static_cast<float>(softcap) : 0.f;
    run<S>(in, std::max<int64_t>(splits, 1), out);
  };
  if (layer.sink_k.scalar_type() == at::kHalf) {
    fill(at::Half{});
  } else {
    fill(at::BFloat16{});
  }
}

// Write one token per row, rounded to the storage dtype S, at residual slot pos[row];
// returns whether every rounded value is finite.
template <typename S>
bool write_token(const torch::Tensor& src, torch::Tensor& dst, const int64_t* pos) {
  const int64_t rows = dst.size(0) * dst.size(1), cap = dst.size(2), width = dst.size(3);
  S* out = reinterpret_cast<S*>(dst.data_ptr());
  bool good = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "append", [&] {
    const scalar_t* in = src.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      S* o = out + (r * cap + pos[r]) * width;
      const scalar_t* i = in + r * width;
      for (int64_t d = 0; d < width; ++d) {
        o[d] = static_cast<S>(static_cast<float>(i[d]));
        good = good && std::isfinite(static_cast<float>(o[d]));
      }
    }
  });
  return good;
}

void append_impl(const torch::Tensor& keys, const torch::Tensor& values, torch::Tensor& res_k,
                 torch::Tensor& res_v, const int64_t* pos, torch::Tensor& ok) {
  const int64_t B = res_k.size(0), H = res_k.size(1), D = res_k.size(3), Dv = res_v.size(3);
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == B && keys.size(1) == H && keys.size(2) == 1 &&
                  keys.size(3) == D,
              "keys must be [B, H, 1, D]");
  TORCH_CHECK(values.dim() == 4 && values.size(0) == B && values.size(1) == H &&
                  values.size(2) == 1 && values.size(3) == Dv,
              "values must be [B, H, 1, Dv]");
  TORCH_CHECK(ok.scalar_type() == at::kBool && ok.numel() == 1 && ok.device().is_cpu(),
              "ok must be a CPU bool scalar");
  for (int64_t r = 0; r < B * H; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < res_k.size(2), "residual position out of range");
  const auto k = keys.contiguous();
  const auto v = values.contiguous();
  bool good;
  if (res_k.scalar_type() == at::kHalf) {
    good = write_token<at::Half>(k, res_k, pos);
    good = write_token<at::Half>(v, res_v, pos) && good;
  } else {
    good = write_token<at::BFloat16>(k, res_k, pos);
    good = write_token<at::BFloat16>(v, res_v, pos) && good;
  }
  bool* flag = ok.data_ptr<bool>();
  *flag = *flag && good;
}

}  // namespace

// Packed attention of query rows over one layer's packed buffers.
//   query [B, H, M, D] float32 (scaled; row m of kv head h = query head h*rep + m/Q, query
//   m%Q), mu [B, H, D] float32, counts int64 [3, B, H] (sinks, groups, residual), mask bool
//   [B, H, P] or empty, pair_first/pair_second int64 [P], sink_logits float32 [H*rep] or empty.
//   Issue-8 codecs (empty tensors when unused): widths uint8 [B, H, P] (key_kind 2), payload
//   uint8 [B, H, G_cap, E], rope_cos/rope_sin float32 [rows, P] (row i: position rope_base +
//   i), pos_offset int64 [B, H] and sink_tokens (group slot g starts at stream index
//   sink_tokens + g * T), hadamard float32 [Dv, Dv] (the value output transform).
// Returns float32 [B, H, M, Dv].
torch::Tensor packed_attention(torch::Tensor query, torch::Tensor mu, torch::Tensor sink_k,
                               torch::Tensor sink_v, torch::Tensor key_codes,
                               torch::Tensor key_scalars, torch::Tensor value_codes,
                               torch::Tensor value_scalars, torch::Tensor res_k,
                               torch::Tensor res_v, torch::Tensor counts, torch::Tensor mask,
                               torch::Tensor pair_first, torch::Tensor pair_second,
                               torch::Tensor sink_logits, int64_t key_kind, int64_t mode_first,
                               int64_t mode_second, int64_t bits, int64_t group_tokens,
                               int64_t queries, bool causal, double softcap, int64_t splits,
                               torch::Tensor widths, torch::Tensor payload,
                               torch::Tensor rope_cos, torch::Tensor rope_sin,
                               int64_t rope_base, torch::Tensor pos_offset,
                               int64_t sink_tokens, torch::Tensor hadamard) {
  Layer layer{sink_k,      sink_v,    key_codes,  key_scalars, value_codes, value_scalars,
              res_k,       res_v,     counts,     mask,        pair_first,  pair_second,
              sink_logits, key_kind,  mode_first, mode_second, bits,        group_tokens,
              widths,      payload,   rope_cos,   rope_sin,    pos_offset,  hadamard,
              rope_base,   sink_tokens};
  check_buffer(query, "query", 4);
  check_buffer(mu, "mu", 3);
  TORCH_CHECK(query.scalar_type() == at::kFloat && mu.scalar_type() == at::kFloat,
              "query and mu must be float32");
  const int64_t B = query.size(0), H = query.size(1), M = query.size(2), D = query.size(3);
  layer.check(D);
  TORCH_CHECK(B == res_k.size(0) && H == res_k.size(1), "query rows must be [B, H, M, D]");
  TORCH_CHECK(mu.size(0) == B && mu.size(1) == H && mu.size(2) == D, "mu must be [B, H, D]");
  auto out = torch::empty({B, H, M, sink_v.size(3)}, query.options());
  attend(layer, query.data_ptr<float>(), mu.data_ptr<float>(), M, queries, causal, softcap,
         splits, 0, out.data_ptr<float>());
  return out;
}

// Append one token per row to the residual: keys [B, H, 1, D] and values [B, H, 1, Dv] (any
// floating dtype) are rounded to the storage dtype (round to nearest even, as Tensor.to) and
// written at residual slot positions[b, h] (int64 [B, H]); ok (bool, 0-d) is AND-ed with
// "every rounded value is finite" (the deferred check, docs/design.md "Host syncs").
void append_residual(torch::Tensor keys, torch::Tensor values, torch::Tensor res_k,
                     torch::Tensor res_v, torch::Tensor positions, torch::Tensor ok) {
  check_buffer(res_k, "residual_keys", 4);
  check_buffer(res_v, "residual_values", 4);
  check_buffer(positions, "positions", 2);
  TORCH_CHECK(positions.scalar_type() == at::kLong &&
                  positions.numel() == res_k.size(0) * res_k.size(1),
              "positions must be int64 [B, H]");
  TORCH_CHECK(res_k.scalar_type() == res_v.scalar_type() &&
                  (res_k.scalar_type() == at::kHalf || res_k.scalar_type() == at::kBFloat16),
              "residual buffers must share a float16 or bfloat16 dtype");
  append_impl(keys, values, res_k, res_v, positions.data_ptr<int64_t>(), ok);
}

// One decode step of one layer: append one token per row to the residual (append_residual at
// slot counts[2]), then attend with one query per query head over the rows including it
// (packed_attention with Q = 1, causal). query [B, H * rep, 1, D] (any floating dtype),
// keys [B, H, 1, D], values [B, H, 1, Dv]; counts int64 [3, B, H] BEFORE the append (the
// caller checked that every row has its sinks full and room in its residual: no flush);
// scale: the logits' softmax scale. mu is every row's first sink slot (S_cap > 0) or first
// residual slot, as the reference's. Returns float32 [B, H * rep, 1, Dv].
torch::Tensor decode_step(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                          torch::Tensor sink_k, torch::Tensor sink_v, torch::Tensor key_codes,
                          torch::Tensor key_scalars, torch::Tensor value_codes,
                          torch::Tensor value_scalars, torch::Tensor res_k, torch::Tensor res_v,
                          torch::Tensor counts, torch::Tensor mask, torch::Tensor pair_first,
                          torch::Tensor pair_second, torch::Tensor sink_logits, torch::Tensor ok,
                          int64_t key_kind, int64_t mode_first, int64_t mode_second, int64_t bits,
                          int64_t group_tokens, double scale, double softcap, int64_t splits,
                          torch::Tensor widths, torch::Tensor payload, torch::Tensor rope_cos,
                          torch::Tensor rope_sin, int64_t rope_base, torch::Tensor pos_offset,
                          int64_t sink_tokens, torch::Tensor hadamard) {
  Layer layer{sink_k,      sink_v,    key_codes,  key_scalars, value_codes, value_scalars,
              res_k,       res_v,     counts,     mask,        pair_first,  pair_second,
              sink_logits, key_kind,  mode_first, mode_second, bits,        group_tokens,
              widths,      payload,   rope_cos,   rope_sin,    pos_offset,  hadamard,
              rope_base,   sink_tokens};
  const int64_t B = res_k.size(0), H = res_k.size(1), D = res_k.size(3);
  layer.check(D);
  TORCH_CHECK(query.dim() == 4 && query.size(0) == B && query.size(2) == 1 &&
                  query.size(3) == D && query.size(1) % H == 0,
              "query must be [B, H * rep, 1, D]");
  const int64_t S_cap = sink_k.size(2);
  TORCH_CHECK(S_cap > 0 || res_k.size(2) > 0, "decode_step needs sink or residual slots");
  append_impl(keys, values, res_k, res_v, counts.data_ptr<int64_t>() + 2 * B * H, ok);
  // query rows (scaled, float32) and reference keys, read in place
  const int64_t hq = query.size(1), M = hq / H;
  const auto q32 = query.scalar_type() == at::kFloat ? query.contiguous()
                                                     : query.to(at::kFloat).contiguous();
  std::vector<float> rows(B * hq * D), mu(B * H * D);
  const float* qp = q32.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for (int64_t i = 0; i < B * hq * D; ++i) rows[i] = qp[i] * sc;
  auto fill_mu = [&](auto tag) {
    using S = decltype(tag);
    const S* src = S_cap > 0 ? ptr<S>(sink_k) : ptr<S>(res_k);
    const int64_t cap = S_cap > 0 ? S_cap : res_k.size(2);
    for (int64_t r = 0; r < B * H; ++r)
      for (int64_t d = 0; d < D; ++d) mu[r * D + d] = static_cast<float>(src[r * cap * D + d]);
  };
  if (sink_k.scalar_type() == at::kHalf) {
    fill_mu(at::Half{});
  } else {
    fill_mu(at::BFloat16{});
  }
  auto out = torch::empty({B, hq, 1, sink_v.size(3)}, q32.options());
  attend(layer, rows.data(), mu.data(), M, 1, true, softcap, splits, 1, out.data_ptr<float>());
  return out;
}
