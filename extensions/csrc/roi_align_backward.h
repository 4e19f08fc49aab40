// deepep_lightning::roi_align_backward: the host side shared by the CPU and CUDA
// kernels (roi_align_backward.cpp, cuda/roi_align_backward.cu). The math is in roi_csr_gather.h; a device
// supplies the launches.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "roi_csr_gather.h"

namespace deepep_lightning::roi {

using GatherLaunch = void (*)(const at::Tensor& offsets, const at::Tensor& order, const at::Tensor& sources,
                              const at::Tensor& weights, const at::Tensor& grad, const GatherArgs& args,
                              at::Tensor& out);

// The device-specific steps of roi_align_backward_with.
struct RoiAlignLaunches {
  // Writes sample_offsets[r + 1] = samples of RoI r (adaptive sampling only).
  void (*sample_counts)(const at::Tensor& rois, double spatial_scale, const RoiAlignArgs& args,
                        at::Tensor& sample_offsets);
  // Step 1 for the global samples [first, first + count) into keys/sources/weights [4 * count].
  void (*entries)(int64_t first, int64_t count, const at::Tensor& rois, const at::Tensor& sample_offsets,
                  double spatial_scale, const RoiAlignArgs& args, at::Tensor& keys, at::Tensor& sources,
                  at::Tensor& weights);
  // Step 4 over every (destination, channel group).
  GatherLaunch gather;
  // An uninitialised tensor (every element is written before it is read).
  at::Tensor (*empty)(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device);
};

// Step 4 on each device (roi_align_backward.cpp, cuda/roi_align_backward.cu).
void csr_gather_cpu(const at::Tensor& offsets, const at::Tensor& order, const at::Tensor& sources,
                    const at::Tensor& weights, const at::Tensor& grad, const GatherArgs& args, at::Tensor& out);
void csr_gather_cuda(const at::Tensor& offsets, const at::Tensor& order, const at::Tensor& sources,
                     const at::Tensor& weights, const at::Tensor& grad, const GatherArgs& args, at::Tensor& out);

// Steps 2-4 for one chunk of entries: stable sort of keys (in [0, destinations], destinations the sentinel),
// CSR offsets of every destination, the gather into out.
void sort_and_gather(const at::Tensor& keys, const at::Tensor& sources, const at::Tensor& weights,
                     int64_t destinations, const at::Tensor& grad, const GatherArgs& args, GatherLaunch gather,
                     at::Tensor& out);

// Steps 1-4 of roi_csr_gather.h in chunks of at most max_chunk_samples(...) samples, the chunks' sums added
// in chunk order.
at::Tensor roi_align_backward_with(const RoiAlignLaunches& launches, const at::Tensor& grad, const at::Tensor& rois,
                                   double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                                   int64_t batch_size, int64_t channels, int64_t height, int64_t width,
                                   int64_t sampling_ratio, bool aligned);

}  // namespace deepep_lightning::roi
