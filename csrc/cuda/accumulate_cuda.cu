// CUDA backend of vflow's fused accumulation operators (schemas in ../torch_ops.cpp,
// Note [One op surface] in ../ops.h).
//
// Note [Multi-tensor launch metadata]
// A training step accumulates into one buffer per parameter: hundreds of tensors
// whose sizes range from a single element (a scalar gain) to tens of millions
// (an embedding). One launch per tensor would cost a few microseconds of launch
// latency each and leave the GPU nearly idle on the small ones, so
// `multi_accumulate_cuda` packs many tensors into each launch.
//
// Each tensor is cut into chunks of `kChunkSize` elements and every chunk is one
// thread block; a huge tensor therefore still spreads over many blocks and SMs,
// and a tiny one costs a single block. The launch describes its work entirely
// in one by-value kernel argument, `MultiTensorMeta`:
//   * per tensor slot: accumulator pointer, gradient pointer, numel;
//   * per block: which slot it works on and which chunk of that tensor.
// Kernel arguments live in the constant bank, so every block reads its
// descriptor without any device allocation, host-to-device copy or
// synchronisation, and the launch stays CUDA-graph capturable. The price is the
// classic 4 KB kernel-parameter limit (the larger limit of CUDA >= 12.1 needs
// Volta+ and a recent driver, which we do not want to require), which bounds a
// launch to `kMaxTensorsPerLaunch` tensors and `kMaxBlocksPerLaunch` chunks; the
// host loop flushes a launch whenever either table fills up. A tensor whose
// chunks straddle a flush is carried over into slot 0 of the next launch, so
// the tables never hold a tensor that no block refers to.
//
// Gradient dtypes may differ between the pairs of one call (e.g. bf16 gradients
// of a mixed-precision model next to fp32 ones). Rather than branch on a dtype
// tag per element, the host groups the pairs by (accumulator, gradient) dtype
// and launches one kernel instantiation per group: at most four groups, each
// kernel specialised and vectorised for exactly its pair of types.
//
// Note [Vectorised access]
// Both kernels move 16 bytes of the narrower operand per load (4 x fp32, 8 x
// bf16/fp16 or 2 x fp64); the fp32 accumulator of a half-precision gradient is
// then read and written as two 16-byte packs. The multi-tensor kernel takes the
// vector path only when both base pointers of a tensor are 16-byte aligned
// (chunk starts are multiples of kChunkSize elements and so keep the base
// alignment); otherwise that tensor uses the scalar loop, which is still
// coalesced. Tensors allocated by the caching allocator are always aligned;
// views into a flat buffer are aligned when their offsets are multiples of 16
// bytes. The single-buffer scale kernels peel a scalar head up to the first
// 16-byte boundary instead, since there is only one pointer to align.

#include "../ops.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>

