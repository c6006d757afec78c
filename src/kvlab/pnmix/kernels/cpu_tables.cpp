// PN-Mix per-pair width tables on the CPU: the per-token terms of the table statistics
// (docs/design.md, "Per-pair tables", "Flush").
//
// BitAllocCodec.table_distortion (the torch reference) codes a row's flushed groups at every
// candidate width w (one table of w for every pair), decodes them with their exact outliers
// written back, and measures per group and rotary pair the query-weighted squared logit error
// sum_t [(maa ea) ea + (mbb eb) eb] + ((2 mab) ea) eb of the coding error e = decoded - key
// (rotated to the key's position for a pre-RoPE codec; ea, eb = ea^2 + eb^2 without queries).
// This kernel forms the same per-token terms [W, G, T, P] with the same IEEE operations in
// the same precisions — selection (outliers, lower median, min, max) and float64 code
// arithmetic as cpu_flush.cpp, float32 decode (zero + code * scale), float64 error, rotation
// and terms, every product rounded before the sum that follows (no fused multiply-add in this
// file's loops, see the pragma) — and leaves the sums over tokens and groups to torch, whose
// order they then have: the distortion is bit for bit the
// reference's. Like the flush, it refuses (returns no tensor) a frame key that is a negative
// zero or not finite, where the reference's reductions could pick another zero or NaN.
// Uses kvlab_flush::{Half, to_half, bad, code_of, select_outliers} (cpu_flush.cpp, compiled
// in the same module, before this file).

#include <atomic>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvlab_tables {

using kvlab_flush::Half;

struct Inputs {
  int64_t G, T, D, P, W, K;
  const Half* keys;       // [G, T, D] keys (in the frame unless fcs is given)
  const float* fcs;       // [G, T, P] rotation to the frame (cpu_flush.cpp's to_frame) or null
  const float* fsn;       // [G, T, P] or null
  const double* cs;       // [G, T, P] or null
  const double* sn;       // [G, T, P] or null
  const int64_t* first;   // [P]
  const int64_t* second;  // [P]
  const int64_t* widths;  // [W]
  const double* moment;   // [N, 3, P] (M_aa, M_bb, M_ab per pair) or null
  const int64_t* owner;   // [G] or null
  double* terms;          // [W, G, T, P]
  int32_t* outliers;      // [G, K]
};

// The hot loops are written for the vectorizer: the pair channels gathered token-major
// ([t][c], first channels then second ones), per-channel constants in arrays, no branch in the
// inner loops. Fused multiply-adds are off in this function (the pragma below; the module's
// flags allow them elsewhere): every product is rounded before the sum that follows, as torch
// rounds each elementwise op.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// Buffers of one thread, reused from group to group (every entry written before it is read).
struct Workspace {
  std::vector<Half> frame;
  std::vector<double> x, dist, tmp, xp, lo, hi, sum, count, z64, s64, ea, eb, maa, mbb, mab2;
  std::vector<float> xf, zf, sf, dec;
  std::vector<uint8_t> excl, ex;
  std::vector<int64_t> chan;

  void size(int64_t T, int64_t D, int64_t P) {
    const int64_t TD = T * D, C = 2 * P;
    frame.resize(TD);
    x.resize(TD);
    excl.resize(TD);
    xp.resize(T * C);
    xf.resize(T * C);
    dec.resize(T * C);
    ex.resize(T * C);
    for (auto* v : {&lo, &hi, &sum, &count, &z64, &s64}) v->resize(C);
    zf.resize(C);
    sf.resize(C);
    for (auto* v : {&ea, &eb, &maa, &mbb, &mab2}) v->resize(P);
    chan.resize(C);
  }
};

// x[i] = keys[i] as float64 for i < n; false if one is not finite or a negative zero
inline bool load_keys(const Half* keys, int64_t n, double* __restrict x) {
  bool bad = false;
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8) {  // the hardware conversion (exact, as every one here)
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + i)));
    alignas(32) float v[8];
    _mm256_store_ps(v, f);
    for (int j = 0; j < 8; ++j) {
      bad |= kvlab_flush::bad(v[j]);
      x[i + j] = v[j];
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(keys[i]);
    bad |= kvlab_flush::bad(v);
    x[i] = v;
  }
  return !bad;
}

