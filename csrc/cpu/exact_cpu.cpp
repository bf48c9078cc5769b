// CPU backend of the exact accumulation kernels (Note [Exact accumulation] in exact.h).
// An element's integers depend only on its own inputs (the portable, AVX2 and CUDA code
// compute the same ones), so the bits do not depend on how at::parallel_for splits
// the range.
#include "../exact.h"

#include "../ops.h"
#include "cpu_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace vflow {
namespace {

using cpu::kGrainElems;
using cpu::widen;

// See Note [CPU vector paths] in accumulate_cpu.cpp: an AVX2 version of the loop is
// selected at run time (set_cpu_vector_path switches both files' kernels). It computes
// what exact::accumulate_one computes, eight elements at a time: every step is exact
// apart from weight * grad, which neither path contracts, so both give the same
// integers (tested).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VFLOW_EXACT_AVX2 1

// The low 32 bits of the four 64-bit lanes of `a`, then of `b`, as eight 32-bit lanes
// (a lane mask stays a mask).
__attribute__((target("avx2"))) inline __m256i low_halves(__m256i a, __m256i b) {
  const __m256 mixed = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0x88);
  return _mm256_permute4x64_epi64(_mm256_castps_si256(mixed), 0xD8);
}

__attribute__((target("avx2"))) inline __m256d widen_mask_low(__m256i mask) {
  return _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(mask)));
}

__attribute__((target("avx2"))) inline __m256d widen_mask_high(__m256i mask) {
  return _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(mask, 1)));
}

// 2^e for the eight int32 exponents of `e` (biased, as in a double's bit pattern).
__attribute__((target("avx2"))) inline __m256d pow2_low(__m256i e) {
  return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(e)), 52));
}

__attribute__((target("avx2"))) inline __m256d pow2_high(__m256i e) {
  return _mm256_castsi256_pd(
      _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(e, 1)), 52));
}