namespace vflow {
namespace {

constexpr int kVectorBytes = 16;

// 64K elements keeps per-block work large enough to amortise the descriptor
// lookup, yet splits a 38M-element tensor into ~580 blocks.
constexpr int64_t kChunkSize = 65536;
constexpr int kMultiThreads = 512;
// Independent 16-byte packs each thread has in flight per loop iteration:
// memory-level parallelism for a purely bandwidth-bound kernel.
constexpr int kUnroll = 4;

// 48 x 24 B of tensor slots + 448 x 5 B of chunk table = 3392 B of arguments.
// 448 blocks is more than one wave on a 132-SM H100/H200 at two resident
// blocks per SM, so even a single huge tensor needs few launches.
constexpr int kMaxTensorsPerLaunch = 48;
constexpr int kMaxBlocksPerLaunch = 448;

constexpr int kScaleThreads = 512;

// See Note [Multi-tensor launch metadata]. Pointers are untyped so that all
// kernel instantiations share one layout and one host-side packing routine.
struct MultiTensorMeta {
  void* acc[kMaxTensorsPerLaunch];
  const void* grad[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int32_t block_to_chunk[kMaxBlocksPerLaunch];
  uint8_t block_to_tensor[kMaxBlocksPerLaunch];
};

// The kernel also takes the weight (at most a double) by value.
static_assert(
    sizeof(MultiTensorMeta) + sizeof(double) <= 4096,
    "multi-tensor kernel arguments must fit the 4 KB kernel-parameter limit");
static_assert(
    kMaxTensorsPerLaunch <= std::numeric_limits<uint8_t>::max() + 1,
    "block_to_tensor stores slot indices in uint8_t");
static_assert(
    kChunkSize % (kVectorBytes / sizeof(c10::Half)) == 0,
    "chunk starts must keep the base pointer's 16-byte alignment for every dtype");
static_assert(
    kChunkSize <= std::numeric_limits<int>::max(),
    "in-chunk indices are 32-bit");

// A pack of N elements moved as one (or, for 32-byte packs, two) 16-byte
// memory transactions. The alignas is what lets the compiler emit the vector
// instructions; callers guarantee the address really is 16-byte aligned.
template <typename T, int N>
struct alignas(kVectorBytes) Pack {
  static_assert((sizeof(T) * N) % kVectorBytes == 0, "pack must be whole 16-byte vectors");
  T val[N];
};

__device__ __forceinline__ bool is_aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0;
}

// acc[i] += weight * grad[i] (or acc[i] = weight * grad[i] when `overwrite`, a
// block-uniform flag) over one chunk of one tensor per block.
// Math is done in acc_t: gradients are widened first, so a bf16 gradient is
// accumulated with fp32 rounding, never bf16 rounding.
//
// At least two resident blocks per SM (<= 64 registers per thread) keep enough
// warps in flight to hide memory latency; without the bound the bf16 variant
// used 90 registers, i.e. a single 512-thread block per SM.
template <typename acc_t, typename grad_t>
__global__ void __launch_bounds__(kMultiThreads, 2)
    multi_accumulate_kernel(MultiTensorMeta meta, acc_t weight, bool overwrite) {
  const int slot = meta.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  // Only the last chunk of a tensor is short; n is in (0, kChunkSize].
  const int64_t remaining = meta.numel[slot] - start;
  const int n = static_cast<int>(remaining < kChunkSize ? remaining : kChunkSize);
  acc_t* __restrict__ acc = static_cast<acc_t*>(meta.acc[slot]) + start;
  const grad_t* __restrict__ grad = static_cast<const grad_t*>(meta.grad[slot]) + start;

  int done = 0;
  // Uniform across the block (it depends only on the tensor), so no divergence.
  if (is_aligned16(acc) && is_aligned16(grad)) {
    constexpr int kVec = kVectorBytes / sizeof(grad_t);
    using AccPack = Pack<acc_t, kVec>;
    using GradPack = Pack<grad_t, kVec>;
    AccPack* __restrict__ acc_packs = reinterpret_cast<AccPack*>(acc);
    const GradPack* __restrict__ grad_packs = reinterpret_cast<const GradPack*>(grad);
    // A half-precision gradient's fp32 accumulator pack is 32 bytes; halving
    // the unroll keeps the bytes in flight per thread (and registers) similar.
    constexpr int kPackUnroll = sizeof(AccPack) > kVectorBytes ? kUnroll / 2 : kUnroll;
    const int n_packs = n / kVec;
    for (int base = threadIdx.x; base < n_packs; base += kPackUnroll * kMultiThreads) {
      AccPack a[kPackUnroll];
      GradPack g[kPackUnroll];
      // All loads are issued before any arithmetic so that 2 x kPackUnroll
      // transactions per thread are outstanding at once.
#pragma unroll
      for (int u = 0; u < kPackUnroll; ++u) {
        const int i = base + u * kMultiThreads;
        if (i < n_packs) {
          // In overwrite mode the accumulator is write-only: one stream less.
          if (!overwrite) {
            a[u] = acc_packs[i];
          }
          g[u] = grad_packs[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kPackUnroll; ++u) {
        const int i = base + u * kMultiThreads;
        if (i < n_packs) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const acc_t scaled = weight * static_cast<acc_t>(g[u].val[j]);
            a[u].val[j] = overwrite ? scaled : a[u].val[j] + scaled;
          }
          acc_packs[i] = a[u];
        }
      }
    }
    done = n_packs * kVec;
  }
  // Tail of fewer than kVec elements, or the whole chunk when misaligned.
  for (int i = done + static_cast<int>(threadIdx.x); i < n; i += kMultiThreads) {
    const acc_t scaled = weight * static_cast<acc_t>(grad[i]);
    acc[i] = overwrite ? scaled : acc[i] + scaled;
  }
}

// One element of the scale kernels: scales it if kScale, and records in `bad`
// whether the (possibly scaled) value is inf or NaN if kCheck.
template <typename T, bool kScale, bool kCheck>
__device__ __forceinline__ T scale_one(T v, T factor, bool& bad) {
  if constexpr (kScale) {
    v = v * factor;
  }
  if constexpr (kCheck) {
    bad |= !isfinite(v);
  }
  return v;
}

// Scalar head/tail element in memory. The store is compiled in only when
// scaling: a check-only pass (factor == 1) must never write the buffer.
template <typename T, bool kScale, bool kCheck>
__device__ __forceinline__ void scale_element(T* p, T factor, bool& bad) {
  const T v = scale_one<T, kScale, kCheck>(*p, factor, bad);
  if constexpr (kScale) {
    *p = v;
  }
}

// buf[0:n] *= factor (if kScale) and, in the same pass, flag non-finite
// results (if kCheck). Grid-stride, so any grid size covers any n.
// Layout of the work: a scalar head up to the first 16-byte boundary (fewer
// than kVec elements), a vector body, and a scalar tail (fewer than kVec).
template <typename T, bool kScale, bool kCheck>
__global__ void __launch_bounds__(kScaleThreads)
    scale_kernel(T* __restrict__ buf, int64_t n, T factor, float* __restrict__ found_nonfinite) {
  static_assert(kScale || kCheck, "nothing to do");
  constexpr int kVec = kVectorBytes / sizeof(T);
  using VecPack = Pack<T, kVec>;

  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kScaleThreads + threadIdx.x;
  const int64_t n_threads = static_cast<int64_t>(gridDim.x) * kScaleThreads;
  bool bad = false;

  // buf is at least sizeof(T)-aligned (asserted on the host), so the distance
  // to the next 16-byte boundary is a whole number of elements.
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(buf) % kVectorBytes);
  const int64_t to_boundary =
      ((kVectorBytes - misalign) % kVectorBytes) / static_cast<int64_t>(sizeof(T));
  const int64_t head = to_boundary < n ? to_boundary : n;
  if (tid < head) {
    scale_element<T, kScale, kCheck>(buf + tid, factor, bad);
  }