// the terms of group g; false when the reference might differ (see the file comment)
bool group_terms(const Inputs& in, int64_t g, Workspace& ws) {
  const int64_t T = in.T, D = in.D, P = in.P, K = in.K, TD = T * D, C = 2 * P;
  const Half* k = in.keys + g * TD;
  if (in.fcs != nullptr) {  // the keys in the codec's frame, as the flush forms them
    kvlab_flush::to_frame(k, in.fcs + g * T * P, in.fsn + g * T * P, in.first, in.second, T, D,
                          P, ws.frame.data());
    k = ws.frame.data();
  }
  double* __restrict x = ws.x.data();
  if (!load_keys(k, TD, x)) return false;
  uint8_t* __restrict excl = ws.excl.data();
  std::fill(excl, excl + TD, uint8_t{0});
  if (K > 0) {
    int32_t* order = in.outliers + g * K;
    kvlab_flush::select_outliers(ws.x, T, D, K, ws.dist, ws.tmp, order);
    for (int64_t j = 0; j < K; ++j) excl[order[j]] = 1;
  }
  // the pair channels token-major: xp[t * C + c], channel c = first[c] (c < P) or second[c - P]
  int64_t* __restrict chan = ws.chan.data();
  for (int64_t p = 0; p < P; ++p) {
    chan[p] = in.first[p];
    chan[P + p] = in.second[p];
  }
  double* __restrict xp = ws.xp.data();
  float* __restrict xf = ws.xf.data();
  uint8_t* __restrict ex = ws.ex.data();
  bool identity = C == D;  // the half layout over every channel: no gather
  for (int64_t c = 0; c < C && identity; ++c) identity = chan[c] == c;
  if (identity) {
    for (int64_t i = 0; i < TD; ++i) {
      xp[i] = x[i];
      xf[i] = static_cast<float>(x[i]);
      ex[i] = excl[i];
    }
  } else {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = t * D + chan[c];
        xp[t * C + c] = x[i];
        xf[t * C + c] = static_cast<float>(x[i]);
        ex[t * C + c] = excl[i];
      }
    }
  }
  // per channel: min and max of the non-outliers, and their mean (width 0)
  const double inf = std::numeric_limits<double>::infinity();
  double* __restrict lo = ws.lo.data();
  double* __restrict hi = ws.hi.data();
  double* __restrict sum = ws.sum.data();
  double* __restrict count = ws.count.data();
  for (int64_t c = 0; c < C; ++c) {
    lo[c] = inf;
    hi[c] = -inf;
    sum[c] = 0.0;
    count[c] = 0.0;
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < C; ++c) {
      const double v = xp[t * C + c];
      const bool kept = !ex[t * C + c];
      sum[c] += kept ? v : 0.0;  // exact for float16 keys (cpu_flush.cpp): any order
      count[c] += kept ? 1.0 : 0.0;
      const double vl = kept ? v : inf, vh = kept ? v : -inf;  // an outlier changes neither
      lo[c] = vl < lo[c] ? vl : lo[c];
      hi[c] = vh > hi[c] ? vh : hi[c];
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    if (lo[c] > hi[c]) lo[c] = hi[c] = 0.0;  // every token an outlier
  }
  double* __restrict z64 = ws.z64.data();
  double* __restrict s64 = ws.s64.data();
  float* __restrict zf = ws.zf.data();
  float* __restrict sf = ws.sf.data();
  float* __restrict dec = ws.dec.data();
  double* __restrict ea = ws.ea.data();
  double* __restrict eb = ws.eb.data();
  double* __restrict maa = ws.maa.data();
  double* __restrict mbb = ws.mbb.data();
  double* __restrict mab2 = ws.mab2.data();
  if (in.moment != nullptr) {
    const double* m = in.moment + in.owner[g] * 3 * P;
    for (int64_t p = 0; p < P; ++p) {
      maa[p] = m[p];
      mbb[p] = m[P + p];
      mab2[p] = 2.0 * m[2 * P + p];
    }
  }
  for (int64_t w = 0; w < in.W; ++w) {
    const int64_t bits = in.widths[w];
    const int64_t levels = bits == 0 ? 0 : (int64_t{1} << bits) - 1;
    const double top = static_cast<double>(levels);
    for (int64_t c = 0; c < C; ++c) {
      if (bits == 0) {  // the mean of the non-outliers, scale 0, codes 0
        const double mean = count[c] > 0.0 ? sum[c] / std::max(count[c], 1.0) : 0.0;
        zf[c] = static_cast<float>(kvlab_flush::to_half(mean));
        sf[c] = 0.f;
        z64[c] = 0.0;
        s64[c] = 1.0;  // unused: every code is 0
        continue;
      }
      zf[c] = static_cast<float>(kvlab_flush::to_half(lo[c]));
      sf[c] = static_cast<float>(kvlab_flush::to_half((hi[c] - lo[c]) / top));
      const double z = zf[c], sc = sf[c];
      const bool valid = sc > 0.0 && std::isfinite(sc) && std::isfinite(z);
      z64[c] = valid ? z : std::numeric_limits<double>::quiet_NaN();  // NaN: codes 0
      s64[c] = valid ? sc : 1.0;
    }
    // decoded values: zero + code * scale (float32), the payload's exact value at outliers;
    // code = round-half-even((x - zero) / scale) clamped to 0..levels (cpu_flush.cpp's code_of)
    for (int64_t t = 0; t < T; ++t) {
      const double* __restrict xt = xp + t * C;
      const float* __restrict ft = xf + t * C;
      const uint8_t* __restrict et = ex + t * C;
      float* __restrict dt = dec + t * C;
      for (int64_t c = 0; c < C; ++c) {
        const double r = std::nearbyint((xt[c] - z64[c]) / s64[c]);
        double code = r < 0.0 ? 0.0 : r;
        code = code > top ? top : code;
        code = r == r ? code : 0.0;  // NaN: an invalid scale
        const float v = zf[c] + static_cast<float>(code) * sf[c];
        dt[c] = et[c] ? ft[c] : v;
      }
    }
    double* out = in.terms + (w * in.G + g) * T * P;
    const double* cs = in.cs != nullptr ? in.cs + g * T * P : nullptr;
    const double* sn = in.sn != nullptr ? in.sn + g * T * P : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      const float* __restrict dt = dec + t * C;
      const double* __restrict xt = xp + t * C;
      for (int64_t p = 0; p < P; ++p) {
        ea[p] = static_cast<double>(dt[p]) - xt[p];
        eb[p] = static_cast<double>(dt[P + p]) - xt[P + p];
      }
      if (cs != nullptr) {  // rotate_by_delta in float64: x1 c - x2 s, x1 s + x2 c
        const double* __restrict ct = cs + t * P;
        const double* __restrict st = sn + t * P;
        for (int64_t p = 0; p < P; ++p) {
          const double a = ea[p] * ct[p] - eb[p] * st[p];
          const double b = ea[p] * st[p] + eb[p] * ct[p];
          ea[p] = a;
          eb[p] = b;
        }
      }
      double* __restrict o = out + t * P;
      if (in.moment != nullptr) {
        for (int64_t p = 0; p < P; ++p)
          o[p] = (maa[p] * ea[p] * ea[p] + mbb[p] * eb[p] * eb[p]) + mab2[p] * ea[p] * eb[p];
      } else {
        for (int64_t p = 0; p < P; ++p) o[p] = ea[p] * ea[p] + eb[p] * eb[p];
      }
    }
  }
  return true;
}

