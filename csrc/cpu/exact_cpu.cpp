// CPU backend of the exact accumulation kernels (Note [Exact accumulation] in exact.h).
// Every element is computed by the same scalar function as on CUDA, so the bits do not
// depend on how at::parallel_for splits the range.
#include "../exact.h"

#include "../ops.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace vflow {
namespace {

// Below this many elements the pass runs on the calling thread.
constexpr int64_t kGrainElems = 32768;

inline float widen(float v) {
  return v;
}
inline float widen(c10::BFloat16 v) {
  return static_cast<float>(v);
}
inline float widen(c10::Half v) {
  return static_cast<float>(v);
}

// See Note [CPU vector paths] in accumulate_cpu.cpp: an AVX2 version of the loop is
// selected at run time (set_cpu_vector_path switches both files' kernels). It computes
// what exact::accumulate_one computes, four elements at a time: every step is exact
// apart from weight * grad, which neither path contracts, so both give the same
// integers (tested).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VFLOW_EXACT_AVX2 1

// The low 32 bits of each 64-bit lane (a lane mask stays a mask).
__attribute__((target("avx2"))) inline __m128i low_halves(__m256i x) {
  return _mm256_castsi256_si128(
      _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
}

template <bool kFresh>
__attribute__((target("avx2"))) void accumulate_range_avx2(
    int8_t* __restrict__ top, int32_t* __restrict__ l0, int32_t* __restrict__ l1,
    int32_t* __restrict__ l2, const float* __restrict__ grad, double weight, int64_t begin,
    int64_t end) {
  using exact::kBinBits;
  const __m256d w = _mm256_set1_pd(weight);
  const __m256d abs_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFLL));
  const __m256d limit = _mm256_set1_pd(exact::pow2(exact::kOverflowExponent));
  const __m256d magic = _mm256_set1_pd(exact::pow2(52));
  const __m256i digit = _mm256_set1_epi64x((1 << kBinBits) - 1);
  const __m128i zero = _mm_setzero_si128();
  const __m128i nonfinite = _mm_set1_epi32(exact::kNonfinite);
  const __m128i one = _mm_set1_epi32(1);
  const __m128i two = _mm_set1_epi32(2);
  const __m128i exponent_bias = _mm_set1_epi32(1023 + exact::kLowestExponent);
  // Biased exponent of 2^(181 - 16 t) is (181 + 1023) - 16 t.
  const __m128i scale_base = _mm_set1_epi32(exact::kLimbs * kBinBits - kBinBits -
                                            exact::kLowestExponent + 1023);
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    const __m256d y = _mm256_mul_pd(w, _mm256_cvtps_pd(_mm_loadu_ps(grad + i)));
    __m128i t_old = zero;
    __m128i a0 = zero;
    __m128i a1 = zero;
    __m128i a2 = zero;
    if (!kFresh) {
      int32_t packed_top;
      std::memcpy(&packed_top, top + i, sizeof(packed_top));
      t_old = _mm_cvtepi8_epi32(_mm_cvtsi32_si128(packed_top));
      a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l0 + i));
      a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l1 + i));
      a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l2 + i));
    }
    const __m128i keep = _mm_cmpeq_epi32(t_old, nonfinite);
    const __m256d magnitude = _mm256_and_pd(y, abs_mask);
    const __m256d representable = _mm256_cmp_pd(magnitude, limit, _CMP_LT_OQ);
    const __m128i representable32 = low_halves(_mm256_castpd_si256(representable));
    const __m128i poison = _mm_andnot_si128(_mm_or_si128(keep, representable32),
                                            _mm_set1_epi32(-1));
    const __m256d use = _mm256_andnot_pd(_mm256_castsi256_pd(_mm256_cvtepi32_epi64(keep)),
                                         representable);
    const __m256d m_in = _mm256_and_pd(magnitude, use);
    const __m128i biased = low_halves(_mm256_srli_epi64(_mm256_castpd_si256(m_in), 52));
    const __m128i msb = _mm_sub_epi32(biased, exponent_bias);
    const __m128i t = _mm_srai_epi32(_mm_max_epi32(msb, zero), 4);
    const __m128i t_base = _mm_andnot_si128(keep, t_old);
    const __m128i shift = _mm_max_epi32(_mm_sub_epi32(t, t_base), zero);
    const __m128i t_new = _mm_add_epi32(t_base, shift);
    const __m128i scale_exponent = _mm_sub_epi32(scale_base, _mm_slli_epi32(t_new, 4));
    const __m256d scale =
        _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_cvtepi32_epi64(scale_exponent), 52));
    const __m256d m = _mm256_mul_pd(m_in, scale);
    // trunc(m) + 2^52 holds trunc(m) < 2^48 in its low mantissa bits, exactly: the
    // digits come out of integer shifts, with a far shorter dependency chain than
    // three double -> int32 conversions.
    const __m256i v = _mm256_castpd_si256(_mm256_add_pd(
        _mm256_round_pd(m, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC), magic));
    __m128i d0 = low_halves(_mm256_and_si256(_mm256_srli_epi64(v, 2 * kBinBits), digit));
    __m128i d1 = low_halves(_mm256_and_si256(_mm256_srli_epi64(v, kBinBits), digit));
    __m128i d2 = low_halves(_mm256_and_si256(v, digit));
    const __m128i negative = low_halves(
        _mm256_castpd_si256(_mm256_cmp_pd(y, _mm256_setzero_pd(), _CMP_LT_OQ)));
    d0 = _mm_sub_epi32(_mm_xor_si128(d0, negative), negative);
    d1 = _mm_sub_epi32(_mm_xor_si128(d1, negative), negative);
    d2 = _mm_sub_epi32(_mm_xor_si128(d2, negative), negative);
    const __m128i same = _mm_cmpeq_epi32(shift, zero);
    const __m128i by_one = _mm_cmpeq_epi32(shift, one);
    const __m128i by_two = _mm_cmpeq_epi32(shift, two);
    const __m128i s0 = _mm_and_si128(same, a0);
    const __m128i s1 = _mm_or_si128(_mm_and_si128(same, a1), _mm_and_si128(by_one, a0));
    const __m128i s2 = _mm_or_si128(
        _mm_or_si128(_mm_and_si128(same, a2), _mm_and_si128(by_one, a1)),
        _mm_and_si128(by_two, a0));
    const __m128i r0 = _mm_blendv_epi8(_mm_andnot_si128(poison, _mm_add_epi32(s0, d0)), a0, keep);
    const __m128i r1 = _mm_blendv_epi8(_mm_andnot_si128(poison, _mm_add_epi32(s1, d1)), a1, keep);
    const __m128i r2 = _mm_blendv_epi8(_mm_andnot_si128(poison, _mm_add_epi32(s2, d2)), a2, keep);
    const __m128i top_new = _mm_blendv_epi8(t_new, nonfinite, _mm_or_si128(keep, poison));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(l0 + i), r0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(l1 + i), r1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(l2 + i), r2);
    const int32_t top_bytes = _mm_cvtsi128_si32(_mm_packs_epi16(_mm_packs_epi32(top_new, zero), zero));
    std::memcpy(top + i, &top_bytes, sizeof(top_bytes));
  }
  for (; i < end; ++i) {
    const double y = weight * static_cast<double>(grad[i]);
    exact::accumulate_one(top[i], l0[i], l1[i], l2[i], y, kFresh);
  }
}
#endif