  VecPack* __restrict__ packs = reinterpret_cast<VecPack*>(buf + head);
  const int64_t n_packs = (n - head) / kVec;
  for (int64_t base = tid; base < n_packs; base += kUnroll * n_threads) {
    VecPack p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * n_threads;
      if (i < n_packs) {
        p[u] = packs[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * n_threads;
      if (i < n_packs) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          p[u].val[j] = scale_one<T, kScale, kCheck>(p[u].val[j], factor, bad);
        }
        if constexpr (kScale) {
          packs[i] = p[u];
        }
      }
    }
  }

  const int64_t tail_start = head + n_packs * kVec;
  if (tid < n - tail_start) {
    scale_element<T, kScale, kCheck>(buf + tail_start + tid, factor, bad);
  }

  if constexpr (kCheck) {
    // One store per block instead of one per offending element; blocks race
    // only to write the same value. Every thread reaches this barrier: there
    // are no early returns above.
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
      *found_nonfinite = 1.0f;
    }
  }
}

// Enough resident blocks to fill the device once; the grid-stride loop covers
// the rest. Bounded below by 1 and above by the work actually available.
int64_t scale_grid_size(int64_t n, int64_t elems_per_pack) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t resident =
      static_cast<int64_t>(prop->multiProcessorCount) *
      std::max(1, prop->maxThreadsPerMultiProcessor / kScaleThreads);
  const int64_t per_block = static_cast<int64_t>(kScaleThreads) * kUnroll * elems_per_pack;
  const int64_t needed = (n + per_block - 1) / per_block;
  return std::max<int64_t>(1, std::min(resident, needed));
}

template <typename T, bool kScale, bool kCheck>
void launch_scale(const at::Tensor& buf, T factor, float* found_nonfinite) {
  T* data = buf.data_ptr<T>();
  TORCH_INTERNAL_ASSERT(
      reinterpret_cast<uintptr_t>(data) % sizeof(T) == 0,
      "vflow: scale buffer is not element-aligned");
  const int64_t n = buf.numel();
  const int64_t grid = scale_grid_size(n, kVectorBytes / sizeof(T));
  scale_kernel<T, kScale, kCheck>
      <<<static_cast<unsigned int>(grid), kScaleThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          data, n, factor, found_nonfinite);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launches the multi-tensor kernel for the pairs `indices` of (accs, grads),