#pragma GCC pop_options

}  // namespace kvlab_tables

// The per-token terms of the width-table statistics (file comment).
//   keys [G, T, D] float16: storage-rounded keys in the codec's frame, or — with frame_cos /
//   frame_sin float32 [G, T, P] (rotate_by_delta's tables for -position, as encode_groups
//   takes them) — as gathered, rotated to the frame here; rope_cos / rope_sin float64
//   [G, T, P] (rotate_by_delta's tables for the keys' positions: the error's rotation) or
//   empty; pair_first / pair_second int64 [P]; widths int64 [W] (candidate widths, 0..8);
//   outliers K per group; moment float64 [N, 3, P] (per row the moment's pair entries M_aa,
//   M_bb, M_ab) and owner int64 [G] (each group's row), or an empty moment (plain squared
//   errors).
// Returns {terms float64 [W, G, T, P], outlier_index int32 [G, K] (select_outliers' indices,
//   what encode_groups takes)}, or an empty list when the reference must compute them.
std::vector<torch::Tensor> table_terms(torch::Tensor keys, torch::Tensor frame_cos,
                                       torch::Tensor frame_sin, torch::Tensor rope_cos,
                                       torch::Tensor rope_sin, torch::Tensor pair_first,
                                       torch::Tensor pair_second, torch::Tensor widths,
                                       int64_t outliers, torch::Tensor moment,
                                       torch::Tensor owner) {
  using kvlab_flush::Half;
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 3 && keys.scalar_type() == at::kHalf &&
                  keys.is_contiguous(),
              "keys must be contiguous float16 [G, T, D] on the CPU");
  kvlab_tables::Inputs in{};
  in.G = keys.size(0);
  in.T = keys.size(1);
  in.D = keys.size(2);
  in.P = pair_first.numel();
  in.W = widths.numel();
  in.K = outliers;
  TORCH_CHECK(in.T >= 1 && in.T <= 8192, "group tokens must lie in 1..8192");
  TORCH_CHECK(in.K >= 0 && in.K < in.T * in.D && in.T * in.D <= (1 << 15),
              "outliers must lie in 0..T*D-1 with T*D <= 2^15");
  TORCH_CHECK(pair_first.scalar_type() == at::kLong && pair_second.scalar_type() == at::kLong &&
                  pair_first.is_contiguous() && pair_second.is_contiguous() &&
                  pair_second.numel() == in.P,
              "pair indices must be contiguous int64 [P]");
  TORCH_CHECK(widths.scalar_type() == at::kLong && widths.is_contiguous() && widths.dim() == 1,
              "widths must be contiguous int64 [W]");
  in.first = pair_first.data_ptr<int64_t>();
  in.second = pair_second.data_ptr<int64_t>();
  in.widths = widths.data_ptr<int64_t>();
  for (int64_t p = 0; p < in.P; ++p)
    TORCH_CHECK(in.first[p] >= 0 && in.first[p] < in.D && in.second[p] >= 0 &&
                    in.second[p] < in.D,
                "pair indices must lie in 0..D-1");
  for (int64_t w = 0; w < in.W; ++w)
    TORCH_CHECK(in.widths[w] >= 0 && in.widths[w] <= 8, "widths must lie in 0..8");
  if (frame_cos.numel() > 0) {
    for (const auto* t : {&frame_cos, &frame_sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                      t->size(0) == in.G && t->size(1) == in.T && t->size(2) == in.P,
                  "frame_cos/frame_sin must be contiguous float32 [G, T, P]");
    in.fcs = frame_cos.data_ptr<float>();
    in.fsn = frame_sin.data_ptr<float>();
  }
  if (rope_cos.numel() > 0) {
    for (const auto* t : {&rope_cos, &rope_sin})
      TORCH_CHECK(t->scalar_type() == at::kDouble && t->is_contiguous() && t->dim() == 3 &&
                      t->size(0) == in.G && t->size(1) == in.T && t->size(2) == in.P,
                  "rope_cos/rope_sin must be contiguous float64 [G, T, P]");
    in.cs = rope_cos.data_ptr<double>();
    in.sn = rope_sin.data_ptr<double>();
  }
  if (moment.numel() > 0) {
    TORCH_CHECK(moment.scalar_type() == at::kDouble && moment.is_contiguous() &&
                    moment.dim() == 3 && moment.size(1) == 3 && moment.size(2) == in.P,
                "moment must be contiguous float64 [N, 3, P]");
    TORCH_CHECK(owner.scalar_type() == at::kLong && owner.is_contiguous() &&
                    owner.numel() == in.G,
                "owner must be contiguous int64 [G]");
    in.moment = moment.data_ptr<double>();
    in.owner = owner.data_ptr<int64_t>();
    for (int64_t g = 0; g < in.G; ++g)
      TORCH_CHECK(in.owner[g] >= 0 && in.owner[g] < moment.size(0), "owner out of range");
  }
  in.keys = reinterpret_cast<const Half*>(keys.data_ptr());
  auto terms = torch::empty({in.W, in.G, in.T, in.P}, keys.options().dtype(at::kDouble));
  in.terms = terms.data_ptr<double>();
  auto index = torch::empty({in.G, in.K}, keys.options().dtype(at::kInt));
  in.outliers = index.data_ptr<int32_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, in.G, 1, [&](int64_t begin, int64_t end) {
    kvlab_tables::Workspace ws;
    ws.size(in.T, in.D, in.P);
    for (int64_t g = begin; g < end && exact.load(); ++g)
      if (!kvlab_tables::group_terms(in, g, ws)) exact.store(false);
  });
  if (!exact.load()) return {};
  return {terms, index};
}
