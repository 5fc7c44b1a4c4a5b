// The k largest values of each row of an f32 [B, N] array, in descending order, and their
// indices, as an XLA FFI custom call on CPU (ops.py builds and loads it).
//
// XLA:CPU's TopK sorts each row's candidates on one thread. Here each row is scanned once in
// index order against the k-th largest value so far: after the first few hundred entries
// almost none passes, so a row costs about one compare an entry. Equal values keep the lower
// index, as lax.top_k does. Rows are shared between the calling thread and
// XLA's intra-op pool through one atomic counter, in blocks of 8 rows.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Entry {
  float value;
  int32_t index;
};
// a before b in the result: larger value, then lower index
inline bool before(const Entry& a, const Entry& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

void top_row(const float* x, int64_t n, int64_t k, float* values, int32_t* indices,
             std::vector<Entry>& kept) {
  // Entries above `floor` (the k-th largest so far) are appended; at 4k they are cut back to
  // the k best, which raises the floor. The first k entries are taken whatever they are.
  const size_t cap = size_t(4 * k);
  kept.clear();
  kept.reserve(cap);
  float floor = 0.f;
  auto cut = [&]() {
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
    kept.resize(size_t(k));
    floor = std::min_element(kept.begin(), kept.end(), [](const Entry& a, const Entry& b) {
      return a.value < b.value;
    })->value;
  };
  for (int64_t i = 0; i < k; ++i) kept.push_back({x[i], int32_t(i)});
  cut();
  for (int64_t i = k; i < n; ++i) {
    if (x[i] > floor) {  // strictly: an equal later entry loses to the kept one
      kept.push_back({x[i], int32_t(i)});
      if (kept.size() == cap) cut();
    }
  }
  if (kept.size() > size_t(k)) cut();
  std::sort(kept.begin(), kept.end(), before);
  for (int64_t i = 0; i < k; ++i) {
    values[i] = kept[i].value;
    indices[i] = kept[i].index;
  }
}

struct Counter {
  std::atomic<int64_t> next{0}, done{0};
};

ffi::Error TopK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> values,
                ffi::Result<ffi::Buffer<ffi::S32>> indices) {
  const auto dims = x.dimensions();
  const auto out = values->dimensions();
  if (dims.size() != 2 || out.size() != 2 || out[0] != dims[0] || out[1] > dims[1] || out[1] < 1)
    return ffi::Error::InvalidArgument("cpu top_k: x must be [B, N] and the results [B, k], "
                                       "1 <= k <= N");
  const int64_t rows = dims[0], n = dims[1], k = out[1];
  const float* xs = x.typed_data();
  float* vs = values->typed_data();
  int32_t* is = indices->typed_data();
  constexpr int64_t kBlock = 8;
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  auto counter = std::make_shared<Counter>();
  auto work = [=]() {
    thread_local std::vector<Entry> kept;
    for (int64_t b; (b = counter->next.fetch_add(1)) < blocks;) {
      for (int64_t r = b * kBlock; r < std::min(rows, (b + 1) * kBlock); ++r)
        top_row(xs + r * n, n, k, vs + r * k, is + r * k, kept);
      counter->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), blocks) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (counter->done.load() < blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

using Values = ffi::Result<ffi::Buffer<ffi::F32>>;  // aliases: a macro argument may not hold commas
using Indices = ffi::Result<ffi::Buffer<ffi::S32>>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl_cpu_top_k, TopK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [B, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // values [B, k]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices [B, k]
