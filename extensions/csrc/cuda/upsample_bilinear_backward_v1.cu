// v1 of the deterministic CUDA backward of bilinear upsampling, kept (unchanged) so that one GPU run
// can time it side by side with v2 (upsample_bilinear_backward.cu, the default); selected by
// DEEPEP_REFUSED_OPS_KERNEL=v1. Delete this file once v2 is measured.
//
// PyTorch's upsample_bilinear2d_backward scatters every grad_output element into its 4 source
// pixels with float atomicAdd (nondeterministic order; refused under
// torch.use_deterministic_algorithms(True)). The map is separable and monotone, so the adjoint
// is a gather: along each axis, output index o reads source i0(o) with weight 1 - lambda(o) and
// source i0(o) + p(o) with weight lambda(o) (p = 0 on the last row/column), with i0, lambda
// computed by PyTorch's own area_pixel_compute_scale / area_pixel_compute_source_index (UpSample.cuh),
// so the index map is PyTorch's exactly. i0 is non-decreasing in o, hence the outputs that read
// source i are those with i0(o) in {i - 1, i}: one contiguous range [start(i - 1), start(i + 1)),
// where start(i) is the first o with i0(o) >= i (a binary search per source index).
// One thread per grad_input element sums its (rows x columns) window in row-major order and
// writes once: a fixed order, no atomics, bitwise reproducible.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/native/cuda/UpSample.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

namespace deepep {

// Defined in ../refused_ops.cpp.
void check_upsample_args(const at::Tensor& grad_output, at::IntArrayRef input_size);

namespace v1 {
namespace {

constexpr int kThreads = 256;

// Per output index o of one axis: first source index i0(o) and the weight lambda(o) of i0 + p.
template <typename accscalar_t>
__global__ void axis_source_kernel(const int out_size, const int in_size, const accscalar_t scale,
                                   const bool align_corners, int* __restrict__ first_source,
                                   accscalar_t* __restrict__ lambda) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= out_size) return;
  const accscalar_t real = at::native::area_pixel_compute_source_index<accscalar_t>(
      scale, o, align_corners, /*cubic=*/false);
  const int i0 = static_cast<int>(real);  // truncation, as in PyTorch's kernel (real >= 0)
  first_source[o] = i0 < in_size - 1 ? i0 : in_size - 1;
  lambda[o] = real - i0;
}

// start[i] = first o with first_source[o] >= i, for i in [0, in_size]; first_source is sorted.
__global__ void axis_start_kernel(const int out_size, const int in_size,
                                  const int* __restrict__ first_source, int* __restrict__ start) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i > in_size) return;
  int low = 0, high = out_size;
  while (low < high) {
    const int mid = (low + high) / 2;
    if (first_source[mid] < i) low = mid + 1; else high = mid;
  }
  start[i] = low;
}

// Weight with which output index o of one axis reads source index i (0 when it does not).
template <typename accscalar_t>
__device__ __forceinline__ accscalar_t axis_weight(const int o, const int i, const int in_size,
                                                  const int* __restrict__ first_source,
                                                  const accscalar_t* __restrict__ lambda) {
  const int i0 = first_source[o];
  const int i1 = i0 + (i0 < in_size - 1 ? 1 : 0);
  const accscalar_t l1 = lambda[o];
  accscalar_t weight = 0;
  if (i0 == i) weight += static_cast<accscalar_t>(1) - l1;
  if (i1 == i) weight += l1;
  return weight;
}

template <typename scalar_t, typename accscalar_t>
__global__ void upsample_gather_kernel(
    const int64_t total, const int in_h, const int in_w, const int out_h, const int out_w,
    const int* __restrict__ source_h, const accscalar_t* __restrict__ lambda_h, const int* __restrict__ start_h,
    const int* __restrict__ source_w, const accscalar_t* __restrict__ lambda_w, const int* __restrict__ start_w,
    const scalar_t* __restrict__ grad_output,  // [N*C, H_out, W_out]
    scalar_t* __restrict__ grad_input) {       // [N*C, H_in, W_in]
  const int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (index >= total) return;
  const int x = static_cast<int>(index % in_w);
  const int y = static_cast<int>((index / in_w) % in_h);
  const int64_t plane = index / (static_cast<int64_t>(in_w) * in_h);
  const int row_begin = start_h[y > 0 ? y - 1 : 0], row_end = start_h[y + 1 <= in_h ? y + 1 : in_h];
  const int col_begin = start_w[x > 0 ? x - 1 : 0], col_end = start_w[x + 1 <= in_w ? x + 1 : in_w];
  const scalar_t* grad_plane = grad_output + plane * out_h * out_w;
  // Terms as PyTorch forms them (accscalar_t), summed in double: a pixel can collect thousands.
  double acc = 0;
  for (int oh = row_begin; oh < row_end; ++oh) {
    const accscalar_t weight_h = axis_weight(oh, y, in_h, source_h, lambda_h);
    if (weight_h == static_cast<accscalar_t>(0)) continue;
    const scalar_t* grad_row = grad_plane + static_cast<int64_t>(oh) * out_w;
    for (int ow = col_begin; ow < col_end; ++ow) {
      const accscalar_t weight_w = axis_weight(ow, x, in_w, source_w, lambda_w);
      acc += static_cast<double>(weight_h * weight_w * static_cast<accscalar_t>(grad_row[ow]));
    }
  }
  grad_input[index] = static_cast<scalar_t>(acc);
}

}  // namespace

