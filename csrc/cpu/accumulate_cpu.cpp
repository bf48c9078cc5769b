// CPU backend of the fused accumulation kernels.
//
// Note [CPU vector paths]
// The extension is compiled for the baseline x86-64 ISA so that it loads on any CPU
// PyTorch supports. The hot loops therefore exist twice: a portable version the
// compiler vectorises for the baseline, and an AVX2+FMA+F16C version selected at run
// time with __builtin_cpu_supports. The AVX2 versions carry GCC's target attribute on
// the functions themselves (not a file-wide pragma), so inline functions from ATen's
// headers are never compiled for AVX2 in this file and no AVX2 instruction can leak
// into code shared with the baseline path.
// Within one path every element is computed the same way (the AVX2 path uses a fused
// multiply-add for vector bodies and tails alike), so a result depends only on the
// path, never on where a tensor starts or how work was split between threads.
#include "../ops.h"
#include "cpu_common.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VFLOW_CPU_AVX2 1
#endif

namespace vflow {
namespace {

using cpu::bf16_bits_to_float;
using cpu::kGrainElems;
using cpu::widen;

// ---- Portable path ----

// kOverwrite selects acc = w * g instead of acc += w * g (see multi_accumulate_).
template <bool kOverwrite, typename T>
inline T combine(T acc, T scaled) {
  return kOverwrite ? scaled : acc + scaled;
}

template <bool kOverwrite, typename A, typename G>
void axpy_portable(A* __restrict__ acc, const G* __restrict__ g, A w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    acc[i] = combine<kOverwrite>(acc[i], w * widen(g[i]));
  }
}

template <typename T>
void scale_portable(T* __restrict__ x, T f, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    x[i] *= f;
  }
}

template <typename T>
bool scale_check_portable(T* __restrict__ x, T f, bool write, int64_t n) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const T y = x[i] * f;
    if (write) {
      x[i] = y;
    }
    bad |= !std::isfinite(y);
  }
  return bad;
}

// ---- AVX2 path (see Note [CPU vector paths]) ----
#ifdef VFLOW_CPU_AVX2
#define VFLOW_AVX2 __attribute__((target("avx2,fma,f16c")))

// Gradient loaders: 8 values widened to float (vec) or one value (one).
struct LoadF32 {
  using T = float;
  VFLOW_AVX2 static inline __m256 vec(const float* p) {
    return _mm256_loadu_ps(p);
  }
  VFLOW_AVX2 static inline float one(const float* p) {
    return *p;
  }
};

struct LoadBF16 {
  using T = uint16_t;
  VFLOW_AVX2 static inline __m256 vec(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  VFLOW_AVX2 static inline float one(const uint16_t* p) {
    return bf16_bits_to_float(*p);
  }
};

struct LoadF16 {
  using T = uint16_t;
  VFLOW_AVX2 static inline __m256 vec(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  VFLOW_AVX2 static inline float one(const uint16_t* p) {
    return _cvtsh_ss(*p);
  }
};

// acc (+)= w * g into float32: two 8-lane FMAs per iteration keep both load ports busy.
// With kOverwrite the product is rounded once, exactly as fma(w, g, 0) would be, so
// overwriting a zeroed slot and accumulating into it give the same bits.
template <bool kOverwrite, typename Load>
VFLOW_AVX2 void axpy_f32_avx2(float* acc, const typename Load::T* g, float w, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a0;
    __m256 a1;
    if constexpr (kOverwrite) {
      a0 = _mm256_mul_ps(wv, Load::vec(g + i));
      a1 = _mm256_mul_ps(wv, Load::vec(g + i + 8));
    } else {
      a0 = _mm256_fmadd_ps(wv, Load::vec(g + i), _mm256_loadu_ps(acc + i));
      a1 = _mm256_fmadd_ps(wv, Load::vec(g + i + 8), _mm256_loadu_ps(acc + i + 8));
    }
    _mm256_storeu_ps(acc + i, a0);
    _mm256_storeu_ps(acc + i + 8, a1);
  }
  for (; i < n; ++i) {
    acc[i] = kOverwrite ? w * Load::one(g + i) : __builtin_fmaf(w, Load::one(g + i), acc[i]);
  }
}

template <bool kOverwrite>
VFLOW_AVX2 void axpy_f64_avx2(double* acc, const double* g, double w, int64_t n) {
  const __m256d wv = _mm256_set1_pd(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256d a0;
    __m256d a1;
    if constexpr (kOverwrite) {
      a0 = _mm256_mul_pd(wv, _mm256_loadu_pd(g + i));
      a1 = _mm256_mul_pd(wv, _mm256_loadu_pd(g + i + 4));
    } else {
      a0 = _mm256_fmadd_pd(wv, _mm256_loadu_pd(g + i), _mm256_loadu_pd(acc + i));
      a1 = _mm256_fmadd_pd(wv, _mm256_loadu_pd(g + i + 4), _mm256_loadu_pd(acc + i + 4));
    }
    _mm256_storeu_pd(acc + i, a0);
    _mm256_storeu_pd(acc + i + 4, a1);
  }
  for (; i < n; ++i) {
    acc[i] = kOverwrite ? w * g[i] : __builtin_fma(w, g[i], acc[i]);
  }
}

VFLOW_AVX2 void scale_f32_avx2(float* x, float f, int64_t n) {
  const __m256 fv = _mm256_set1_ps(f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), fv));
  }
  for (; i < n; ++i) {
    x[i] *= f;
  }
}

