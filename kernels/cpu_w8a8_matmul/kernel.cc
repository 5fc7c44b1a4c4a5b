// A w8a8 projection on XLA:CPU, as an XLA FFI custom call (ops.py builds and loads it):
//   out[m, n] = ((sum_k p[m, k] q[k, n]) * t[m]) * scale[n],  rounded to x's dtype,
// where p = clip(round_half_even(x / t), -127, 127) and t = max_k |x[m, k]| / 127 (1 for an
// all-zero row): jaxrl.models.quant's per-token activation quantization, done here.
//
// The products run on AVX512-VNNI's vpdpbusd (unsigned x signed bytes, four a lane, int32 sums):
// each p is stored as p + 128 (unsigned) and 128 * colsum(q) taken off the sums, which stay
// exact. The weight [K, N] int8 is packed per 64-column panel into the layout vpdpbusd wants
// (four consecutive k of a column in one dword) by two rounds of two-source byte/word permutes,
// once a call, and each panel then serves every row, six at a time (24 zmm of sums).
//
// Work is shared between the calling thread and XLA's intra-op pool through atomic counters:
// first the rows' quantization (8 rows a claim), then (panel, row chunk) tasks. A thread waits
// only for quantization chunks another thread has claimed and is running, and the caller never
// waits for a task nobody has claimed. Without AVX512 BW, VBMI and VNNI the library says so
// (jaxrl_cpu_w8a8_matmul_supported) and ops.py keeps the XLA path.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define JAXRL_W8A8 1
#include <immintrin.h>
#else
#define JAXRL_W8A8 0
#endif

extern "C" int jaxrl_cpu_w8a8_matmul_supported() { return JAXRL_W8A8; }

namespace ffi = xla::ffi;

namespace {

#if JAXRL_W8A8

constexpr int kPanel = 64;  // columns a packed panel: 4 zmm of 16 int32 sums
constexpr int kRows = 6;    // rows a micro-tile
constexpr int kQuantRows = 8;

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {  // bf16 -> f32: the 16 bits become the high half
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Row x[0..K) (K % 16 == 0) as p + 128 in u8; returns t.
template <typename T>
float quantize_row(const T* x, int64_t K, uint8_t* u) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x + k)));
  const float a = _mm512_reduce_max_ps(amax);
  // as XLA:CPU evaluates quant.py's `amax / 127` and `x / t`: times the f32 reciprocals
  const float t = a > 0.f ? a * (1.f / 127.f) : 1.f;
  const __m512 r = _mm512_set1_ps(1.f / t), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    __m512 p = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + k), r),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    p = _mm512_min_ps(_mm512_max_ps(p, lo), hi);
    __m128i b = _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(p), offset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + k), b);
  }
  return t;
}

// Byte and word indices of the two permute rounds (built once).
struct Perm {
  __m512i lo8, hi8, w0, w1;
  Perm() {
    alignas(64) uint8_t a[64], b[64];
    alignas(64) uint16_t c[32], d[32];
    for (int i = 0; i < 32; ++i) {  // (r0[c], r1[c]) for c < 32, then for c >= 32
      a[2 * i] = uint8_t(i), a[2 * i + 1] = uint8_t(64 + i);
      b[2 * i] = uint8_t(32 + i), b[2 * i + 1] = uint8_t(96 + i);
    }
    for (int i = 0; i < 16; ++i) {  // (pair01[c], pair23[c]) for c < 16, then c in [16, 32)
      c[2 * i] = uint16_t(i), c[2 * i + 1] = uint16_t(32 + i);
      d[2 * i] = uint16_t(16 + i), d[2 * i + 1] = uint16_t(48 + i);
    }
    lo8 = _mm512_load_si512(a), hi8 = _mm512_load_si512(b);
    w0 = _mm512_load_si512(c), w1 = _mm512_load_si512(d);
  }
};

