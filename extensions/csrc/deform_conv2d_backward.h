// The deterministic backward of torchvision's deform_conv2d, per deformable sample (the host drivers and
// CPU kernels: deform_conv2d_backward.cpp; CUDA: cuda/deform_conv2d_backward.cu).
//
// A sample (offset group g, kernel tap k, image n, output position l) sits at y = (oy * stride_h - pad_h) +
// ki * dilation_h + offset_y, x likewise, for every channel of its offset group. The columns (weight^T .
// grad_output, formed by a matmul in deepep_lightning/ops/deform_conv2d.py) are laid out as torchvision's,
// [C, K, N, L]: channel c of group g at sample s is columns[(g * C / G + c) * K * N * L + s % (K * N * L)],
// with samples numbered s = ((g * K + k) * N + n) * L + l.
//
// * grad_input: torchvision's deformable_col2im_kernel adds mask * w * column into the (up to) 4 pixels
//   around each sample with float atomicAdd. A sample's 4 entries (pixel, weight = mask * (1 - |y - yp|) *
//   (1 - |x - xp|)) are channel-independent, so the gather of roi_csr_gather.h sums them per (pixel,
//   channel) in a fixed order (deform_sample_entries).
// * grad_offset, grad_mask and the im2col of grad_weight: one thread per sample reads the 4 corners of
//   every channel once and sums, in channel order, torchvision's deformable_col2im_coord terms (mask *
//   coordinate weight * column, column * bilinear value); it overwrites each column it has read with
//   mask * bilinear value, torchvision's deformable_im2col (deform_sample_grads). No other thread reads or
//   writes those columns, so the rewrite in place is race-free, and grad_weight is then one matmul.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <math.h>

#include <cstdint>
#include <tuple>

#include "roi_align_backward.h"
#include "roi_csr_gather.h"

namespace deepep_lightning::roi {

struct DeformArgs {
  int64_t batch, offset_groups, channels, height, width, kernel_h, kernel_w, out_h, out_w;  // channels: C / G
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  int64_t num_destinations;  // N * offset_groups * H * W: the sentinel key
  bool use_mask;
};

// Where sample s reads: its offset group and image, and its position in the map.
template <typename T>
struct DeformSample {
  int64_t group, image, tap, position;  // g, n, k, l
  T y, x, mask;
};

template <typename scalar_t, typename T>
C10_HOST_DEVICE inline DeformSample<T> deform_sample(int64_t s, const scalar_t* offset, const scalar_t* mask,
                                                     const DeformArgs& a) {
  const int64_t taps = a.kernel_h * a.kernel_w;
  const int64_t positions = a.out_h * a.out_w;
  DeformSample<T> sample;
  sample.position = s % positions;
  sample.image = (s / positions) % a.batch;
  sample.tap = (s / (positions * a.batch)) % taps;
  sample.group = s / (positions * a.batch * taps);
  const int64_t oy = sample.position / a.out_w;
  const int64_t ox = sample.position - oy * a.out_w;
  const int64_t ki = sample.tap / a.kernel_w;
  const int64_t kj = sample.tap - ki * a.kernel_w;
  // torchvision's layouts: offset [N, G * K * 2, out_h, out_w] (y then x per tap), mask [N, G * K, out_h, out_w]
  const int64_t group_taps = (sample.image * a.offset_groups + sample.group) * taps + sample.tap;
  const T offset_y = static_cast<T>(offset[(2 * group_taps) * positions + sample.position]);
  const T offset_x = static_cast<T>(offset[(2 * group_taps + 1) * positions + sample.position]);
  sample.mask = a.use_mask ? static_cast<T>(mask[group_taps * positions + sample.position]) : static_cast<T>(1);
  sample.y = static_cast<T>((oy * a.stride_h - a.pad_h) + ki * a.dilation_h) + offset_y;
  sample.x = static_cast<T>((ox * a.stride_w - a.pad_w) + kj * a.dilation_w) + offset_x;
  return sample;
}

// grad_input, step 1 for sample s, written at entry slot e0 .. e0 + 3 of its chunk; source = s.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline void deform_sample_entries(int64_t s, int64_t e0, const scalar_t* offset, const scalar_t* mask,
                                                  const DeformArgs& a, int32_t* keys, int32_t* sources,
                                                  T* weights) {
  const DeformSample<T> sample = deform_sample<scalar_t, T>(s, offset, mask, a);
  const T y = sample.y;
  const T x = sample.x;
  const int64_t plane = (sample.image * a.offset_groups + sample.group) * a.height * a.width;
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
        kept ? sample.mask * ((static_cast<T>(1) - fabs(dy)) * (static_cast<T>(1) - fabs(dx))) : static_cast<T>(0);
  }
}