// Non-finite detection: y * 0 is 0 for finite y and NaN for inf/NaN, and only NaN
// compares unordered with itself.
VFLOW_AVX2 bool scale_check_f32_avx2(float* x, float f, bool write, int64_t n) {
  const __m256 fv = _mm256_set1_ps(f);
  const __m256 zero = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + i), fv);
    if (write) {
      _mm256_storeu_ps(x + i, y);
    }
    const __m256 probe = _mm256_mul_ps(y, zero);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(probe, probe, _CMP_UNORD_Q));
  }
  bool any = _mm256_movemask_ps(bad) != 0;
  for (; i < n; ++i) {
    const float y = x[i] * f;
    if (write) {
      x[i] = y;
    }
    any |= !std::isfinite(y);
  }
  return any;
}

bool cpu_has_avx2() {
  // Also runs during static initialisation, before libgcc's CPU probe may have run.
  __builtin_cpu_init();
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
  return has;
}
#else
bool cpu_has_avx2() {
  return false;
}
#endif

// User-selectable for tests and benchmarks; defaults to the best path available.
std::atomic<bool> g_use_avx2{cpu_has_avx2()};

#ifdef VFLOW_CPU_AVX2
// The AVX2 loader for each stored gradient type of a float32 accumulator.
template <typename G>
struct Avx2Loader;
template <>
struct Avx2Loader<float> {
  using type = LoadF32;
};
template <>
struct Avx2Loader<c10::BFloat16> {
  using type = LoadBF16;
};
template <>
struct Avx2Loader<c10::Half> {
  using type = LoadF16;
};
#endif

// acc (+)= w * g over one segment, on the vector path selected by `avx2`.
template <bool kOverwrite, typename A, typename G>
void axpy(A* acc, const G* g, A w, int64_t n, bool avx2) {
#ifdef VFLOW_CPU_AVX2
  if (avx2) {
    if constexpr (std::is_same_v<A, double>) {
      if constexpr (std::is_same_v<G, double>) {
        return axpy_f64_avx2<kOverwrite>(acc, g, w, n);
      }
      // Narrow gradients into float64 accumulators are rare (accumulate_dtype=float64
      // for float32 parameters): the portable loop serves them.
    } else {
      using Load = typename Avx2Loader<G>::type;
      return axpy_f32_avx2<kOverwrite, Load>(
          acc, reinterpret_cast<const typename Load::T*>(g), w, n);
    }
  }
#else
  (void)avx2;
#endif
  axpy_portable<kOverwrite>(acc, g, w, n);
}

template <bool kOverwrite, typename A>
void axpy_into(A* a, const at::Tensor& grad, A w, int64_t begin, int64_t len, bool avx2);

template <bool kOverwrite>
void axpy_segment(const at::Tensor& acc, const at::Tensor& grad, double weight, int64_t begin,
                  int64_t len) {
  const bool avx2 = g_use_avx2.load(std::memory_order_relaxed);
  if (acc.scalar_type() == at::kDouble) {
    return axpy_into<kOverwrite>(acc.data_ptr<double>() + begin, grad, weight, begin, len, avx2);
  }
  axpy_into<kOverwrite>(acc.data_ptr<float>() + begin, grad, static_cast<float>(weight), begin,
                        len, avx2);
}

// Dispatches on the stored gradient dtype for an accumulator of type A.
template <bool kOverwrite, typename A>
void axpy_into(A* a, const at::Tensor& grad, A w, int64_t begin, int64_t len, bool avx2) {
  switch (grad.scalar_type()) {
    case at::kFloat:
      return axpy<kOverwrite>(a, grad.const_data_ptr<float>() + begin, w, len, avx2);
    case at::kBFloat16:
      return axpy<kOverwrite>(a, grad.const_data_ptr<at::BFloat16>() + begin, w, len, avx2);
    case at::kHalf:
      return axpy<kOverwrite>(a, grad.const_data_ptr<at::Half>() + begin, w, len, avx2);
    case at::kDouble:
      if constexpr (std::is_same_v<A, double>) {
        return axpy<kOverwrite>(a, grad.const_data_ptr<double>() + begin, w, len, avx2);
      }
      [[fallthrough]];
    default:
      TORCH_INTERNAL_ASSERT(false, "unexpected gradient dtype ", grad.scalar_type());
  }
}

} // namespace