// Called by upsample_bilinear_backward.cu when DEEPEP_REFUSED_OPS_KERNEL=v1.
at::Tensor upsample_bilinear2d_backward_cuda(const at::Tensor& grad_output, at::IntArrayRef input_size,
                                             bool align_corners, std::optional<double> scale_h,
                                             std::optional<double> scale_w) {
  check_upsample_args(grad_output, input_size);
  TORCH_CHECK(grad_output.is_cuda(), "upsample_bilinear2d_backward: grad_output must be a CUDA tensor, got ",
              grad_output.device());
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  const int64_t in_h = input_size[2], in_w = input_size[3];
  const int64_t out_h = grad_output.size(2), out_w = grad_output.size(3);
  TORCH_CHECK(in_h < INT_MAX && in_w < INT_MAX && out_h < INT_MAX && out_w < INT_MAX,
              "upsample_bilinear2d_backward: spatial sizes must fit in int32, got input_size ", input_size,
              " and grad_output ", grad_output.sizes());
  const at::Tensor grad_c = grad_output.contiguous();
  at::Tensor grad_input = at::empty(input_size, grad_c.options());
  if (grad_input.numel() == 0) return grad_input;
  if (grad_c.numel() == 0) return grad_input.zero_();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::TensorOptions int_options = grad_c.options().dtype(at::kInt);
  // [out_h | out_w] first sources and [in_h + 1 | in_w + 1] segment starts.
  at::Tensor source = at::empty({out_h + out_w}, int_options);
  at::Tensor start = at::empty({in_h + 1 + in_w + 1}, int_options);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_c.scalar_type(), "upsample_bilinear2d_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    at::Tensor lambda = at::empty({out_h + out_w}, grad_c.options().dtype(c10::CppTypeToScalarType<accscalar_t>::value));
    const accscalar_t scale_y = at::native::area_pixel_compute_scale<accscalar_t>(
        static_cast<int>(in_h), static_cast<int>(out_h), align_corners, scale_h);
    const accscalar_t scale_x = at::native::area_pixel_compute_scale<accscalar_t>(
        static_cast<int>(in_w), static_cast<int>(out_w), align_corners, scale_w);
    int* source_h = source.data_ptr<int>();
    int* source_w = source_h + out_h;
    accscalar_t* lambda_h = lambda.data_ptr<accscalar_t>();
    accscalar_t* lambda_w = lambda_h + out_h;
    int* start_h = start.data_ptr<int>();
    int* start_w = start_h + in_h + 1;
    const auto blocks = [](int64_t count) { return static_cast<unsigned int>((count + kThreads - 1) / kThreads); };

    axis_source_kernel<accscalar_t><<<blocks(out_h), kThreads, 0, stream>>>(
        static_cast<int>(out_h), static_cast<int>(in_h), scale_y, align_corners, source_h, lambda_h);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    axis_source_kernel<accscalar_t><<<blocks(out_w), kThreads, 0, stream>>>(
        static_cast<int>(out_w), static_cast<int>(in_w), scale_x, align_corners, source_w, lambda_w);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    axis_start_kernel<<<blocks(in_h + 1), kThreads, 0, stream>>>(
        static_cast<int>(out_h), static_cast<int>(in_h), source_h, start_h);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    axis_start_kernel<<<blocks(in_w + 1), kThreads, 0, stream>>>(
        static_cast<int>(out_w), static_cast<int>(in_w), source_w, start_w);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t total = grad_input.numel();
    upsample_gather_kernel<scalar_t, accscalar_t><<<blocks(total), kThreads, 0, stream>>>(
        total, static_cast<int>(in_h), static_cast<int>(in_w), static_cast<int>(out_h), static_cast<int>(out_w),
        source_h, lambda_h, start_h, source_w, lambda_w, start_w, grad_c.data_ptr<scalar_t>(),
        grad_input.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

}  // namespace v1
}  // namespace deepep