// grad_offset, grad_mask and the im2col for sample s: torchvision's get_coordinate_weight and
// bilinear_interpolate on the 4 corners floor(y) .. floor(y) + 1 (a corner outside the map reads 0; the
// bilinear value is 0 outside (-1, H) x (-1, W)), summed over the group's channels in order.
template <typename scalar_t, typename T>
C10_HOST_DEVICE inline void deform_sample_grads(int64_t s, const scalar_t* input, const scalar_t* offset,
                                                const scalar_t* mask, const DeformArgs& a, scalar_t* columns,
                                                scalar_t* grad_offset, scalar_t* grad_mask) {
  const DeformSample<T> sample = deform_sample<scalar_t, T>(s, offset, mask, a);
  const T y = sample.y;
  const T x = sample.x;
  const int64_t positions = a.out_h * a.out_w;
  const int64_t samples_per_group = a.kernel_h * a.kernel_w * a.batch * positions;
  const T floor_y = floor(y);
  const T floor_x = floor(x);
  // NaN or far outside: every corner reads 0 (the index arithmetic below stays in range)
  const bool finite = floor_y > static_cast<T>(-2) && floor_y < static_cast<T>(a.height) &&
                      floor_x > static_cast<T>(-2) && floor_x < static_cast<T>(a.width);
  const int64_t y_low = finite ? static_cast<int64_t>(floor_y) : -2;
  const int64_t x_low = finite ? static_cast<int64_t>(floor_x) : -2;
  const bool valid_y_low = y_low >= 0 && y_low < a.height;
  const bool valid_y_high = y_low + 1 >= 0 && y_low + 1 < a.height;
  const bool valid_x_low = x_low >= 0 && x_low < a.width;
  const bool valid_x_high = x_low + 1 >= 0 && x_low + 1 < a.width;
  const bool inside = y > static_cast<T>(-1) && y < static_cast<T>(a.height) && x > static_cast<T>(-1) &&
                      x < static_cast<T>(a.width);
  const T dy = y - floor_y;
  const T dx = x - floor_x;
  const T w1 = (static_cast<T>(1) - dy) * (static_cast<T>(1) - dx);
  const T w2 = (static_cast<T>(1) - dy) * dx;
  const T w3 = dy * (static_cast<T>(1) - dx);
  const T w4 = dy * dx;
  const int64_t plane = a.height * a.width;
  const scalar_t* image = input + ((sample.image * a.offset_groups + sample.group) * a.channels) * plane;
  scalar_t* column = columns + sample.group * a.channels * samples_per_group + s % samples_per_group;
  T grad_y = static_cast<T>(0);
  T grad_x = static_cast<T>(0);
  T grad_m = static_cast<T>(0);
  for (int64_t c = 0; c < a.channels; ++c) {
    const scalar_t* channel = image + c * plane;
    const T v_yx = valid_y_low && valid_x_low ? static_cast<T>(channel[y_low * a.width + x_low]) : static_cast<T>(0);
    const T v_yX =
        valid_y_low && valid_x_high ? static_cast<T>(channel[y_low * a.width + x_low + 1]) : static_cast<T>(0);
    const T v_Yx =
        valid_y_high && valid_x_low ? static_cast<T>(channel[(y_low + 1) * a.width + x_low]) : static_cast<T>(0);
    const T v_YX =
        valid_y_high && valid_x_high ? static_cast<T>(channel[(y_low + 1) * a.width + x_low + 1]) : static_cast<T>(0);
    const T col = static_cast<T>(column[c * samples_per_group]);
    const T weight_y = dx * (v_YX - v_yX) + (static_cast<T>(1) - dx) * (v_Yx - v_yx);
    const T weight_x = dy * (v_YX - v_Yx) + (static_cast<T>(1) - dy) * (v_yX - v_yx);
    const T value = inside ? w1 * v_yx + w2 * v_yX + w3 * v_Yx + w4 * v_YX : static_cast<T>(0);
    grad_y += sample.mask * weight_y * col;
    grad_x += sample.mask * weight_x * col;
    grad_m += col * value;
    column[c * samples_per_group] = static_cast<scalar_t>(sample.mask * value);
  }
  const int64_t group_taps = (sample.image * a.offset_groups + sample.group) * a.kernel_h * a.kernel_w + sample.tap;
  grad_offset[(2 * group_taps) * positions + sample.position] = static_cast<scalar_t>(grad_y);
  grad_offset[(2 * group_taps + 1) * positions + sample.position] = static_cast<scalar_t>(grad_x);
  if (a.use_mask) grad_mask[group_taps * positions + sample.position] = static_cast<scalar_t>(grad_m);
}

// The device-specific steps of the host drivers.
struct DeformLaunches {
  void (*entries)(int64_t first, int64_t count, const at::Tensor& offset, const at::Tensor& mask,
                  const DeformArgs& args, at::Tensor& keys, at::Tensor& sources, at::Tensor& weights);
  GatherLaunch gather;
  void (*grads)(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask, const DeformArgs& args,
                at::Tensor& columns, at::Tensor& grad_offset, at::Tensor& grad_mask);
  at::Tensor (*empty)(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device);
};

// The host drivers (deform_conv2d_backward.cpp), shared by the CPU and CUDA kernels.
at::Tensor deform_conv2d_grad_input_with(const DeformLaunches& launches, const at::Tensor& columns,
                                         const at::Tensor& offset, const at::Tensor& mask, int64_t height,
                                         int64_t width, int64_t kernel_h, int64_t kernel_w, int64_t stride_h,
                                         int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                                         int64_t dilation_w, int64_t offset_groups, bool use_mask);

std::tuple<at::Tensor, at::Tensor> deform_conv2d_sample_grads_with(
    const DeformLaunches& launches, at::Tensor& columns, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& mask, int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w, int64_t pad_h,
    int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t offset_groups, bool use_mask);

}  // namespace deepep_lightning::roi
