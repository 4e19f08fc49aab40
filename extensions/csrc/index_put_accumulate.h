// The shapes of deepep_lightning::index_put_accumulate_ (schema and CPU kernel: index_put_accumulate.cpp,
// CUDA kernel: cuda/segment_scatter.cu).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace deepep_lightning {

// The CUDA kernel's limits: index tensors, and dimensions of their broadcast shape.
constexpr int kMaxIndexTensors = 8;
constexpr int kMaxIndexDims = 8;

// self[indices] += values, seen as a scatter-add of n entries into rows: entry e of the broadcast index shape
// adds values_rows[e] (the values broadcast to index_shape + inner, viewed as [n, *inner]) into row
// flat(e) of self viewed as [rows, *inner], rows = prod(self.shape[:k]), inner = self.shape[k:].
struct IndexPutShape {
  std::vector<int64_t> index_shape;  // the indices broadcast together
  std::vector<int64_t> inner;        // self.shape[k:]
  int64_t entries = 1;               // prod(index_shape)
  int64_t rows = 1;                  // prod(self.shape[:k])
};

// Checks the arguments (TORCH_CHECK, naming the argument) and returns their shapes.
IndexPutShape index_put_shape(const at::Tensor& self, at::TensorList indices, const at::Tensor& values);

// values broadcast to index_shape + inner, as [entries, *inner] (a view where the layout allows).
at::Tensor index_put_rows(const IndexPutShape& shape, const at::Tensor& values);

}  // namespace deepep_lightning