void set_cpu_vector_path(const std::string& name) {
  TORCH_CHECK(name == "avx2" || name == "portable",
              "name must be 'avx2' or 'portable', got '", name, "'");
  TORCH_CHECK(name != "avx2" || cpu_has_avx2(),
              "name='avx2' but this CPU (or build) lacks AVX2/FMA/F16C");
  g_use_avx2.store(name == "avx2");
}

std::string cpu_vector_path() {
  return g_use_avx2.load() ? "avx2" : "portable";
}

std::vector<std::string> cpu_vector_paths() {
  if (cpu_has_avx2()) {
    return {"avx2", "portable"};
  }
  return {"portable"};
}

namespace {

// The fused pass over the pairs prepare_multi_accumulate left (Note [Kernel contracts]).
void accumulate_pairs(
    const std::vector<at::Tensor>& accs,
    const std::vector<at::Tensor>& grads,
    double weight,
    bool overwrite) {
  // The list is treated as one long virtual array so threads split the total work
  // evenly however the sizes are distributed (one huge tensor or thousands of tiny
  // ones); `ends[i]` is the exclusive end of tensor i in that array.
  std::vector<int64_t> ends(accs.size());
  int64_t total = 0;
  for (const auto i : c10::irange(accs.size())) {
    total += accs[i].numel();
    ends[i] = total;
  }
  at::parallel_for(0, total, kGrainElems, [&](int64_t begin, int64_t end) {
    auto it = std::upper_bound(ends.begin(), ends.end(), begin);
    for (int64_t pos = begin; pos < end; ++it) {
      const auto i = static_cast<size_t>(it - ends.begin());
      const int64_t start = ends[i] - accs[i].numel();
      const int64_t stop = std::min(end, ends[i]);
      if (overwrite) {
        axpy_segment<true>(accs[i], grads[i], weight, pos - start, stop - pos);
      } else {
        axpy_segment<false>(accs[i], grads[i], weight, pos - start, stop - pos);
      }
      pos = stop;
    }
  });
}

// ---- Operator implementations (Note [One op surface] in ops.h) ----

void multi_accumulate_cpu(
    at::TensorList accs,
    at::TensorList grads,
    double weight,
    bool overwrite) {
  const FusedPairs fused = prepare_multi_accumulate(accs, grads, weight, overwrite);
  if (!fused.accs.empty()) {
    accumulate_pairs(fused.accs, fused.grads, weight, overwrite);
  }
}

void scale_cpu(const at::Tensor& buf, double factor) {
  if (!prepare_scale(buf, factor)) {
    return;
  }
  const bool avx2 = g_use_avx2.load(std::memory_order_relaxed);
  (void)avx2;
  at::parallel_for(0, buf.numel(), kGrainElems, [&](int64_t begin, int64_t end) {
    if (buf.scalar_type() == at::kDouble) {
      return scale_portable(buf.data_ptr<double>() + begin, factor, end - begin);
    }
    float* x = buf.data_ptr<float>() + begin;
#ifdef VFLOW_CPU_AVX2
    if (avx2) {
      return scale_f32_avx2(x, static_cast<float>(factor), end - begin);
    }
#endif
    scale_portable(x, static_cast<float>(factor), end - begin);
  });
}

void scale_check_cpu(const at::Tensor& buf, double factor, const at::Tensor& found_nonfinite) {
  if (!prepare_scale_check(buf, found_nonfinite)) {
    return;
  }
  const bool avx2 = g_use_avx2.load(std::memory_order_relaxed);
  (void)avx2;
  const bool write = factor != 1.0;
  std::atomic<bool> any{false};
  at::parallel_for(0, buf.numel(), kGrainElems, [&](int64_t begin, int64_t end) {
    bool bad;
    if (buf.scalar_type() == at::kDouble) {
      bad = scale_check_portable(buf.data_ptr<double>() + begin, factor, write, end - begin);
    } else {
      float* x = buf.data_ptr<float>() + begin;
      const float f = static_cast<float>(factor);
#ifdef VFLOW_CPU_AVX2
      bad = avx2 ? scale_check_f32_avx2(x, f, write, end - begin)
                 : scale_check_portable(x, f, write, end - begin);
#else
      bad = scale_check_portable(x, f, write, end - begin);
#endif
    }
    if (bad) {
      any.store(true, std::memory_order_relaxed);
    }
  });
  if (any.load()) {
    found_nonfinite.fill_(1.0f);
  }
}

} // namespace

TORCH_LIBRARY_IMPL(vflow, CPU, m) {
  m.impl("multi_accumulate_", &multi_accumulate_cpu);
  m.impl("scale_", &scale_cpu);
  m.impl("scale_check_", &scale_check_cpu);
}

} // namespace vflow