// Eight elements per iteration: the doubles in two halves of four, everything on
// integers (top bins, limbs, digits) in 32-bit lanes of one register.
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
  const __m256d zero_pd = _mm256_setzero_pd();
  const __m256i digit = _mm256_set1_epi64x((1 << kBinBits) - 1);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi32(-1);
  const __m256i nonfinite = _mm256_set1_epi32(exact::kNonfinite);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i two = _mm256_set1_epi32(2);
  const __m256i exponent_bias = _mm256_set1_epi32(1023 + exact::kLowestExponent);
  // Biased exponent of 2^(181 - 16 t) is (181 + 1023) - 16 t.
  const __m256i scale_base = _mm256_set1_epi32(exact::kLimbs * kBinBits - kBinBits -
                                               exact::kLowestExponent + 1023);
  constexpr int kTrunc = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_loadu_ps(grad + i);
    const __m256d y_lo = _mm256_mul_pd(w, _mm256_cvtps_pd(_mm256_castps256_ps128(g)));
    const __m256d y_hi = _mm256_mul_pd(w, _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1)));
    __m256i t_old = zero;
    __m256i a0 = zero;
    __m256i a1 = zero;
    __m256i a2 = zero;
    if (!kFresh) {
      t_old = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(top + i)));
      a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l0 + i));
      a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l1 + i));
      a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l2 + i));
    }
    const __m256i keep = _mm256_cmpeq_epi32(t_old, nonfinite);
    const __m256d mag_lo = _mm256_and_pd(y_lo, abs_mask);
    const __m256d mag_hi = _mm256_and_pd(y_hi, abs_mask);
    const __m256d fits_lo = _mm256_cmp_pd(mag_lo, limit, _CMP_LT_OQ);
    const __m256d fits_hi = _mm256_cmp_pd(mag_hi, limit, _CMP_LT_OQ);
    const __m256i representable =
        low_halves(_mm256_castpd_si256(fits_lo), _mm256_castpd_si256(fits_hi));
    const __m256i poison = _mm256_andnot_si256(_mm256_or_si256(keep, representable), ones);
    const __m256d m_in_lo = _mm256_and_pd(mag_lo, _mm256_andnot_pd(widen_mask_low(keep), fits_lo));
    const __m256d m_in_hi =
        _mm256_and_pd(mag_hi, _mm256_andnot_pd(widen_mask_high(keep), fits_hi));
    const __m256i biased = low_halves(_mm256_srli_epi64(_mm256_castpd_si256(m_in_lo), 52),
                                      _mm256_srli_epi64(_mm256_castpd_si256(m_in_hi), 52));
    const __m256i msb = _mm256_sub_epi32(biased, exponent_bias);
    const __m256i t = _mm256_srai_epi32(_mm256_max_epi32(msb, zero), 4);
    const __m256i t_base = _mm256_andnot_si256(keep, t_old);
    const __m256i shift = _mm256_max_epi32(_mm256_sub_epi32(t, t_base), zero);
    const __m256i t_new = _mm256_add_epi32(t_base, shift);
    const __m256i scale_exponent = _mm256_sub_epi32(scale_base, _mm256_slli_epi32(t_new, 4));
    // trunc(m) + 2^52 holds trunc(m) < 2^48 in its low mantissa bits, exactly: the
    // digits come out of integer shifts, with a far shorter dependency chain than
    // double -> int32 conversions.
    const __m256i v_lo = _mm256_castpd_si256(_mm256_add_pd(
        _mm256_round_pd(_mm256_mul_pd(m_in_lo, pow2_low(scale_exponent)), kTrunc), magic));
    const __m256i v_hi = _mm256_castpd_si256(_mm256_add_pd(
        _mm256_round_pd(_mm256_mul_pd(m_in_hi, pow2_high(scale_exponent)), kTrunc), magic));
    __m256i d0 = low_halves(_mm256_and_si256(_mm256_srli_epi64(v_lo, 2 * kBinBits), digit),
                            _mm256_and_si256(_mm256_srli_epi64(v_hi, 2 * kBinBits), digit));
    __m256i d1 = low_halves(_mm256_and_si256(_mm256_srli_epi64(v_lo, kBinBits), digit),
                            _mm256_and_si256(_mm256_srli_epi64(v_hi, kBinBits), digit));
    __m256i d2 = low_halves(_mm256_and_si256(v_lo, digit), _mm256_and_si256(v_hi, digit));
    const __m256i negative =
        low_halves(_mm256_castpd_si256(_mm256_cmp_pd(y_lo, zero_pd, _CMP_LT_OQ)),
                   _mm256_castpd_si256(_mm256_cmp_pd(y_hi, zero_pd, _CMP_LT_OQ)));
    d0 = _mm256_sub_epi32(_mm256_xor_si256(d0, negative), negative);
    d1 = _mm256_sub_epi32(_mm256_xor_si256(d1, negative), negative);
    d2 = _mm256_sub_epi32(_mm256_xor_si256(d2, negative), negative);
    const __m256i same = _mm256_cmpeq_epi32(shift, zero);
    const __m256i by_one = _mm256_cmpeq_epi32(shift, one);
    const __m256i by_two = _mm256_cmpeq_epi32(shift, two);
    const __m256i s0 = _mm256_and_si256(same, a0);
    const __m256i s1 = _mm256_or_si256(_mm256_and_si256(same, a1), _mm256_and_si256(by_one, a0));
    const __m256i s2 = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(same, a2), _mm256_and_si256(by_one, a1)),
        _mm256_and_si256(by_two, a0));
    const __m256i r0 =
        _mm256_blendv_epi8(_mm256_andnot_si256(poison, _mm256_add_epi32(s0, d0)), a0, keep);
    const __m256i r1 =
        _mm256_blendv_epi8(_mm256_andnot_si256(poison, _mm256_add_epi32(s1, d1)), a1, keep);
    const __m256i r2 =
        _mm256_blendv_epi8(_mm256_andnot_si256(poison, _mm256_add_epi32(s2, d2)), a2, keep);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l0 + i), r0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l1 + i), r1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l2 + i), r2);
    const __m256i top_new = _mm256_blendv_epi8(t_new, nonfinite, _mm256_or_si256(keep, poison));
    const __m128i top16 =
        _mm_packs_epi32(_mm256_castsi256_si128(top_new), _mm256_extracti128_si256(top_new, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(top + i), _mm_packs_epi16(top16, top16));
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

// ---- Operator implementations (Note [One op surface] in ../ops.h) ----

void exact_accumulate_cpu(
    const at::Tensor& top, const at::Tensor& l0, const at::Tensor& l1, const at::Tensor& l2,
    const at::Tensor& grad_in, double weight, bool fresh) {
  const std::optional<at::Tensor> grad = prepare_exact_accumulate(top, l0, l1, l2, grad_in);
  if (!grad) {
    return;
  }
  switch (grad->scalar_type()) {
    case at::kFloat:
      accumulate_typed<float>(top, l0, l1, l2, *grad, weight, fresh);
      break;
    case at::kBFloat16:
      accumulate_typed<c10::BFloat16>(top, l0, l1, l2, *grad, weight, fresh);
      break;
    case at::kHalf:
      accumulate_typed<c10::Half>(top, l0, l1, l2, *grad, weight, fresh);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "unexpected gradient dtype ", grad->scalar_type());
  }
}

void exact_pack_cpu(
    const at::Tensor& local_top, const at::Tensor& global_top, const at::Tensor& l0,
    const at::Tensor& l1, const at::Tensor& l2, const at::Tensor& wire) {
  if (!prepare_exact_pack(local_top, global_top, l0, l1, l2, wire)) {
    return;
  }
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
  if (!prepare_exact_unpack(global_top, wire, out)) {
    return;
  }
  const auto* global = global_top.const_data_ptr<int8_t>();
  const auto* sums = wire.const_data_ptr<int64_t>();
  auto* values = out.data_ptr<float>();
  at::parallel_for(0, out.numel(), kGrainElems, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      values[i] = exact::unpacked(global[i], sums[i], factor);
    }
  });
}

} // namespace

TORCH_LIBRARY_IMPL(vflow, CPU, m) {
  m.impl("exact_accumulate_", &exact_accumulate_cpu);
  m.impl("exact_pack_", &exact_pack_cpu);
  m.impl("exact_unpack_", &exact_unpack_cpu);
}

} // namespace vflow
