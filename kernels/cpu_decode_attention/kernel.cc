// One decode step's attention on XLA:CPU, as an XLA FFI custom call (ops.py builds and loads it).
//
// Per row b and kv head h of a heads-major cache (keys [B, K, D, S], values [B, K, S, D]):
// write the step's key and value at slot[b] in place, then attend the head's G queries
// (f32, the scores times `scale`) to the row's first n[b] entries. Scores, softmax and sums are f32; the
// cache is bf16 or f32. Rows x heads are shared between the calling thread and XLA's intra-op
// pool through one atomic counter: the caller never waits for a task nobody has claimed.
//
// GCC/Clang vector extensions, no intrinsics: the compiler lowers the 16-lane vectors to what
// `-march=native` offers (one zmm with AVX-512, two ymm with AVX2).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint16_t H16 __attribute__((vector_size(32)));
constexpr int L = 16;  // lanes

inline F16 splat(float x) { return F16{} + x; }
inline F16 load(const float* p) { F16 r; std::memcpy(&r, p, sizeof r); return r; }
inline F16 load(const uint16_t* p) {  // bf16 -> f32: the 16 bits become the high half
  H16 h;
  std::memcpy(&h, p, sizeof h);
  U16 u = __builtin_convertvector(h, U16) << 16;
  F16 r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}
template <typename T>
inline F16 load_part(const T* p, int count) {  // the first `count` lanes, zeros after
  T tmp[L] = {};
  std::memcpy(tmp, p, sizeof(T) * count);
  return load(tmp);
}
inline void store(float* p, F16 x) { std::memcpy(p, &x, sizeof x); }
inline float hmax(F16 x) { float m = x[0]; for (int i = 1; i < L; ++i) m = std::max(m, x[i]); return m; }
inline float hsum(F16 x) { float s = 0.f; for (int i = 0; i < L; ++i) s += x[i]; return s; }

