// Exact, order-independent gradient accumulation for deterministic mode.
//
// Note [Exact accumulation]
// Floating-point addition is not associative, so a float32 sum of V gradients depends
// on which worker added which VN in which order. In deterministic mode every VN's
// weighted gradient is instead turned into integers on a grid that all workers agree
// on, and only integers are added: integer addition is exact and associative, so any
// mapping of VNs onto workers and any all-reduce algorithm give the same bits.
//
// Representation (per element, after ReproBLAS's binned sums, with integers):
//   * Absolute bit positions count from 2^-149 (the smallest float32 subnormal) as bit
//     0. Bin j holds bits [16 j, 16 j + 16); bins 0..17 cover the float32 range.
//   * An accumulator is a top bin T (int8) and three int32 limbs L0, L1, L2, the sums
//     of the contributions' digits in bins T, T-1 and T-2 (carry-save: digits are
//     never carried between limbs).
//   * A contribution y = weight * grad (computed in double: one rounding, the same for
//     a VN wherever it runs) is truncated toward zero below bin T-2 and its three
//     16-bit digits are added, with y's sign, to the limbs.
//   * When y's most significant bit lies in a bin above T, the limbs move down by the
//     difference and the lowest ones are dropped. A dropped limb holds exactly the
//     digits that every contribution loses below the new window, so the result equals
//     "truncate each contribution below bin T-2 of the final T, then add exactly" —
//     a function of the set of contributions alone.
// Reduction over workers: the top bins are all-reduced with MAX, each worker moves its
// limbs to the global top bin and packs them into one int64 (L0 2^32 + L1 2^16 + L2,
// exact), the int64s are all-reduced with SUM, and each element is converted back
// once, together with the step's normalisation factor f (1/loss scale, 1/num_items):
// the int64 is rounded to double, scaled exactly by the power of two of bin T-2,
// multiplied by f in double and rounded to float32. Applying f before the conversion
// means only a normalised gradient beyond float32's range counts as an overflow.
//
// What is exact and what is rounded: weight * grad is rounded once to double; each
// contribution loses its bits below bin T-2, i.e. at most 2^-32 of the largest
// contribution's magnitude (between 32 and 48 bits are kept below the top bin); the
// sum of the truncated contributions is exact; the conversion back rounds to double
// (sums above 2^53 units), after the multiplication by f, and to float32.
//
// Range and overflow: |limb| <= n * (2^16 - 1) for n contributions, and the packed
// sum of all workers is below V * 2^48, so with at most kMaxTerms = 32767 VNs no
// integer can overflow (the Executor rejects larger V in deterministic mode). A
// contribution that is inf, NaN or at least 2^128 in magnitude (beyond float32) marks
// its element with the top bin kNonfinite, which survives the MAX reduction; such
// elements, and sums whose magnitude rounds beyond float32's range, come out as NaN
// or inf, and the Executor then skips the step or raises (never a silent wrong sum).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__CUDACC__)
#define VFLOW_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define VFLOW_HOST_DEVICE inline
#endif

namespace vflow {
namespace exact {

constexpr int kBinBits = 16;  // bin_of divides by a shift
constexpr int kLimbs = 3;
// Bit 0 of the absolute positions is 2^kLowestExponent.
constexpr int kLowestExponent = -149;
// Top bin marking an element that received an inf, NaN or out-of-range contribution.
constexpr int8_t kNonfinite = 127;
// Contributions of at least 2^kOverflowExponent cannot be represented as float32.
constexpr int kOverflowExponent = 128;
constexpr int64_t kMaxTerms = 32767;

VFLOW_HOST_DEVICE uint64_t bits_of(double y) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(y));
#else
  uint64_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  return bits;
#endif
}

