// deepep_lightning::deform_conv2d_grad_input: the per-sample entries of deform_conv2d's input gradient (the host
// driver and CPU kernels: deform_conv2d_backward.cpp; CUDA: cuda/deform_conv2d_backward.cu).
//
// torchvision's deformable_col2im_kernel adds mask * w * column into the (up to) 4 pixels around each
// deformable sample with float atomicAdd. A sample (n, offset group g, kernel tap k, output position l)
// sits at y = (oy * stride_h - pad_h) + ki * dilation_h + offset_y, x likewise, for every channel of its
// offset group: so its 4 entries (pixel, weight = mask * (1 - |y - yp|) * (1 - |x - xp|)) are
// channel-independent, and the gather of roi_csr_gather.h sums them per (pixel, channel) in a fixed order.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <math.h>

#include <cstdint>

#include "roi_align_backward.h"
#include "roi_csr_gather.h"

namespace deepep_lightning::roi {

struct DeformArgs {
  int64_t batch, offset_groups, height, width, kernel_h, kernel_w, out_h, out_w;
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  int64_t num_destinations;  // N * offset_groups * H * W: the sentinel key
  bool use_mask;
};

// Step 1 for sample s = ((n * G + g) * K + k) * L + l, written at entry slot e0 .. e0 + 3 of its chunk;
// source = s, so the gather reads columns [N * G, C / G, K * L] at ((n * G + g) * C / G + c) * K * L + k * L + l.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline void deform_sample_entries(int64_t s, int64_t e0, const scalar_t* offset, const scalar_t* mask,
                                                  const DeformArgs& a, int32_t* keys, int32_t* sources,
                                                  T* weights) {
  const int64_t taps = a.kernel_h * a.kernel_w;
  const int64_t positions = a.out_h * a.out_w;
  const int64_t l = s % positions;
  const int64_t k = (s / positions) % taps;
  const int64_t group = s / (positions * taps);  // n * G + g
  const int64_t oy = l / a.out_w;
  const int64_t ox = l - oy * a.out_w;
  const int64_t ki = k / a.kernel_w;
  const int64_t kj = k - ki * a.kernel_w;
  // torchvision's layouts: offset [N, G * K * 2, out_h, out_w] (y then x per tap), mask [N, G * K, out_h, out_w]
  const scalar_t* offsets = offset + group * 2 * taps * positions;
  const T offset_y = static_cast<T>(offsets[(2 * k) * positions + l]);
  const T offset_x = static_cast<T>(offsets[(2 * k + 1) * positions + l]);
  const T mask_value = a.use_mask ? static_cast<T>(mask[(group * taps + k) * positions + l]) : static_cast<T>(1);
  const T y = static_cast<T>((oy * a.stride_h - a.pad_h) + ki * a.dilation_h) + offset_y;
  const T x = static_cast<T>((ox * a.stride_w - a.pad_w) + kj * a.dilation_w) + offset_x;
  const int64_t plane = group * a.height * a.width;
  // torchvision tries yp in (int)y - 1 .. (int)y + 1 and keeps 0 <= yp < H with |y - yp| < 1: that is
  // floor(y) and floor(y) + 1 (the latter only when y is not an integer); NaN keeps nothing.
  const bool inside = y > static_cast<T>(-1) && y < static_cast<T>(a.height) && x > static_cast<T>(-1) &&
                      x < static_cast<T>(a.width);
  const int64_t y0 = inside ? static_cast<int64_t>(floor(y)) : 0;
  const int64_t x0 = inside ? static_cast<int64_t>(floor(x)) : 0;
  for (int corner = 0; corner < kCorners; ++corner) {
    const int64_t yp = y0 + corner / 2;
    const int64_t xp = x0 + corner % 2;
    const T dy = y - static_cast<T>(yp);
    const T dx = x - static_cast<T>(xp);
    const bool kept = inside && yp >= 0 && yp < a.height && xp >= 0 && xp < a.width && fabs(dy) < static_cast<T>(1) &&
                      fabs(dx) < static_cast<T>(1);
    keys[e0 + corner] = static_cast<int32_t>(kept ? plane + yp * a.width + xp : a.num_destinations);
    sources[e0 + corner] = static_cast<int32_t>(s);
    weights[e0 + corner] =
        kept ? mask_value * ((static_cast<T>(1) - fabs(dy)) * (static_cast<T>(1) - fabs(dx))) : static_cast<T>(0);
  }
}

// The device-specific steps of deform_conv2d_grad_input_with.
struct DeformLaunches {
  void (*entries)(int64_t first, int64_t count, const at::Tensor& offset, const at::Tensor& mask,
                  const DeformArgs& args, at::Tensor& keys, at::Tensor& sources, at::Tensor& weights);
  GatherLaunch gather;
  at::Tensor (*empty)(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device);
};

// The host driver (deform_conv2d_backward.cpp), shared by the CPU and CUDA kernels.
at::Tensor deform_conv2d_grad_input_with(const DeformLaunches& launches, const at::Tensor& columns,
                                         const at::Tensor& offset, const at::Tensor& mask, int64_t height,
                                         int64_t width, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                                         int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                                         int64_t dilation_w, int64_t offset_groups, bool use_mask);

}  // namespace deepep_lightning::roi