// all of which have accumulator dtype acc_t and gradient dtype grad_t.
// See Note [Multi-tensor launch metadata] for the packing.
template <typename acc_t, typename grad_t>
void launch_multi_accumulate(
    const std::vector<at::Tensor>& accs,
    const std::vector<at::Tensor>& grads,
    const std::vector<size_t>& indices,
    acc_t weight,
    bool overwrite) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  MultiTensorMeta meta{};
  int n_tensors = 0;
  int n_blocks = 0;

  const auto flush = [&]() {
    TORCH_INTERNAL_ASSERT(n_blocks > 0 && n_blocks <= kMaxBlocksPerLaunch);
    multi_accumulate_kernel<acc_t, grad_t>
        <<<static_cast<unsigned int>(n_blocks), kMultiThreads, 0, stream>>>(
            meta, weight, overwrite);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    n_blocks = 0;
  };

  for (const size_t k : indices) {
    const at::Tensor& acc = accs[k];
    const at::Tensor& grad = grads[k];
    const int64_t numel = acc.numel();
    const int64_t n_chunks = (numel + kChunkSize - 1) / kChunkSize;
    TORCH_INTERNAL_ASSERT(
        n_chunks <= std::numeric_limits<int32_t>::max(),
        "vflow: tensor too large for the chunk table");

    int slot = n_tensors++;
    meta.acc[slot] = acc.data_ptr();
    meta.grad[slot] = grad.data_ptr();
    meta.numel[slot] = numel;

    for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
      meta.block_to_tensor[n_blocks] = static_cast<uint8_t>(slot);
      meta.block_to_chunk[n_blocks] = static_cast<int32_t>(chunk);
      ++n_blocks;

      const bool last_chunk = chunk == n_chunks - 1;
      const bool blocks_full = n_blocks == kMaxBlocksPerLaunch;
      // A full tensor table only forces a flush once its last tensor is fully
      // scheduled; until then more chunks of that tensor can still be added.
      const bool tensors_full = n_tensors == kMaxTensorsPerLaunch && last_chunk;
      if (blocks_full || tensors_full) {
        flush();
        if (last_chunk) {
          n_tensors = 0;
        } else {
          // The rest of this tensor continues in the next launch, as slot 0.
          meta.acc[0] = meta.acc[slot];
          meta.grad[0] = meta.grad[slot];
          meta.numel[0] = meta.numel[slot];
          slot = 0;
          n_tensors = 1;
        }
      }
    }
  }
  if (n_blocks > 0) {
    flush();
  }
}

// Contract: Note [Kernel contracts] in ops.h. Pairs may mix gradient dtypes
// (and accumulator dtypes); each (acc, grad) dtype combination gets its own
// launches, see Note [Multi-tensor launch metadata]. Accumulators must also be
// pairwise distinct, since pairs of one launch run concurrently. Enqueued on
// the current stream of the tensors' device; never synchronises.
void accumulate_pairs(
    const std::vector<at::Tensor>& accs,
    const std::vector<at::Tensor>& grads,
    double weight,
    bool overwrite) {
  TORCH_INTERNAL_ASSERT(accs.size() == grads.size());
  if (accs.empty()) {
    return;
  }
  const c10::Device device = accs[0].device();
  TORCH_INTERNAL_ASSERT(device.is_cuda());
  const c10::cuda::CUDAGuard guard(device);

  // Group the pairs by dtype combination, keeping the caller's order within
  // a group (the order does not affect results: every acc is updated once).
  enum Group { kF32F32 = 0, kF32BF16, kF32F16, kF64F64, kF64F32, kF64BF16, kF64F16, kNumGroups };
  std::array<std::vector<size_t>, kNumGroups> groups;
  for (size_t k = 0; k < accs.size(); ++k) {
    const at::Tensor& acc = accs[k];
    const at::Tensor& grad = grads[k];
    // The kernel indexes raw pointers with flat offsets and the chunk table
    // with numel, so it depends on all of these.
    TORCH_INTERNAL_ASSERT(acc.device() == device && grad.device() == device);
    TORCH_INTERNAL_ASSERT(acc.is_contiguous() && grad.is_contiguous());
    TORCH_INTERNAL_ASSERT(acc.numel() == grad.numel() && acc.numel() > 0);
    const at::ScalarType acc_type = acc.scalar_type();
    const at::ScalarType grad_type = grad.scalar_type();
    if (acc_type == at::kFloat && grad_type == at::kFloat) {
      groups[kF32F32].push_back(k);
    } else if (acc_type == at::kFloat && grad_type == at::kBFloat16) {
      groups[kF32BF16].push_back(k);
    } else if (acc_type == at::kFloat && grad_type == at::kHalf) {
      groups[kF32F16].push_back(k);
    } else if (acc_type == at::kDouble && grad_type == at::kDouble) {
      groups[kF64F64].push_back(k);
    } else if (acc_type == at::kDouble && grad_type == at::kFloat) {
      groups[kF64F32].push_back(k);
    } else if (acc_type == at::kDouble && grad_type == at::kBFloat16) {
      groups[kF64BF16].push_back(k);
    } else if (acc_type == at::kDouble && grad_type == at::kHalf) {
      groups[kF64F16].push_back(k);
    } else {
      TORCH_INTERNAL_ASSERT(
          false, "vflow: unsupported (acc, grad) dtype pair (", acc_type, ", ", grad_type, ")");
    }
  }

  // The weight is rounded to the accumulator dtype once, as `acc.add_(grad,
  // alpha=weight)` does for a float accumulator.
  // The tag arguments carry only their types: (accumulator, gradient) dtype.
  const auto launch = [&](auto acc_tag, auto grad_tag, Group group) {
    using acc_t = decltype(acc_tag);
    using grad_t = decltype(grad_tag);
    if (!groups[group].empty()) {
      launch_multi_accumulate<acc_t, grad_t>(
          accs, grads, groups[group], static_cast<acc_t>(weight), overwrite);
    }
  };
  launch(float{}, float{}, kF32F32);
  launch(float{}, c10::BFloat16{}, kF32BF16);
  launch(float{}, c10::Half{}, kF32F16);
  launch(double{}, double{}, kF64F64);
  // float64 accumulators of narrower gradients (accumulate_dtype=float64).
  launch(double{}, float{}, kF64F32);
  launch(double{}, c10::BFloat16{}, kF64BF16);
  launch(double{}, c10::Half{}, kF64F16);
}