// exp(x) for x <= 0: 2^round(x log2 e) times a degree-6 polynomial of the rest (relative error
// ~1e-7); below -87 it flushes towards 0 (exp(-87) ~ 1.6e-38). Built without -ffast-math, so
// the round-to-nearest by adding and subtracting 1.5 * 2^23 survives.
inline F16 vexp(F16 x) {
  x = x < -87.f ? splat(-87.f) : x;
  F16 t = x * 1.44269504f;
  F16 n = (t + 12582912.f) - 12582912.f;
  F16 y = (t - n) * 0.693147181f;
  F16 p = 1.f + y * (1.f + y * (0.5f + y * (1.f / 6 + y * (1.f / 24 + y * (1.f / 120 + y * (1.f / 720))))));
  I16 e = (__builtin_convertvector(n, I16) + 127) << 23;
  F16 scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// scores[g, j] = q[g0 + g] . k[:, j] for j in [j0, n16), GB queries at a time; sc rows hold n16.
// Two 16-slot vectors a key row (one 64-byte line of bf16) per pass over the head's D rows.
template <typename T, int GB>
void scores(const float* q, const T* k, int g0, int j0, int n16, int D, int S, float* sc) {
  int j = j0;
  for (; j + 2 * L <= std::min(n16, S); j += 2 * L) {
    F16 a0[GB] = {}, a1[GB] = {};
    for (int d = 0; d < D; ++d) {
      const T* row = k + size_t(d) * S + j;
      __builtin_prefetch(row + 2 * L);
      F16 k0 = load(row), k1 = load(row + L);
      for (int g = 0; g < GB; ++g) {
        const float qv = q[(g0 + g) * D + d];
        a0[g] += qv * k0;
        a1[g] += qv * k1;
      }
    }
    for (int g = 0; g < GB; ++g) {
      store(sc + size_t(g0 + g) * n16 + j, a0[g]);
      store(sc + size_t(g0 + g) * n16 + j + L, a1[g]);
    }
  }
  for (; j < n16; j += L) {
    const int width = std::min(L, S - j);
    F16 acc[GB] = {};
    for (int d = 0; d < D; ++d) {
      const T* row = k + size_t(d) * S + j;
      F16 kv = width == L ? load(row) : load_part(row, width);
      for (int g = 0; g < GB; ++g) acc[g] += q[(g0 + g) * D + d] * kv;
    }
    for (int g = 0; g < GB; ++g) store(sc + size_t(g0 + g) * n16 + j, acc[g]);
  }
}

// out[g0 + g, e0 : e0 + 16 VB] = sum_j p[g0 + g, j] v[j, e0 : ...], divided by the row's sum.
template <typename T, int GB, int VB>
void values(const float* sc, const T* v, const float* inv, int g0, int e0, int n, int n16, int D,
            float* out) {
  F16 acc[GB][VB] = {};
  for (int j = 0; j < n; ++j) {
    F16 vv[VB];
    for (int c = 0; c < VB; ++c) vv[c] = load(v + size_t(j) * D + e0 + L * c);
    for (int g = 0; g < GB; ++g) {
      const float p = sc[size_t(g0 + g) * n16 + j];
      for (int c = 0; c < VB; ++c) acc[g][c] += p * vv[c];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < VB; ++c) store(out + (g0 + g) * D + e0 + L * c, acc[g][c] * inv[g0 + g]);
}

template <typename T, int GB>
void values_gb(const float* sc, const T* v, const float* inv, int g0, int n, int n16, int D,
               float* out) {
  for (int e0 = 0; e0 < D; e0 += 4 * L) {
    switch (std::min(4, (D - e0) / L)) {
      case 1: values<T, GB, 1>(sc, v, inv, g0, e0, n, n16, D, out); break;
      case 2: values<T, GB, 2>(sc, v, inv, g0, e0, n, n16, D, out); break;
      case 3: values<T, GB, 3>(sc, v, inv, g0, e0, n, n16, D, out); break;
      default: values<T, GB, 4>(sc, v, inv, g0, e0, n, n16, D, out);
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 caches on CPUs with AVX512_BF16: `vdpbf16ps` multiplies 16 pairs of bf16 and adds both
// products to 16 f32 sums, half the instructions of widening to f32. A pair runs along the
// contracted axis, so two key rows (d, d + 1) or two value rows (j, j + 1) are interleaved by
// `unpacklo/hi_epi16`, which work within 128-bit lanes: the lo sums hold elements
// {0-3, 8-11, 16-19, 24-27} of 32 and the hi sums the rest, put back in order by `unmix`.
#define JAXRL_BF16_DOTS 1

inline __m512i load32(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline __m512 dot2(__m512 acc, __m512i pairs, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)pairs, (__m512bh)b);
}
inline void unmix(__m512 lo, __m512 hi, float* out32) {  // -> elements 0..31 in order
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  _mm512_storeu_ps(out32, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(out32 + 16, _mm512_permutex2var_ps(lo, second, hi));
}
inline uint32_t bf16_pair(float a, float b) {  // round to nearest even; a in the low half
  auto round = [](float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
  };
  return round(a) | (round(b) << 16);
}

// Scores of 32-slot chunks [j, j + 32) within S; returns where the rest starts.
template <int GB>
int scores_bf16(const uint32_t* qpairs, const uint16_t* k, int g0, int n16, int D, int S,
                float scale, float* sc) {
  int j = 0;
  for (; j + 32 <= std::min(n16, S); j += 32) {
    __m512 lo[GB], hi[GB];
    for (int g = 0; g < GB; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2) {
      const __m512i a = load32(k + size_t(d) * S + j), b = load32(k + size_t(d + 1) * S + j);
      const __m512i pl = _mm512_unpacklo_epi16(a, b), ph = _mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < GB; ++g) {
        const __m512i qq = _mm512_set1_epi32(int(qpairs[(g0 + g) * (D / 2) + d / 2]));
        lo[g] = dot2(lo[g], pl, qq);
        hi[g] = dot2(hi[g], ph, qq);
      }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int g = 0; g < GB; ++g)
      unmix(_mm512_mul_ps(lo[g], sv), _mm512_mul_ps(hi[g], sv), sc + size_t(g0 + g) * n16 + j);
  }
  return j;
}

// out[g0 + g, e0 : e0 + 64] = sum_j p[g0 + g, j] v[j, e0 : e0 + 64] / sum, rows j in pairs.
template <int GB>
void values_bf16(const uint32_t* ppairs, int half, const uint16_t* v, const float* inv, int g0,
                 int e0, int n, int D, float* out) {
  __m512 acc[GB][4];
  for (int g = 0; g < GB; ++g) for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 2) {
    const uint16_t* r0 = v + size_t(j) * D + e0;
    const __m512i a0 = load32(r0), a1 = load32(r0 + 32);
    // an odd last row pairs with zeros (its probability's partner is 0 too)
    const __m512i b0 = j + 1 < n ? load32(r0 + D) : _mm512_setzero_si512();
    const __m512i b1 = j + 1 < n ? load32(r0 + D + 32) : _mm512_setzero_si512();
    const __m512i u0 = _mm512_unpacklo_epi16(a0, b0), u1 = _mm512_unpackhi_epi16(a0, b0);
    const __m512i u2 = _mm512_unpacklo_epi16(a1, b1), u3 = _mm512_unpackhi_epi16(a1, b1);
    for (int g = 0; g < GB; ++g) {
      const __m512i pp = _mm512_set1_epi32(int(ppairs[size_t(g0 + g) * half + j / 2]));
      acc[g][0] = dot2(acc[g][0], u0, pp);
      acc[g][1] = dot2(acc[g][1], u1, pp);
      acc[g][2] = dot2(acc[g][2], u2, pp);
      acc[g][3] = dot2(acc[g][3], u3, pp);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 iv = _mm512_set1_ps(inv[g0 + g]);
    float* o = out + (g0 + g) * D + e0;
    unmix(_mm512_mul_ps(acc[g][0], iv), _mm512_mul_ps(acc[g][1], iv), o);
    unmix(_mm512_mul_ps(acc[g][2], iv), _mm512_mul_ps(acc[g][3], iv), o + 32);
  }
}
#endif

// One row x kv head: q, out [G, D]; k [D, S]; v [S, D]; attends to slots [0, n) with scores
// scaled by `scale`. `scratch` is the calling thread's.
struct Scratch {
  std::vector<float> q, sc;
  std::vector<uint32_t> pairs;
};

template <typename F>
void blocks_of_4(int G, F&& f) {  // f(g0, std::integral_constant<int, GB>) for blocks of <= 4
  for (int g0 = 0; g0 < G; g0 += 4) {
    switch (std::min(4, G - g0)) {
      case 1: f(g0, std::integral_constant<int, 1>()); break;
      case 2: f(g0, std::integral_constant<int, 2>()); break;
      case 3: f(g0, std::integral_constant<int, 3>()); break;
      default: f(g0, std::integral_constant<int, 4>());
    }
  }
}

template <typename T>
void attend(const float* q_in, const T* k, const T* v, float* out, int n, int G, int D, int S,
            float scale, Scratch& scratch) {
  const int n16 = (n + L - 1) / L * L;
  scratch.sc.resize(size_t(G) * n16 + G);
  float* sc = scratch.sc.data();
  float* inv = sc + size_t(G) * n16;
  int done = 0;  // scores [0, done) are computed by the bf16 path
#ifdef JAXRL_BF16_DOTS
  constexpr bool bf16_dots = std::is_same_v<T, uint16_t>;
  const bool paired = bf16_dots && D % 64 == 0;
  if (paired) {  // q holds bf16 values (the model's), so its pairs are exact
    scratch.pairs.resize(size_t(G) * std::max(D / 2, n16 / 2));
    uint32_t* qp = scratch.pairs.data();
    for (int i = 0; i < G * D; i += 2) qp[i / 2] = bf16_pair(q_in[i], q_in[i + 1]);
    blocks_of_4(G, [&](int g0, auto gb) {
      done = scores_bf16<decltype(gb)::value>(qp, reinterpret_cast<const uint16_t*>(k), g0, n16,
                                              D, S, scale, sc);
    });
  }
#else
  const bool paired = false;
#endif
  if (done < n16) {  // f32 sums (an f32 cache, no AVX512_BF16, or the last slots)
    scratch.q.resize(size_t(G) * D);
    for (int i = 0; i < G * D; ++i) scratch.q[i] = q_in[i] * scale;
    blocks_of_4(G, [&](int g0, auto gb) {
      scores<T, decltype(gb)::value>(scratch.q.data(), k, g0, done, n16, D, S, sc);
    });
  }
  for (int g = 0; g < G; ++g) {
    float* s = sc + size_t(g) * n16;
    for (int j = n; j < n16; ++j) s[j] = -INFINITY;
    F16 m = splat(-INFINITY);
    for (int j = 0; j < n16; j += L) { F16 x = load(s + j); m = x > m ? x : m; }
    const float mx = hmax(m);
    F16 sum = {};
    for (int j = 0; j < n16; j += L) {
      F16 p = vexp(load(s + j) - mx);
      if (j + L > n) for (int i = n - j; i < L; ++i) p[i] = 0.f;
      store(s + j, p);
      sum += p;
    }
    inv[g] = 1.f / hsum(sum);
  }
#ifdef JAXRL_BF16_DOTS
  if (paired) {  // probabilities rounded to bf16 pairs, as XLA's bf16 p @ v rounds them
    const int half = n16 / 2;
    uint32_t* pp = scratch.pairs.data();
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < n16; j += 2) pp[size_t(g) * half + j / 2] =
          bf16_pair(sc[size_t(g) * n16 + j], sc[size_t(g) * n16 + j + 1]);
    for (int e0 = 0; e0 < D; e0 += 64)
      blocks_of_4(G, [&](int g0, auto gb) {
        values_bf16<decltype(gb)::value>(pp, half, reinterpret_cast<const uint16_t*>(v), inv, g0,
                                         e0, n, D, out);
      });
    return;
  }
#endif
  blocks_of_4(G, [&](int g0, auto gb) {
    values_gb<T, decltype(gb)::value>(sc, v, inv, g0, n, n16, D, out);
  });
}

using Queries = ffi::Buffer<ffi::F32, 4>;  // aliases: a macro argument may not hold commas
using Rows = ffi::Buffer<ffi::S32, 1>;

struct Counter {
  std::atomic<int64_t> next{0}, done{0};
};

template <typename T>
ffi::Error step(ffi::ThreadPool pool, const float* q, const T* k_new, const T* v_new, T* k, T* v,
                const int32_t* slot, const int32_t* n, float* out, int64_t B, int64_t K,
                int64_t G, int64_t D, int64_t S, float scale) {
  const int64_t total = B * K;
  auto counter = std::make_shared<Counter>();
  auto work = [=]() {
    thread_local Scratch scratch;
    for (int64_t i; (i = counter->next.fetch_add(1)) < total;) {
      const int64_t b = i / K;
      T* kc = k + i * D * S;
      T* vc = v + i * S * D;
      const int64_t at = std::clamp<int64_t>(slot[b], 0, S - 1);  // as the XLA select: clamped
      for (int64_t d = 0; d < D; ++d) kc[d * S + at] = k_new[i * D + d];
      std::memcpy(vc + at * D, v_new + i * D, sizeof(T) * D);
      const int rows = int(std::clamp<int64_t>(n[b], 1, S));
      attend<T>(q + i * G * D, kc, vc, out + i * G * D, rows, int(G), int(D), int(S), scale,
                scratch);
      counter->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (counter->done.load() < total) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, Queries q, ffi::AnyBuffer k_new,
                           ffi::AnyBuffer v_new, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           Rows slot, Rows n,
                           ffi::Result<Queries> out, ffi::Result<ffi::AnyBuffer> k_out,
                           ffi::Result<ffi::AnyBuffer> v_out, float scale) {
  const auto qd = q.dimensions();  // [B, K, G, D]
  const auto kd = k_cache.dimensions();  // [B, K, D, S]
  const int64_t B = qd[0], K = qd[1], G = qd[2], D = qd[3];
  const auto type = k_cache.element_type();
  if (kd.size() != 4 || kd[0] != B || kd[1] != K || kd[2] != D || D % L != 0)
    return ffi::Error::InvalidArgument("cpu decode attention: cache [B, K, D, S] must match "
                                       "queries [B, K, G, D], with D a multiple of 16");
  if ((type != ffi::DataType::BF16 && type != ffi::DataType::F32) || v_cache.element_type() != type ||
      k_new.element_type() != type || v_new.element_type() != type)
    return ffi::Error::InvalidArgument("cpu decode attention: caches and new entries must share "
                                       "one dtype, bfloat16 or float32");
  const int64_t S = kd[3];
  // Aliased results share their operands' buffers; otherwise start from a copy.
  if (k_out->untyped_data() != k_cache.untyped_data())
    std::memcpy(k_out->untyped_data(), k_cache.untyped_data(), k_cache.size_bytes());
  if (v_out->untyped_data() != v_cache.untyped_data())
    std::memcpy(v_out->untyped_data(), v_cache.untyped_data(), v_cache.size_bytes());
  if (type == ffi::DataType::BF16)
    return step<uint16_t>(pool, q.typed_data(), static_cast<const uint16_t*>(k_new.untyped_data()),
                          static_cast<const uint16_t*>(v_new.untyped_data()),
                          static_cast<uint16_t*>(k_out->untyped_data()),
                          static_cast<uint16_t*>(v_out->untyped_data()), slot.typed_data(),
                          n.typed_data(), out->typed_data(), B, K, G, D, S, scale);
  return step<float>(pool, q.typed_data(), static_cast<const float*>(k_new.untyped_data()),
                     static_cast<const float*>(v_new.untyped_data()),
                     static_cast<float*>(k_out->untyped_data()),
                     static_cast<float*>(v_out->untyped_data()), slot.typed_data(),
                     n.typed_data(), out->typed_data(), B, K, G, D, S, scale);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl_cpu_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Queries>()                  // q [B, K, G, D]
                                  .Arg<ffi::AnyBuffer>()            // k_new [B, K, D]
                                  .Arg<ffi::AnyBuffer>()            // v_new [B, K, D]
                                  .Arg<ffi::AnyBuffer>()            // k_cache [B, K, D, S]
                                  .Arg<ffi::AnyBuffer>()            // v_cache [B, K, S, D]
                                  .Arg<Rows>()                     // slot [B]
                                  .Arg<Rows>()                     // n [B]
                                  .Ret<Queries>()                  // out [B, K, G, D]
                                  .Ret<ffi::AnyBuffer>()            // k_cache, in place
                                  .Ret<ffi::AnyBuffer>()            // v_cache, in place
                                  .Attr<float>("scale"));
