// CUDA kernels of deepep_lightning::fixed_point_scatter_add (schema, host driver and CPU loops:
// ../fixed_point_scatter.cpp; the per-thread math: ../fixed_point_scatter.h and ../fixed_point_sum.h).
//
// PyTorch's CUDA index_add_ adds each term with float atomicAdd, in an order that changes from run to run;
// here one thread per term adds it as a 64-bit integer of fixed-point quanta with integer atomicAdd, which
// associates, so the sums do not depend on the order. Per chunk of output rows: the atomics, then one thread
// per output element adds its row's sum into out (its base) and clears the sum; the flag word of four elements
// is cleared by the first of its four lanes once the warp has read it. Nothing reads data on the host: CUDA-graph
// capturable.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "../fixed_point_scatter.h"
#include "gather_launch.cuh"

namespace deepep_lightning::fixed_point_scatter {

namespace {

using gather::grid_blocks;
using gather::kThreads;

__device__ inline int scale_of(const unsigned int* max_bits, const Layout& layout) {
  return fixed_point::scale_exponent(static_cast<float>(__uint_as_float(*max_bits) * fabs(layout.alpha)),
                                     layout.terms_bits);
}

template <typename scalar_t, typename index_t>
__global__ void accumulate_kernel(int64_t terms, const scalar_t* __restrict__ src, const index_t* __restrict__ index,
                                  Layout layout, Rows rows, const unsigned int* __restrict__ max_bits,
                                  unsigned long long* __restrict__ sums, unsigned int* __restrict__ flags) {
  const int s = scale_of(max_bits, layout);
  const int64_t words = words_per_row(layout);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < terms;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t entry_row = static_cast<int64_t>(index[entry_of(t, layout)]);
    CUDA_KERNEL_ASSERT(entry_row >= 0 && entry_row < layout.size && "fixed_point_scatter_add: index out of range");
    const int64_t row = chunk_row(t, entry_row, layout, rows);
    if (row < 0) continue;
    const int64_t column = t % layout.inner;
    const double term = static_cast<double>(src[t]) * layout.alpha;
    if (isfinite(term)) {  // two's complement: adding the unsigned bits adds the signed values
      atomicAdd(sums + row * layout.inner + column, static_cast<unsigned long long>(fixed_point::quantize(term, s)));
    } else {
      atomicOr(flags + row * words + (column >> 2), fixed_point::flag_of(term) << fixed_point::flag_shift(column));
    }
  }
}

// One thread per output element of a chunk row (blockIdx.y walks the rows); see the file comment.
template <typename scalar_t>
__global__ void finish_kernel(Layout layout, Rows rows, const unsigned int* __restrict__ max_bits,
                              long long* __restrict__ sums, unsigned int* __restrict__ flags,
                              scalar_t* __restrict__ out) {
  const int s = scale_of(max_bits, layout);
  const int64_t words = words_per_row(layout);
  const int64_t padded = (layout.inner + 31) / 32 * 32;  // whole warps: every lane reaches __syncwarp
  for (int64_t row = blockIdx.y; row < layout.outer * rows.count; row += gridDim.y) {
    scalar_t* destination = out + ((row / rows.count) * layout.size + rows.first + row % rows.count) * layout.inner;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < padded;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const bool active = c < layout.inner;
      const unsigned int word_flags = active ? flags[row * words + (c >> 2)] : 0u;
      __syncwarp();  // the word's four lanes have read it before the first clears it
      if (!active) continue;
      const uint32_t flag = (word_flags >> fixed_point::flag_shift(c)) & 0xffu;
      const int64_t index = row * layout.inner + c;
      const float value = finished(static_cast<float>(destination[c]), sums[index], flag, s);
      sums[index] = 0;
      if ((c & 3) == 0) flags[row * words + (c >> 2)] = 0;
      destination[c] = static_cast<scalar_t>(value);
    }
  }
}

void accumulate_cuda(const at::Tensor& src, const at::Tensor& index, const Layout& layout, const Rows& rows,
                     const at::Tensor& max_bits, at::Tensor& sums, at::Tensor& flags) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t terms = layout.outer * layout.entries * layout.inner;
  const auto* bits = reinterpret_cast<const unsigned int*>(max_bits.const_data_ptr<int32_t>());
  auto* sum_data = reinterpret_cast<unsigned long long*>(sums.data_ptr<int64_t>());
  auto* flag_data = reinterpret_cast<unsigned int*>(flags.data_ptr<int32_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "fixed_point_scatter_add_cuda", [&] {
    if (index.scalar_type() == at::kLong) {
      accumulate_kernel<scalar_t, int64_t><<<grid_blocks(terms), kThreads, 0, stream>>>(
          terms, src.const_data_ptr<scalar_t>(), index.const_data_ptr<int64_t>(), layout, rows, bits, sum_data,
          flag_data);
    } else {
      accumulate_kernel<scalar_t, int32_t><<<grid_blocks(terms), kThreads, 0, stream>>>(
          terms, src.const_data_ptr<scalar_t>(), index.const_data_ptr<int32_t>(), layout, rows, bits, sum_data,
          flag_data);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void finish_cuda(const Layout& layout, const Rows& rows, const at::Tensor& max_bits, at::Tensor& sums,
                 at::Tensor& flags, at::Tensor& out) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned int>(std::min<int64_t>((layout.inner + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned int>(std::min<int64_t>(layout.outer * rows.count, 65535)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "fixed_point_scatter_add_cuda", [&] {
    finish_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        layout, rows, reinterpret_cast<const unsigned int*>(max_bits.const_data_ptr<int32_t>()),
        reinterpret_cast<long long*>(sums.data_ptr<int64_t>()), reinterpret_cast<unsigned int*>(flags.data_ptr<int32_t>()),
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

const Launches kCudaLaunches{&fixed_point::max_finite_abs_cuda, &accumulate_cuda, &finish_cuda};

at::Tensor fixed_point_scatter_add_cuda(const at::Tensor& src, const at::Tensor& index, int64_t size, int64_t dim,
                                        const std::optional<at::Tensor>& base, double alpha) {
  TORCH_CHECK(src.is_cuda(), "fixed_point_scatter_add_cuda: src must be a CUDA tensor, got ", src.device());
  const c10::cuda::CUDAGuard device_guard(src.device());
  return scatter_add_with(kCudaLaunches, src, index, size, dim, base, alpha);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) { m.impl("fixed_point_scatter_add", &fixed_point_scatter_add_cuda); }

}  // namespace deepep_lightning::fixed_point_scatter