// 2^k as a double, for -1022 <= k <= 1023 (built from its bits: exact and cheap).
VFLOW_HOST_DEVICE double pow2(int k) {
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

// Bin of the most significant bit of a finite, non-zero y with |y| < 2^128. Values
// below 2^-149 land in bin 0 (their digits there are zero or a few low bits).
VFLOW_HOST_DEVICE int bin_of(double y) {
  const int biased = static_cast<int>((bits_of(y) >> 52) & 0x7FF);
  const int msb = biased - 1023 - kLowestExponent;  // subnormal doubles: very negative
  return msb < 0 ? 0 : msb >> 4;  // msb / kBinBits
}

// Adds y to the accumulator (top, l0, l1, l2). With `fresh` the accumulator is taken
// as empty (top 0, limbs 0) without reading it, which spares a zeroing pass for the
// first contribution of a step. See Note [Exact accumulation]. Written without
// data-dependent branches (gradient signs are random: mispredicted branches would cost
// more than the arithmetic) and with only double -> int32 conversions, which truncate
// and which every vector ISA has: every digit is a non-negative integer below 2^16
// computed exactly in double (the scaled value is an integer below 2^48 plus a
// fraction, and every scaling is a power of two).
VFLOW_HOST_DEVICE void accumulate_one(
    int8_t& top, int32_t& l0, int32_t& l1, int32_t& l2, double y, bool fresh) {
  const int t_old = fresh ? 0 : top;
  const int32_t a0 = fresh ? 0 : l0;
  const int32_t a1 = fresh ? 0 : l1;
  const int32_t a2 = fresh ? 0 : l2;
  const bool keep = t_old == kNonfinite;  // a non-finite element stays so
  const double magnitude = fabs(y);
  // NaN fails the comparison too.
  const bool representable = magnitude < pow2(kOverflowExponent);
  const bool poison = !keep && !representable;
  const double m_in = representable && !keep ? magnitude : 0.0;
  const int t_base = keep ? 0 : t_old;
  const int t = bin_of(m_in);
  const int shift = t > t_base ? t - t_base : 0;
  const int t_new = t_base + shift;
  // |y| < 2^(16 t_new + 16 - 149), so the scaled value is below 2^48.
  const double m = m_in * pow2(kLimbs * kBinBits - kBinBits - kLowestExponent - kBinBits * t_new);
  const auto d0 = static_cast<int32_t>(m * pow2(-2 * kBinBits));
  const double rest = m - static_cast<double>(d0) * pow2(2 * kBinBits);
  const auto d1 = static_cast<int32_t>(rest * pow2(-kBinBits));
  const auto d2 = static_cast<int32_t>(rest - static_cast<double>(d1) * pow2(kBinBits));
  const int32_t sign = y < 0 ? -1 : 1;
  const int32_t s0 = shift == 0 ? a0 : 0;
  const int32_t s1 = shift == 0 ? a1 : (shift == 1 ? a0 : 0);
  const int32_t s2 = shift == 0 ? a2 : (shift == 1 ? a1 : (shift == 2 ? a0 : 0));
  top = keep || poison ? kNonfinite : static_cast<int8_t>(t_new);
  l0 = keep ? a0 : (poison ? 0 : s0 + sign * d0);
  l1 = keep ? a1 : (poison ? 0 : s1 + sign * d1);
  l2 = keep ? a2 : (poison ? 0 : s2 + sign * d2);
}

// The accumulator moved to top bin `global` (>= its own `local`) and packed into one
// integer in units of bin global-2's lowest bit. 0 for non-finite elements.
VFLOW_HOST_DEVICE int64_t packed(int8_t local, int8_t global, int32_t l0, int32_t l1,
                                 int32_t l2) {
  if (global == kNonfinite) {
    return 0;
  }
  const int shift = global - local;
  const auto w0 = static_cast<int64_t>(l0);
  const auto w1 = static_cast<int64_t>(l1);
  const auto w2 = static_cast<int64_t>(l2);
  if (shift == 0) {
    return w0 * 4294967296LL + w1 * 65536LL + w2;
  }
  if (shift == 1) {
    return w0 * 65536LL + w1;
  }
  return shift == 2 ? w0 : 0;
}

// factor times the value of a packed sum with top bin `global`, as float32: see
// Note [Exact accumulation] for the roundings.
VFLOW_HOST_DEVICE float unpacked(int8_t global, int64_t sum, double factor) {
  if (global == kNonfinite) {
    return NAN;
  }
  const double value =
      static_cast<double>(sum) * pow2(kBinBits * (global - (kLimbs - 1)) + kLowestExponent);
  return static_cast<float>(value * factor);
}

} // namespace exact

// ---- Operators over slices (same numel each): torch.ops.vflow.exact_*, called
// through the dispatcher (Note [One op surface] in ops.h). ----

// For every element: adds weight * grad[i] to the accumulator (top[i], limbs[k][i]).
// grad: float32, bfloat16 or float16; top int8; l0, l1, l2 int32.
void exact_accumulate_(
    const at::Tensor& top,
    const at::Tensor& l0,
    const at::Tensor& l1,
    const at::Tensor& l2,
    const at::Tensor& grad,
    double weight,
    bool fresh);

// wire[i] = packed(local_top[i], global_top[i], limbs) (int64).
void exact_pack_(
    const at::Tensor& local_top,
    const at::Tensor& global_top,
    const at::Tensor& l0,
    const at::Tensor& l1,
    const at::Tensor& l2,
    const at::Tensor& wire);

// out[i] = unpacked(global_top[i], wire[i], factor) (float32).
void exact_unpack_(const at::Tensor& global_top, const at::Tensor& wire, const at::Tensor& out,
                   double factor);

// ---- Shared first step of every backend's implementation: argument checks. After
// them all tensors are contiguous, on one device, with equal numel. ----

// The gradient as the kernel reads it (contiguous), or nullopt when there are no
// elements.
std::optional<at::Tensor> prepare_exact_accumulate(
    const at::Tensor& top, const at::Tensor& l0, const at::Tensor& l1, const at::Tensor& l2,
    const at::Tensor& grad);
// False when there are no elements.
bool prepare_exact_pack(
    const at::Tensor& local_top, const at::Tensor& global_top, const at::Tensor& l0,
    const at::Tensor& l1, const at::Tensor& l2, const at::Tensor& wire);
bool prepare_exact_unpack(const at::Tensor& global_top, const at::Tensor& wire,
                          const at::Tensor& out);

} // namespace vflow
