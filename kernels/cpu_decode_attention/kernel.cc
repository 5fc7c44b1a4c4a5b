// One decode step's attention on XLA:CPU, as an XLA FFI custom call (ops.py builds and loads it).
//
// Per row b and kv head h of a heads-major cache (keys [B, K, D, S], values [B, K, S, D]):
// write the step's key and value at slot[b] in place, then attend the head's G queries
// (pre-scaled, f32) to the row's first n[b] entries. Scores, softmax and sums are f32; the
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
#include <vector>

#include "xla/ffi/api/ffi.h"

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

// scores[g, j] = q[g0 + g] . k[:, j] for j in [0, n), GB queries at a time; sc rows hold n16.
// Two 16-slot vectors a key row (one 64-byte line of bf16) per pass over the head's D rows.
template <typename T, int GB>
void scores(const float* q, const T* k, int g0, int n, int n16, int D, int S, float* sc) {
  int j = 0;
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

// One row x kv head: q, out [G, D]; k [D, S]; v [S, D]; attends to slots [0, n).
template <typename T>
void attend(const float* q, const T* k, const T* v, float* out, int n, int G, int D, int S,
            std::vector<float>& sc) {
  const int n16 = (n + L - 1) / L * L;
  sc.resize(size_t(G) * n16 + G);
  float* inv = sc.data() + size_t(G) * n16;
  for (int g0 = 0; g0 < G; g0 += 4) {
    switch (std::min(4, G - g0)) {
      case 1: scores<T, 1>(q, k, g0, n, n16, D, S, sc.data()); break;
      case 2: scores<T, 2>(q, k, g0, n, n16, D, S, sc.data()); break;
      case 3: scores<T, 3>(q, k, g0, n, n16, D, S, sc.data()); break;
      default: scores<T, 4>(q, k, g0, n, n16, D, S, sc.data());
    }
  }
  for (int g = 0; g < G; ++g) {
    float* s = sc.data() + size_t(g) * n16;
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
  for (int g0 = 0; g0 < G; g0 += 4) {
    switch (std::min(4, G - g0)) {
      case 1: values_gb<T, 1>(sc.data(), v, inv, g0, n, n16, D, out); break;
      case 2: values_gb<T, 2>(sc.data(), v, inv, g0, n, n16, D, out); break;
      case 3: values_gb<T, 3>(sc.data(), v, inv, g0, n, n16, D, out); break;
      default: values_gb<T, 4>(sc.data(), v, inv, g0, n, n16, D, out);
    }
  }
}

using Queries = ffi::Buffer<ffi::F32, 4>;  // aliases: a macro argument may not hold commas
using Rows = ffi::Buffer<ffi::S32, 1>;

struct Counter {
  std::atomic<int64_t> next{0}, done{0};
};

template <typename T>
ffi::Error step(ffi::ThreadPool pool, const float* q, const T* k_new, const T* v_new, T* k, T* v,
                const int32_t* slot, const int32_t* n, float* out, int64_t B, int64_t K,
                int64_t G, int64_t D, int64_t S) {
  const int64_t total = B * K;
  auto counter = std::make_shared<Counter>();
  auto work = [=]() {
    thread_local std::vector<float> sc;
    for (int64_t i; (i = counter->next.fetch_add(1)) < total;) {
      const int64_t b = i / K;
      T* kc = k + i * D * S;
      T* vc = v + i * S * D;
      const int64_t at = std::clamp<int64_t>(slot[b], 0, S - 1);  // as the XLA select: clamped
      for (int64_t d = 0; d < D; ++d) kc[d * S + at] = k_new[i * D + d];
      std::memcpy(vc + at * D, v_new + i * D, sizeof(T) * D);
      const int rows = int(std::clamp<int64_t>(n[b], 1, S));
      attend<T>(q + i * G * D, kc, vc, out + i * G * D, rows, int(G), int(D), int(S), sc);
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
                           ffi::Result<ffi::AnyBuffer> v_out) {
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
                          n.typed_data(), out->typed_data(), B, K, G, D, S);
  return step<float>(pool, q.typed_data(), static_cast<const float*>(k_new.untyped_data()),
                     static_cast<const float*>(v_new.untyped_data()),
                     static_cast<float*>(k_out->untyped_data()),
                     static_cast<float*>(v_out->untyped_data()), slot.typed_data(),
                     n.typed_data(), out->typed_data(), B, K, G, D, S);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl_cpu_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Queries>()                  // q [B, K, G, D], scaled
                                  .Arg<ffi::AnyBuffer>()            // k_new [B, K, D]
                                  .Arg<ffi::AnyBuffer>()            // v_new [B, K, D]
                                  .Arg<ffi::AnyBuffer>()            // k_cache [B, K, D, S]
                                  .Arg<ffi::AnyBuffer>()            // v_cache [B, K, S, D]
                                  .Arg<Rows>()                     // slot [B]
                                  .Arg<Rows>()                     // n [B]
                                  .Ret<Queries>()                  // out [B, K, G, D]
                                  .Ret<ffi::AnyBuffer>()            // k_cache, in place
                                  .Ret<ffi::AnyBuffer>());          // v_cache, in place