// ---- Operator implementations (Note [One op surface] in ../ops.h) ----

void multi_accumulate_cuda(
    at::TensorList accs,
    at::TensorList grads,
    double weight,
    bool overwrite) {
  const FusedPairs fused = prepare_multi_accumulate(accs, grads, weight, overwrite);
  accumulate_pairs(fused.accs, fused.grads, weight, overwrite);
}

// buf *= factor with the factor rounded to buf's dtype. factor == 1 launches
// nothing (x * 1 == x for every x). Enqueued on the current stream; never
// synchronises.
void scale_cuda(const at::Tensor& buf, double factor) {
  if (!prepare_scale(buf, factor)) {
    return;
  }
  TORCH_INTERNAL_ASSERT(buf.is_cuda());
  const c10::cuda::CUDAGuard guard(buf.device());
  if (buf.scalar_type() == at::kFloat) {
    launch_scale<float, true, false>(buf, static_cast<float>(factor), nullptr);
  } else {
    TORCH_INTERNAL_ASSERT(buf.scalar_type() == at::kDouble);
    launch_scale<double, true, false>(buf, factor, nullptr);
  }
}

// One pass scales (unless factor == 1, where buf is only read) and writes 1.0f
// into found_nonfinite if any resulting element is inf or NaN; it never writes 0
// (Note [Non-finite flag] in ops.h). Enqueued on the current stream; never
// synchronises.
void scale_check_cuda(const at::Tensor& buf, double factor, const at::Tensor& found_nonfinite) {
  if (!prepare_scale_check(buf, found_nonfinite)) {
    return;
  }
  TORCH_INTERNAL_ASSERT(buf.is_cuda());
  const c10::cuda::CUDAGuard guard(buf.device());
  float* flag = found_nonfinite.data_ptr<float>();
  const bool scale = factor != 1.0;
  if (buf.scalar_type() == at::kFloat) {
    const float f = static_cast<float>(factor);
    if (scale) {
      launch_scale<float, true, true>(buf, f, flag);
    } else {
      launch_scale<float, false, true>(buf, f, flag);
    }
  } else {
    TORCH_INTERNAL_ASSERT(buf.scalar_type() == at::kDouble);
    if (scale) {
      launch_scale<double, true, true>(buf, factor, flag);
    } else {
      launch_scale<double, false, true>(buf, factor, flag);
    }
  }
}

} // namespace

TORCH_LIBRARY_IMPL(vflow, CUDA, m) {
  m.impl("multi_accumulate_", &multi_accumulate_cuda);
  m.impl("scale_", &scale_cuda);
  m.impl("scale_check_", &scale_check_cuda);
}

} // namespace vflow