template <bool kFresh, typename G>
void accumulate_range(int8_t* __restrict__ top, int32_t* __restrict__ l0, int32_t* __restrict__ l1,
                      int32_t* __restrict__ l2, const G* __restrict__ grad, double weight,
                      int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const double y = weight * static_cast<double>(widen(grad[i]));
    exact::accumulate_one(top[i], l0[i], l1[i], l2[i], y, kFresh);
  }
}

template <typename G>
void accumulate_typed(const at::Tensor& top, const at::Tensor& l0, const at::Tensor& l1,
                      const at::Tensor& l2, const at::Tensor& grad, double weight, bool fresh) {
  auto* t = top.data_ptr<int8_t>();
  auto* a0 = l0.data_ptr<int32_t>();
  auto* a1 = l1.data_ptr<int32_t>();
  auto* a2 = l2.data_ptr<int32_t>();
  const auto* g = grad.const_data_ptr<G>();
  const bool avx2 = cpu_vector_path() == "avx2";
  at::parallel_for(0, top.numel(), kGrainElems, [&](int64_t begin, int64_t end) {
#ifdef VFLOW_EXACT_AVX2
    if constexpr (std::is_same_v<G, float>) {
      if (avx2) {
        if (fresh) {
          accumulate_range_avx2<true>(t, a0, a1, a2, g, weight, begin, end);
        } else {
          accumulate_range_avx2<false>(t, a0, a1, a2, g, weight, begin, end);
        }
        return;
      }
    }
#endif
    if (fresh) {
      accumulate_range<true>(t, a0, a1, a2, g, weight, begin, end);
    } else {
      accumulate_range<false>(t, a0, a1, a2, g, weight, begin, end);
    }
  });
}

} // namespace

void exact_accumulate_cpu(
    const at::Tensor& top, const at::Tensor& l0, const at::Tensor& l1, const at::Tensor& l2,
    const at::Tensor& grad, double weight, bool fresh) {
  switch (grad.scalar_type()) {
    case at::kFloat:
      accumulate_typed<float>(top, l0, l1, l2, grad, weight, fresh);
      break;
    case at::kBFloat16:
      accumulate_typed<c10::BFloat16>(top, l0, l1, l2, grad, weight, fresh);
      break;
    case at::kHalf:
      accumulate_typed<c10::Half>(top, l0, l1, l2, grad, weight, fresh);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "unexpected gradient dtype ", grad.scalar_type());
  }
}

void exact_pack_cpu(
    const at::Tensor& local_top, const at::Tensor& global_top, const at::Tensor& l0,
    const at::Tensor& l1, const at::Tensor& l2, const at::Tensor& wire) {
  const auto* local = local_top.const_data_ptr<int8_t>();
  const auto* global = global_top.const_data_ptr<int8_t>();
  const auto* a0 = l0.const_data_ptr<int32_t>();
  const auto* a1 = l1.const_data_ptr<int32_t>();
  const auto* a2 = l2.const_data_ptr<int32_t>();
  auto* out = wire.data_ptr<int64_t>();
  at::parallel_for(0, wire.numel(), kGrainElems, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[i] = exact::packed(local[i], global[i], a0[i], a1[i], a2[i]);
    }
  });
}

void exact_unpack_cpu(const at::Tensor& global_top, const at::Tensor& wire, const at::Tensor& out,
                      double factor) {
  const auto* global = global_top.const_data_ptr<int8_t>();
  const auto* sums = wire.const_data_ptr<int64_t>();
  auto* values = out.data_ptr<float>();
  at::parallel_for(0, out.numel(), kGrainElems, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      values[i] = exact::unpacked(global[i], sums[i], factor);
    }
  });
}

} // namespace vflow
