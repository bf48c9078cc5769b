// Helpers shared by the CPU kernel files (accumulate_cpu.cpp, exact_cpu.cpp).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace vflow {
namespace cpu {

// Work below this many elements runs on the calling thread: waking the pool costs
// more than the pass itself.
constexpr int64_t kGrainElems = 32768;

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// Widens one stored gradient value to the accumulator type (exactly).
inline float widen(float v) {
  return v;
}
inline double widen(double v) {
  return v;
}
inline float widen(c10::BFloat16 v) {
  return bf16_bits_to_float(v.x);
}
inline float widen(c10::Half v) {
  return static_cast<float>(v);
}

} // namespace cpu
} // namespace vflow
