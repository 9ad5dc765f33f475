// The CPU decode step's native kernels, XLA FFI custom calls (see
// rlax_tpu/models/native_attention.py, which builds and registers them):
//
// * Paged decode attention. One decode token per row. First every row's new key/value is written
//   into its page slot of the given layer (in place: the page buffers are aliased to the
//   outputs), then each (row, KV head) attends over positions 0..p of its pages, reading them
//   where they lie: no gathered copy.
// * Logit statistics for the sampler: per row of z / t, its max, log-sum-exp and first argmax in
//   two passes over the row (XLA:CPU runs each of these reductions as its own single-threaded loop).
//
// Every item (a (row, KV head), a row of logits) is computed in one fixed order whatever thread
// runs it and whatever the other rows hold, so a row's bits depend only on its own inputs.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shapes {
  int64_t rows, heads, kv_heads, dim, pages, page, table_width, layer_stride;
};

// exp(x) for x <= 0 (x = -inf gives 0): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial (relative error about 2e-7), branch-free so that loops over it vectorize.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693359375f, std::fma(n, 2.12194440e-4f, x));
  float p = 1.3888889e-3f;
  p = std::fma(p, r, 8.3333333e-3f);
  p = std::fma(p, r, 4.1666667e-2f);
  p = std::fma(p, r, 1.6666667e-1f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

#if defined(__AVX512F__)
// Sixteen f32 lanes: one AVX-512 register. Only where the CPU has them: split into halves on
// AVX2, the shuffles below cost more than the per-key sums they replace (measured).
typedef float V16 __attribute__((vector_size(64)));

// out[u] = the sum of v[u]'s 16 lanes, for u < 16: 15 adds over lane shuffles instead of 16
// separate horizontal sums, in one fixed order (lane l + lane l + 8, then + 4, + 2, + 1).
inline V16 LaneSums(const V16 v[16]) {
  V16 t8[8], t4[4], t2[2];
  for (int i = 0; i < 8; ++i)
    t8[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                    19, 20, 21, 22, 23) +
            __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                    26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    t4[i] = __builtin_shufflevector(t8[2 * i], t8[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                    18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(t8[2 * i], t8[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                    22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    t2[i] = __builtin_shufflevector(t4[2 * i], t4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                    20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(t4[2 * i], t4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                    22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(t2[0], t2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(t2[0], t2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}
#endif

// One (row, KV head): its G query heads over positions 0..span-1 of the row's pages.
// q [B, H, D], out [B, H, D]; pages [L, Hkv, P, page, D]; tables [B, M]; positions [B].
template <int64_t D, int64_t G>
void AttendItem(const Shapes& s, int64_t item, const float* q, const float* k_pages,
                const float* v_pages, const int32_t* tables, const int32_t* positions,
                int64_t layer, float* out, std::vector<float>& scores) {
  const int64_t b = item / s.kv_heads, g = item % s.kv_heads;
  float* o = out + (b * s.heads + g * G) * D;
  const int64_t p = positions[b];
  if (p < 0) {  // a padding row
    std::fill(o, o + G * D, 0.0f);
    return;
  }
  const int64_t span = std::min<int64_t>(p + 1, s.table_width * s.page);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  alignas(64) float qs[G][D];
  const float* qb = q + (b * s.heads + g * G) * D;
  for (int64_t h = 0; h < G; ++h)
    for (int64_t x = 0; x < D; ++x) qs[h][x] = qb[h * D + x] * scale;
  const int64_t head_base = layer * s.layer_stride + g * s.pages * s.page * D;
  const int32_t* row_table = tables + b * s.table_width;
  scores.resize(G * span);
  float* sc = scores.data();  // [G, span]
  int64_t j0 = 0;
#if defined(__AVX512F__)
  V16 qv[G][D / 16];
  std::memcpy(qv, qs, sizeof(qv));
  for (; j0 + 16 <= span; j0 += 16) {  // 16 keys at a time: lane partials, then one tree
    V16 part[G][16];
    for (int64_t u = 0; u < 16; ++u) {
      const int64_t j = j0 + u;
      const float* kj = k_pages + head_base + (row_table[j / s.page] * s.page + j % s.page) * D;
      V16 kc[D / 16];
      std::memcpy(kc, kj, D * 4);
      for (int64_t h = 0; h < G; ++h) {
        V16 a = qv[h][0] * kc[0];
        for (int64_t c = 1; c < D / 16; ++c) a += qv[h][c] * kc[c];
        part[h][u] = a;
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      const V16 total = LaneSums(part[h]);
      std::memcpy(sc + h * span + j0, &total, sizeof(total));
    }
  }
#endif
  for (int64_t j = j0; j < span; ++j) {  // one key at a time (the rest, or every key)
    const float* kj = k_pages + head_base + (row_table[j / s.page] * s.page + j % s.page) * D;
    for (int64_t h = 0; h < G; ++h) {
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t x = 0; x < D; ++x) acc += qs[h][x] * kj[x];
      sc[h * span + j] = acc;
    }
  }
  float total[G];
  for (int64_t h = 0; h < G; ++h) {
    float* sh = sc + h * span;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < span; ++j) top = std::max(top, sh[j]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < span; ++j) {
      sh[j] = ExpNonPositive(sh[j] - top);
      sum += sh[j];
    }
    total[h] = sum;
  }
  alignas(64) float acc[G][D] = {};
  for (int64_t j = 0; j < span; ++j) {  // one pass over the values
    const float* vj = v_pages + head_base + (row_table[j / s.page] * s.page + j % s.page) * D;
    for (int64_t h = 0; h < G; ++h) {
      const float w = sc[h * span + j];
#pragma omp simd
      for (int64_t x = 0; x < D; ++x) acc[h][x] += w * vj[x];
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.0f / total[h];
    for (int64_t x = 0; x < D; ++x) o[h * D + x] = acc[h][x] * inv;
  }
}

// Runs fn(i, scratch) for i in [0, items): items are claimed from a shared counter by this
// thread and by helpers on XLA's pool. The state lives on the heap and this thread waits only
// for helpers that have started: a helper the pool runs after the call has returned finds the
// call closed and does nothing, so a busy pool can delay the call but never block it.
template <typename Fn>
void RunItems(ffi::ThreadPool& pool, int64_t items, Fn fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t active = 0;
    bool closed = false;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [=] {  // by value: a helper holds its own copy
    std::vector<float> scratch;
    for (int64_t i; (i = shared->next.fetch_add(1)) < items;) fn(i, scratch);
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) - 1;
  for (int64_t t = 0; t < helpers; ++t)
    pool.Schedule([shared, work] {
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        if (shared->closed) return;
        ++shared->active;
      }
      work();
      std::lock_guard<std::mutex> lock(shared->mu);
      if (--shared->active == 0) shared->cv.notify_one();
    });
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->closed = true;
  shared->cv.wait(lock, [&] { return shared->active == 0; });
}

using ItemFn = void (*)(const Shapes&, int64_t, const float*, const float*, const float*,
                       const int32_t*, const int32_t*, int64_t, float*, std::vector<float>&);

template <int64_t D>
ItemFn ForGroup(int64_t group) {
  switch (group) {
    case 1: return AttendItem<D, 1>;
    case 2: return AttendItem<D, 2>;
    case 3: return AttendItem<D, 3>;
    case 4: return AttendItem<D, 4>;
    case 5: return AttendItem<D, 5>;
    case 6: return AttendItem<D, 6>;
    case 7: return AttendItem<D, 7>;
    case 8: return AttendItem<D, 8>;
    default: return nullptr;
  }
}

// Head dims 16, 32, 64, 128, 256 and 1..8 query heads per KV head (native_attention.HEAD_DIMS,
// MAX_GROUP).
ItemFn Dispatch(int64_t dim, int64_t group) {
  switch (dim) {
    case 16: return ForGroup<16>(group);
    case 32: return ForGroup<32>(group);
    case 64: return ForGroup<64>(group);
    case 128: return ForGroup<128>(group);
    case 256: return ForGroup<256>(group);
    default: return nullptr;
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                           ffi::Buffer<ffi::F32> k_pages_in, ffi::Buffer<ffi::F32> v_pages_in,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                           int64_t layer, ffi::ResultBuffer<ffi::F32> out,
                           ffi::ResultBuffer<ffi::F32> k_pages, ffi::ResultBuffer<ffi::F32> v_pages) {
  auto qd = q.dimensions(), pd = k_pages_in.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || pd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("decode attention: q [B, H, D], pages [L, Hkv, P, page, D], tables [B, M]");
  Shapes s{qd[0], qd[1], pd[1], qd[2], pd[2], pd[3], td[1], pd[1] * pd[2] * pd[3] * pd[4]};
  if (pd[4] != s.dim || td[0] != s.rows || s.heads % s.kv_heads || layer < 0 || layer >= pd[0])
    return ffi::Error::InvalidArgument("decode attention: inconsistent shapes");
  const ItemFn attend = Dispatch(s.dim, s.heads / s.kv_heads);
  if (attend == nullptr)
    return ffi::Error::InvalidArgument("decode attention: unsupported head dim or group size");
  float* kp = k_pages->typed_data();
  float* vp = v_pages->typed_data();
  if (kp != k_pages_in.typed_data() || vp != v_pages_in.typed_data())
    return ffi::Error::Internal("decode attention: page buffers are not aliased");
  const int32_t* tab = tables.typed_data();
  const int32_t* pos = positions.typed_data();
  for (int64_t i = 0; i < s.rows * s.table_width; ++i)
    if (tab[i] < 0 || tab[i] >= s.pages)
      return ffi::Error::InvalidArgument("decode attention: a block table names a page out of range");
  const int64_t d = s.dim;
  for (int64_t b = 0; b < s.rows; ++b) {  // the writes, before any read
    const int64_t p = pos[b];
    if (p < 0 || p / s.page >= s.table_width) continue;
    const int64_t phys = tab[b * s.table_width + p / s.page];  // checked above
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t at = layer * s.layer_stride + ((g * s.pages + phys) * s.page + p % s.page) * d;
      std::copy_n(k_new.typed_data() + (b * s.kv_heads + g) * d, d, kp + at);
      std::copy_n(v_new.typed_data() + (b * s.kv_heads + g) * d, d, vp + at);
    }
  }
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  RunItems(pool, s.rows * s.kv_heads, [=](int64_t i, std::vector<float>& scores) {
    attend(s, i, qp, kp, vp, tab, pos, layer, op, scores);
  });
  return ffi::Error::Success();
}

// One row of logits: over y = z / t (IEEE division, as XLA computes z / t), top = max y (0 when
// the max is not finite, e.g. a NaN or an infinity), best = the first index with y == top (0
// when none), log_sum = log(sum exp(y - top)).
void RowStats(const float* z, int64_t v, float t, std::vector<float>& y, float* top_out,
              float* log_sum_out, int32_t* best_out) {
  constexpr int64_t L = 16;
  y.resize(v);
  float lane_max[L];
  int32_t lane_arg[L];
  bool nan = false;
  for (int64_t l = 0; l < L; ++l) lane_max[l] = -std::numeric_limits<float>::infinity(), lane_arg[l] = -1;
  int64_t i = 0;
  for (; i + L <= v; i += L) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const float x = z[i + l] / t;
      y[i + l] = x;
      nan |= x != x;
      const bool more = x > lane_max[l];
      lane_max[l] = more ? x : lane_max[l];
      lane_arg[l] = more ? static_cast<int32_t>(i + l) : lane_arg[l];
    }
  }
  float m = -std::numeric_limits<float>::infinity();
  int32_t arg = -1;
  for (int64_t l = 0; l < L; ++l)  // the first index among the lanes' maxima
    if (lane_arg[l] >= 0 && (lane_max[l] > m || (lane_max[l] == m && lane_arg[l] < arg)))
      m = lane_max[l], arg = lane_arg[l];
  for (; i < v; ++i) {
    const float x = z[i] / t;
    y[i] = x;
    nan |= x != x;
    if (x > m) m = x, arg = static_cast<int32_t>(i);
  }
  const bool finite = !nan && std::isfinite(m);
  const float top = finite ? m : 0.0f;
  int32_t best = finite ? arg : -1;
  if (!finite)
    for (int64_t j = 0; j < v && best < 0; ++j)
      if (y[j] == top) best = static_cast<int32_t>(j);
  double sum = 0.0;
  if (finite) {  // every y - top <= 0; blocks of 16 x 32 entries, summed in a fixed order
    constexpr int64_t kBlock = 512;
    int64_t j = 0;
    for (; j + kBlock <= v; j += kBlock) {
      float acc[L] = {};
      for (int64_t k = j; k < j + kBlock; k += L) {
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) acc[l] += ExpNonPositive(y[k + l] - top);
      }
      for (int64_t w = L / 2; w > 0; w /= 2)
        for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
      sum += acc[0];
    }
    for (; j < v; ++j) sum += ExpNonPositive(y[j] - top);
  } else {  // rare and not fast: infinities or NaNs in the row
    for (int64_t j = 0; j < v; ++j) sum += std::exp(y[j] - top);
  }
  *top_out = top;
  *log_sum_out = static_cast<float>(std::log(sum));
  *best_out = best < 0 ? 0 : best;
}

ffi::Error LogitStats(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                      ffi::Buffer<ffi::F32> temperature, ffi::ResultBuffer<ffi::F32> top,
                      ffi::ResultBuffer<ffi::F32> log_sum, ffi::ResultBuffer<ffi::S32> best) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || temperature.element_count() != static_cast<size_t>(dims[0]))
    return ffi::Error::InvalidArgument("logit stats: logits [N, V], temperature [N]");
  const int64_t n = dims[0], v = dims[1];
  if (v <= 0 || v > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("logit stats: vocabulary size out of range");
  const float* z = logits.typed_data();
  const float* t = temperature.typed_data();
  float* tp = top->typed_data();
  float* ls = log_sum->typed_data();
  int32_t* bp = best->typed_data();
  RunItems(pool, n, [=](int64_t r, std::vector<float>& y) {
    RowStats(z + r * v, v, t[r], y, tp + r, ls + r, bp + r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlaxPagedDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlaxLogitStats, LogitStats,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
