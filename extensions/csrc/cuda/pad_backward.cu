// Deterministic CUDA backward of reflection and replication padding, 1-D, 2-D and 3-D.
//
// PyTorch's kernels add every grad_output element into its source with float atomicAdd (the border
// elements have several sources; refused under torch.use_deterministic_algorithms(True)). Here each
// grad_input element gathers. Along an axis (input size I, padding left L / right R, output O = L + I + R),
// output o reads input src(o):
//   reflection: L - o for o < L, o - L inside, 2 (I - 1) + L - o past the end (pads < I);
//   replication: clamp(o - L, 0, I - 1).
// So input i is read by, in increasing o:
//   reflection: L - i (if 1 <= i <= L), i + L, 2 (I - 1) + L - i (if it is >= L + I): at most 3 outputs;
//   replication: the range [i == 0 ? 0 : i + L, i == I - 1 ? O : i + L + 1).
// Thread (plane, d, h, w) sums grad_output over the product of its three axis sets in increasing
// (od, oh, ow) and writes grad_input once. Why deterministic: a fixed set of terms per element, summed
// in a fixed order. Missing axes (1-D, 2-D) are size-1 axes without padding. Sums are in accscalar_t.
// grad_input is computed contiguous and returned in self's suggested memory format.
// All work is on the current stream, no sync.
#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace deepep {

// Defined in ../pad_backward.cpp.
void check_pad_backward_args(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding,
                             bool reflect);

namespace {

constexpr int kThreads = 256;

struct PadAxis {
  int64_t in, left, out;
};

// The outputs reading input i along one axis: a range [begin, end) (replication), or up to three
// points (reflection), visited in increasing order.
struct Sources {
  int64_t begin, end;  // replication range; reflection: unused
  int64_t points[3];
  int count;
};

template <bool kReflect>
__device__ __forceinline__ Sources sources(const PadAxis& a, int64_t i) {
  Sources s{};
  if (kReflect) {
    if (i >= 1 && i <= a.left) s.points[s.count++] = a.left - i;
    s.points[s.count++] = i + a.left;
    const int64_t mirrored = 2 * (a.in - 1) + a.left - i;
    if (mirrored >= a.left + a.in && mirrored < a.out) s.points[s.count++] = mirrored;
  } else {
    s.begin = i == 0 ? 0 : i + a.left;
    s.end = i == a.in - 1 ? a.out : i + a.left + 1;
  }
  return s;
}

template <bool kReflect>
__device__ __forceinline__ int64_t source_count(const Sources& s) {
  return kReflect ? s.count : s.end - s.begin;
}

template <bool kReflect>
__device__ __forceinline__ int64_t source_at(const Sources& s, int64_t k) {
  return kReflect ? s.points[k] : s.begin + k;
}

template <typename scalar_t, typename accscalar_t, bool kReflect>
__global__ void __launch_bounds__(kThreads)
    pad_backward_kernel(const scalar_t* __restrict__ grad_output, scalar_t* __restrict__ grad_input, int64_t total,
                        PadAxis ad, PadAxis ah, PadAxis aw) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; index < total; index += step) {
    const int64_t w = index % aw.in;
    const int64_t h = (index / aw.in) % ah.in;
    const int64_t d = (index / (aw.in * ah.in)) % ad.in;
    const int64_t plane = index / (aw.in * ah.in * ad.in);
    const scalar_t* plane_grad = grad_output + plane * ad.out * ah.out * aw.out;
    const Sources sd = sources<kReflect>(ad, d), sh = sources<kReflect>(ah, h), sw = sources<kReflect>(aw, w);
    accscalar_t sum = 0;
    for (int64_t kd = 0; kd < source_count<kReflect>(sd); ++kd) {
      const int64_t od = source_at<kReflect>(sd, kd);
      for (int64_t kh = 0; kh < source_count<kReflect>(sh); ++kh) {
        const scalar_t* row = plane_grad + (od * ah.out + source_at<kReflect>(sh, kh)) * aw.out;
        for (int64_t kw = 0; kw < source_count<kReflect>(sw); ++kw) {
          sum += static_cast<accscalar_t>(row[source_at<kReflect>(sw, kw)]);
        }
      }
    }
    grad_input[index] = static_cast<scalar_t>(sum);
  }
}

at::Tensor pad_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding,
                             bool reflect) {
  check_pad_backward_args(grad_output, self, padding, reflect);
  TORCH_CHECK(self.is_cuda() && grad_output.device() == self.device(),
              "pad_backward: grad_output and self must be on one CUDA device, got ", grad_output.device(), " and ",
              self.device());
  const c10::cuda::CUDAGuard device_guard(self.device());
  const int64_t dims = self.dim(), spatial = static_cast<int64_t>(padding.size()) / 2;
  // axis 0 = last dim (padding[0], padding[1]), as aten orders padding.
  auto axis = [&](int64_t from_last) {
    if (from_last >= spatial) return PadAxis{1, 0, 1};
    return PadAxis{self.size(dims - 1 - from_last), padding[2 * from_last], grad_output.size(dims - 1 - from_last)};
  };
  const at::Tensor grad_c = grad_output.contiguous();
  // Written in full by the kernel: no deterministic-mode fill needed.
  at::Tensor grad_input =
      at::Tensor(at::detail::empty_cuda(self.sizes(), self.scalar_type(), self.device(), std::nullopt));
  const int64_t total = grad_input.numel();
  if (total == 0) return grad_input;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 20);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "pad_backward_cuda", [&] {
    using accscalar_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    const auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
          grad_c.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>(), total, axis(2), axis(1), axis(0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (reflect) {
      launch(pad_backward_kernel<scalar_t, accscalar_t, true>);
    } else {
      launch(pad_backward_kernel<scalar_t, accscalar_t, false>);
    }
  });
  const auto format = self.suggest_memory_format();
  return format == at::MemoryFormat::Contiguous ? grad_input : grad_input.contiguous(format);
}

at::Tensor reflection_pad_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef padding) {
  return pad_backward_cuda(grad_output, self, padding, true);
}

at::Tensor replication_pad_backward_cuda(const at::Tensor& grad_output, const at::Tensor& self,
                                         at::IntArrayRef padding) {
  return pad_backward_cuda(grad_output, self, padding, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep, CUDA, m) {
  m.impl("reflection_pad_backward", &reflection_pad_backward_cuda);
  m.impl("replication_pad_backward", &replication_pad_backward_cuda);
}

}  // namespace deepep
