// CUDA backend of the exact accumulation operators (Note [Exact accumulation] in
// ../exact.h; registration: Note [One op surface] in ../ops.h). The per-element
// arithmetic is the host/device code of exact.h, shared with the CPU backend, so both
// compute the same integers for the same inputs.
// Each kernel is a grid-stride loop over one contiguous slice; these passes are
// bound by memory traffic (1 + 12 bytes read-modify-written per gradient element),
// and consecutive threads touch consecutive elements of every plane.
#include "../exact.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace vflow {
namespace {

constexpr int kThreads = 256;

unsigned int blocks_for(int64_t n) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(wanted, sms * 8)));
}

__device__ __forceinline__ float widen(float v) {
  return v;
}
__device__ __forceinline__ float widen(c10::BFloat16 v) {
  return static_cast<float>(v);
}
__device__ __forceinline__ float widen(c10::Half v) {
  return static_cast<float>(v);
}

template <typename G>
__global__ void accumulate_kernel(int8_t* __restrict__ top, int32_t* __restrict__ l0,
                                  int32_t* __restrict__ l1, int32_t* __restrict__ l2,
                                  const G* __restrict__ grad, double weight, bool fresh,
                                  int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    // __dmul_rn: no contraction into an FMA, so the product is the same as on the CPU.
    const double y = __dmul_rn(weight, static_cast<double>(widen(grad[i])));
    int8_t t = top[i];
    int32_t a0 = l0[i];
    int32_t a1 = l1[i];
    int32_t a2 = l2[i];
    exact::accumulate_one(t, a0, a1, a2, y, fresh);
    top[i] = t;
    l0[i] = a0;
    l1[i] = a1;
    l2[i] = a2;
  }
}

__global__ void pack_kernel(const int8_t* __restrict__ local, const int8_t* __restrict__ global,
                            const int32_t* __restrict__ l0, const int32_t* __restrict__ l1,
                            const int32_t* __restrict__ l2, int64_t* __restrict__ wire,
                            int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    wire[i] = exact::packed(local[i], global[i], l0[i], l1[i], l2[i]);
  }
}

__global__ void unpack_kernel(const int8_t* __restrict__ global, const int64_t* __restrict__ wire,
                              float* __restrict__ out, double factor, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = exact::unpacked(global[i], wire[i], factor);
  }
}

template <typename G>
void launch_accumulate(const at::Tensor& top, const at::Tensor& l0, const at::Tensor& l1,
                       const at::Tensor& l2, const at::Tensor& grad, double weight, bool fresh) {
  const int64_t n = top.numel();
  accumulate_kernel<G><<<blocks_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      top.data_ptr<int8_t>(), l0.data_ptr<int32_t>(), l1.data_ptr<int32_t>(),
      l2.data_ptr<int32_t>(), grad.const_data_ptr<G>(), weight, fresh, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- Operator implementations (Note [One op surface] in ../ops.h) ----

void exact_accumulate_cuda(
    const at::Tensor& top, const at::Tensor& l0, const at::Tensor& l1, const at::Tensor& l2,
    const at::Tensor& grad_in, double weight, bool fresh) {
  const std::optional<at::Tensor> grad = prepare_exact_accumulate(top, l0, l1, l2, grad_in);
  if (!grad) {
    return;
  }
  TORCH_INTERNAL_ASSERT(top.is_cuda());
  const c10::cuda::CUDAGuard guard(top.device());
  switch (grad->scalar_type()) {
    case at::kFloat:
      launch_accumulate<float>(top, l0, l1, l2, *grad, weight, fresh);
      break;
    case at::kBFloat16:
      launch_accumulate<c10::BFloat16>(top, l0, l1, l2, *grad, weight, fresh);
      break;
    case at::kHalf:
      launch_accumulate<c10::Half>(top, l0, l1, l2, *grad, weight, fresh);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "unexpected gradient dtype ", grad->scalar_type());
  }
}

void exact_pack_cuda(
    const at::Tensor& local_top, const at::Tensor& global_top, const at::Tensor& l0,
    const at::Tensor& l1, const at::Tensor& l2, const at::Tensor& wire) {
  if (!prepare_exact_pack(local_top, global_top, l0, l1, l2, wire)) {
    return;
  }
  TORCH_INTERNAL_ASSERT(local_top.is_cuda());
  const c10::cuda::CUDAGuard guard(local_top.device());
  const int64_t n = wire.numel();
  pack_kernel<<<blocks_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      local_top.const_data_ptr<int8_t>(), global_top.const_data_ptr<int8_t>(),
      l0.const_data_ptr<int32_t>(), l1.const_data_ptr<int32_t>(), l2.const_data_ptr<int32_t>(),
      wire.data_ptr<int64_t>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void exact_unpack_cuda(
    const at::Tensor& global_top, const at::Tensor& wire, const at::Tensor& out, double factor) {
  if (!prepare_exact_unpack(global_top, wire, out)) {
    return;
  }
  TORCH_INTERNAL_ASSERT(global_top.is_cuda());
  const c10::cuda::CUDAGuard guard(global_top.device());
  const int64_t n = out.numel();
  unpack_kernel<<<blocks_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      global_top.const_data_ptr<int8_t>(), wire.const_data_ptr<int64_t>(),
      out.data_ptr<float>(), factor, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace

TORCH_LIBRARY_IMPL(vflow, CUDA, m) {
  m.impl("exact_accumulate_", &exact_accumulate_cuda);
  m.impl("exact_pack_", &exact_pack_cuda);
  m.impl("exact_unpack_", &exact_unpack_cuda);
}

} // namespace vflow