// Pack columns [n0, n0 + 16 nv) of q [K, N] into panel[kk * nv + j] (kk = k / 4) and add each
// column's sum of q, times 128, to comp[j].
void pack(const int8_t* q, int64_t K, int64_t N, int64_t n0, int nv, __m512i* panel,
          __m512i* comp) {
  static const Perm perm;
  const __mmask64 mask = nv == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * nv)) - 1;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                     _mm512_setzero_si512()};
  for (int64_t k = 0; k < K; k += 4) {
    const int8_t* row = q + k * N + n0;
    __m512i r0 = _mm512_maskz_loadu_epi8(mask, row), r1 = _mm512_maskz_loadu_epi8(mask, row + N);
    __m512i r2 = _mm512_maskz_loadu_epi8(mask, row + 2 * N);
    __m512i r3 = _mm512_maskz_loadu_epi8(mask, row + 3 * N);
    __m512i a01 = _mm512_permutex2var_epi8(r0, perm.lo8, r1);
    __m512i b01 = _mm512_permutex2var_epi8(r0, perm.hi8, r1);
    __m512i a23 = _mm512_permutex2var_epi8(r2, perm.lo8, r3);
    __m512i b23 = _mm512_permutex2var_epi8(r2, perm.hi8, r3);
    __m512i out[4] = {_mm512_permutex2var_epi16(a01, perm.w0, a23),
                      _mm512_permutex2var_epi16(a01, perm.w1, a23),
                      _mm512_permutex2var_epi16(b01, perm.w0, b23),
                      _mm512_permutex2var_epi16(b01, perm.w1, b23)};
    __m512i* dst = panel + (k / 4) * nv;
    for (int j = 0; j < nv; ++j) {
      _mm512_store_si512(dst + j, out[j]);
      sums[j] = _mm512_dpbusd_epi32(sums[j], ones, out[j]);
    }
  }
  for (int j = 0; j < nv; ++j) comp[j] = _mm512_slli_epi32(sums[j], 7);
}

inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
inline void store16(uint16_t* o, __m512 v) {  // f32 -> bf16, round to nearest even
  __m512i b = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}

// (sum - 128 colsum) * t[i] * scale for R rows of NV zmm columns, in the order quant.py's XLA
// form multiplies. Not inlined: inlined, GCC keeps some sums of the loop in memory.
template <int R, int NV, typename T>
__attribute__((noinline)) void finish(const __m512i* acc, const __m512i* comp, const float* t,
                                      const float* scale, T* out, int64_t N) {
  for (int i = 0; i < R; ++i) {
    const __m512 ti = _mm512_set1_ps(t[i]);
    for (int j = 0; j < NV; ++j) {
      __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i * NV + j], comp[j]));
      store16(out + i * N + 16 * j, _mm512_mul_ps(_mm512_mul_ps(v, ti), _mm512_loadu_ps(scale + 16 * j)));
    }
  }
}

// Rows [0, R) of u (stride K) against one packed panel of NV zmm columns. The R x NV sums are
// named variables (c<row>_<column>), which GCC keeps in registers, unlike an array of them.
#define JAXRL_EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define JAXRL_EACH_COL(X, i) X(i, 0) X(i, 1) X(i, 2) X(i, 3)
#define JAXRL_ZERO(i, j) __m512i c##i##_##j = _mm512_setzero_si512();
#define JAXRL_ZERO_ROW(i) JAXRL_EACH_COL(JAXRL_ZERO, i)
#define JAXRL_DOT(i, j) \
  if constexpr (j < NV) c##i##_##j = _mm512_dpbusd_epi32(c##i##_##j, a, _mm512_load_si512(b + j));
#define JAXRL_STEP(i)                          \
  if constexpr (i < R) {                       \
    int32_t word;                              \
    std::memcpy(&word, u + i * K + 4 * kk, 4); \
    const __m512i a = _mm512_set1_epi32(word); \
    JAXRL_EACH_COL(JAXRL_DOT, i)               \
  }
#define JAXRL_KEEP(i, j) \
  if constexpr (i < R && j < NV) acc[i * NV + j] = c##i##_##j;
#define JAXRL_KEEP_ROW(i) JAXRL_EACH_COL(JAXRL_KEEP, i)
template <int R, int NV, typename T>
void tile(const uint8_t* u, int64_t K, const __m512i* panel, const __m512i* comp, const float* t,
          const float* scale, T* out, int64_t N) {
  static_assert(R >= 1 && R <= kRows && NV >= 1 && NV <= 4, "tile shape");
  JAXRL_EACH_ROW(JAXRL_ZERO_ROW)
  for (int64_t kk = 0; kk < K / 4; ++kk) {
    const __m512i* b = panel + kk * NV;
    JAXRL_EACH_ROW(JAXRL_STEP)
  }
  alignas(64) __m512i acc[R * NV];
  JAXRL_EACH_ROW(JAXRL_KEEP_ROW)
  finish<R, NV>(acc, comp, t, scale, out, N);
}
#undef JAXRL_EACH_ROW
#undef JAXRL_EACH_COL
#undef JAXRL_ZERO
#undef JAXRL_ZERO_ROW
#undef JAXRL_DOT
#undef JAXRL_STEP
#undef JAXRL_KEEP
#undef JAXRL_KEEP_ROW

template <int NV, typename T>
void rows(const uint8_t* u, int64_t K, const __m512i* panel, const __m512i* comp, const float* t,
          const float* scale, T* out, int64_t N, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows)
    tile<kRows, NV>(u + m * K, K, panel, comp, t + m, scale, out + m * N, N);
  const auto rest = [&](auto r) {
    tile<decltype(r)::value, NV>(u + m * K, K, panel, comp, t + m, scale, out + m * N, N);
  };
  switch (m1 - m) {
    case 1: rest(std::integral_constant<int, 1>{}); break;
    case 2: rest(std::integral_constant<int, 2>{}); break;
    case 3: rest(std::integral_constant<int, 3>{}); break;
    case 4: rest(std::integral_constant<int, 4>{}); break;
    case 5: rest(std::integral_constant<int, 5>{}); break;
    default: break;
  }
}

struct Counters {
  std::atomic<int64_t> quant_next{0}, quant_done{0}, next{0}, done{0};
};

template <typename T>
ffi::Error Run(ffi::ThreadPool& pool, const T* x, const int8_t* q, const float* scale, T* out,
               int64_t M, int64_t K, int64_t N) {
  thread_local std::vector<uint8_t> u_buf;
  thread_local std::vector<float> t_buf;
  u_buf.resize(size_t(M * K));
  t_buf.resize(size_t(M));
  uint8_t* u = u_buf.data();
  float* t = t_buf.data();
  const int64_t quant_chunks = (M + kQuantRows - 1) / kQuantRows;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // enough (panel, row chunk) tasks to keep every thread busy; each chunk repacks its panel
  const int64_t chunks = std::clamp<int64_t>((2 * threads + panels - 1) / panels, 1,
                                             (M + kRows - 1) / kRows);
  const int64_t chunk_rows = ((M + chunks - 1) / chunks + kRows - 1) / kRows * kRows;
  const int64_t tasks = panels * chunks;
  auto counters = std::make_shared<Counters>();
  auto work = [=]() {
    for (int64_t c; (c = counters->quant_next.fetch_add(1)) < quant_chunks;) {
      for (int64_t m = c * kQuantRows; m < std::min(M, (c + 1) * kQuantRows); ++m)
        t[m] = quantize_row(x + m * K, K, u + m * K);
      counters->quant_done.fetch_add(1);
    }
    thread_local std::vector<__m512i> panel_buf;
    for (int64_t task; (task = counters->next.fetch_add(1)) < tasks;) {
      // every quantization chunk is claimed by now, by a running thread
      while (counters->quant_done.load() < quant_chunks) std::this_thread::yield();
      const int64_t p = task / chunks, chunk = task % chunks;
      const int64_t n0 = p * kPanel;
      const int nv = int(std::min<int64_t>(kPanel, N - n0) / 16);
      panel_buf.resize(size_t(K / 4 * nv));
      __m512i comp[4];
      pack(q, K, N, n0, nv, panel_buf.data(), comp);
      const int64_t m0 = chunk * chunk_rows, m1 = std::min(M, m0 + chunk_rows);
      const __m512i* pb = panel_buf.data();
      switch (nv) {
        case 1: rows<1>(u, K, pb, comp, t, scale + n0, out + n0, N, m0, m1); break;
        case 2: rows<2>(u, K, pb, comp, t, scale + n0, out + n0, N, m0, m1); break;
        case 3: rows<3>(u, K, pb, comp, t, scale + n0, out + n0, N, m0, m1); break;
        default: rows<4>(u, K, pb, comp, t, scale + n0, out + n0, N, m0, m1); break;
      }
      counters->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min(threads, tasks) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (counters->done.load() < tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

#endif  // JAXRL_W8A8

ffi::Error W8A8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> q,
                ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> out) {
#if JAXRL_W8A8
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || xd[1] != qd[0] || scale.element_count() != qd[1] ||
      xd[1] % 16 != 0 || qd[1] % 16 != 0 || out->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("cpu w8a8 matmul: want x [M, K], q [K, N], scale [N], "
                                       "K and N multiples of 16, out [M, N] in x's dtype");
  const int64_t M = xd[0], K = xd[1], N = qd[1];
  if (M == 0) return ffi::Error::Success();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      return Run(pool, static_cast<const float*>(x.untyped_data()), q.typed_data(),
                 scale.typed_data(), static_cast<float*>(out->untyped_data()), M, K, N);
    case ffi::DataType::BF16:
      return Run(pool, static_cast<const uint16_t*>(x.untyped_data()), q.typed_data(),
                 scale.typed_data(), static_cast<uint16_t*>(out->untyped_data()), M, K, N);
    default:
      return ffi::Error::InvalidArgument("cpu w8a8 matmul: x must be f32 or bf16");
  }
#else
  return ffi::Error::Internal("cpu w8a8 matmul: built without AVX512 BW, VBMI and VNNI");
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl_cpu_w8a8_matmul, W8A8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K] f32 or bf16
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q [K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [N]
                                  .Ret<ffi::AnyBuffer>());        // out [M, N], x's dtype
