// Deterministic CUDA segment_scatter_add (schema and CPU kernel: ../segment_scatter.cpp).
//
// out[o, r, c] = base[o, r, c] + alpha * sum over i with index[i] == r of src[o, i, c], for src viewed as
// [outer, n, inner] and out as [outer, size, inner]. PyTorch's index_add_ / scatter_add_ / argmax pool
// backwards add with float atomicAdd (run-to-run different last bits); here, with no float atomics:
//   1. one thread per entry i writes its key index[i] (asserted in [0, size)) and its id i;
//   2. a stable LSD radix sort (cub, only the bits a key in [0, size) can use) orders the ids by key;
//      equal keys keep entry order, so the sorted order is a function of index alone;
//   3. a binary search per output row r gives its segment [start, end) of the sorted entries;
//      steps 1-3 are index's sort plan (segment_sort_plan): a caller that passes one skips them;
//   4. a segment of L entries splits into L / K full chunks of K sorted entries from its own start and
//      a tail of L % K; one thread per (chunk, o, c) sums its chunk in sorted order, in double, into the
//      fixed slot chunk_start / K (full chunks are disjoint runs of K entries: no two share a slot);
//   5. one thread per (o, r, c) adds its segment's chunk sums in chunk order, then the tail's terms in
//      sorted order, in double, and writes base + alpha * sum once (every output element is written).
// Why deterministic whatever the launch configuration: which terms a sum holds and their order are a
// function of index and of the shapes only (the chunks start at each segment's own start, so entries
// of other rows do not move them); threads and blocks change who adds, never the order. K is a
// function of the shapes (n / size): 32, or more for long mean segments (one hot row must not
// serialise the kernel: K ~ sqrt(mean segment length) balances the chunk pass against the row pass).
//
// Outputs and scratch come from at::detail::empty_cuda (at::empty NaN-fills new memory in
// deterministic mode; every byte here is written before it is read). All work is on the current
// stream; nothing synchronises, no allocation size depends on data (CUDA-graph capturable).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <cub/device/device_radix_sort.cuh>

#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace deepep_lightning {

// Defined in ../segment_scatter.cpp.
std::vector<int64_t> segment_scatter_output_shape(const at::Tensor& src, const at::Tensor& index, int64_t size,
                                                  int64_t dim, const std::optional<at::Tensor>& base);
void check_sort_plan(const std::optional<at::Tensor>& plan, const at::Tensor& index, int64_t size);

namespace {

constexpr int kThreads = 256;
constexpr size_t kScratchAlignment = 256;
constexpr int kUnroll = 4;

template <typename index_t>
__global__ void segment_key_kernel(const int32_t num_entries, const int64_t size, const index_t* __restrict__ index,
                                   uint32_t* __restrict__ keys, int32_t* __restrict__ ids) {
  const int32_t i = static_cast<int32_t>(blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x);
  if (i >= num_entries) return;
  const int64_t key = static_cast<int64_t>(index[i]);
  CUDA_KERNEL_ASSERT(key >= 0 && key < size && "segment_scatter_add: index out of range");
  keys[i] = static_cast<uint32_t>(key);
  ids[i] = i;
}

// segment_start[r] = first j with sorted_keys[j] >= r, r in [0, size].
__global__ void segment_start_kernel(const int32_t num_entries, const int64_t size,
                                     const uint32_t* __restrict__ sorted_keys, int32_t* __restrict__ segment_start) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r > size) return;
  int32_t low = 0, high = num_entries;
  while (low < high) {
    const int32_t mid = low + (high - low) / 2;
    if (static_cast<int64_t>(sorted_keys[mid]) < r) low = mid + 1; else high = mid;
  }
  segment_start[r] = low;
}

// One thread per (slot, o, c), c fastest. Slot b covers sorted entries [b K, (b + 1) K); the full chunk
// that starts in it, if any, belongs to the segment of the slot's first entry (a segment starting at or
// before b K) or, starting later in the slot, to the segment of its last entry (a full chunk starting
// inside the slot covers the slot's last entry). Slots without a chunk are left unwritten; the row
// pass never reads them.
template <typename scalar_t>
__global__ void segment_chunk_kernel(const int64_t num_items, const int64_t outer_inner, const int64_t inner,
                                     const int64_t num_entries, const int32_t chunk_size,
                                     const uint32_t* __restrict__ sorted_keys,   // [n]
                                     const int32_t* __restrict__ segment_start,  // [size + 1]
                                     const int32_t* __restrict__ order,          // [n] entry ids sorted by key
                                     const scalar_t* __restrict__ src,           // [outer, n, inner]
                                     double* __restrict__ partials) {            // [n / K, outer, inner]
  const int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (item >= num_items) return;
  const int64_t slot = item / outer_inner;
  const int64_t within = item - slot * outer_inner;  // o * inner + c
  const int64_t o = within / inner;
  const int64_t c = within - o * inner;
  const int32_t slot_begin = static_cast<int32_t>(slot * chunk_size);
  int32_t chunk = -1;
  {
    const uint32_t key = sorted_keys[slot_begin];
    const int32_t s = segment_start[key];
    const int32_t j = s + (slot_begin - s + chunk_size - 1) / chunk_size * chunk_size;
    if (j + chunk_size <= segment_start[key + 1]) chunk = j;
  }
  if (chunk < 0) {
    const uint32_t key = sorted_keys[slot_begin + chunk_size - 1];
    const int32_t s = segment_start[key];
    if (s > slot_begin && s + chunk_size <= segment_start[key + 1]) chunk = s;
  }
  if (chunk < 0) return;
  const scalar_t* src_o = src + o * num_entries * inner + c;
  double acc = 0;
#pragma unroll 8
  for (int32_t k = 0; k < chunk_size; ++k) {
    acc += static_cast<double>(src_o[static_cast<int64_t>(order[chunk + k]) * inner]);
  }
  partials[slot * outer_inner + within] = acc;
}

// One thread per (o, r, c), c fastest: coalesced stores, and the threads of one row share its bounds.
template <typename scalar_t>
__global__ void segment_row_kernel(const int64_t num_items, const int64_t size, const int64_t inner,
                                   const int64_t num_entries, const int32_t chunk_size,
                                   const int32_t* __restrict__ segment_start,  // [size + 1]
                                   const int32_t* __restrict__ order,          // [n]
                                   const scalar_t* __restrict__ src,           // [outer, n, inner]
                                   const double* __restrict__ partials,        // [n / K, outer, inner]
                                   const scalar_t* base,  // [outer, size, inner] or nullptr; may be out
                                   const double alpha, const int64_t outer_inner,
                                   scalar_t* out) {       // [outer, size, inner]
  const int64_t item = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (item >= num_items) return;
  const int64_t size_inner = size * inner;
  const int64_t o = item / size_inner;
  const int64_t rc = item - o * size_inner;
  const int64_t r = rc / inner;
  const int64_t c = rc - r * inner;
  const int32_t begin = segment_start[r], end = segment_start[r + 1];
  const int32_t full_chunks = (end - begin) / chunk_size;
  double acc = 0;
  // Full chunks in chunk order (chunk m starts in slot begin / K + m).
  const double* sums = partials + static_cast<int64_t>(begin / chunk_size) * outer_inner + o * inner + c;
  int32_t m = 0;
  for (; m + kUnroll <= full_chunks; m += kUnroll) {
    double values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) values[u] = sums[(m + u) * outer_inner];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc += values[u];
  }
  for (; m < full_chunks; ++m) acc += sums[m * outer_inner];
  // The tail, entry by entry in sorted order.
  const scalar_t* src_o = src + o * num_entries * inner + c;
  int32_t j = begin + full_chunks * chunk_size;
  for (; j + kUnroll <= end; j += kUnroll) {
    scalar_t values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) values[u] = src_o[static_cast<int64_t>(order[j + u]) * inner];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc += static_cast<double>(values[u]);
  }
  for (; j < end; ++j) acc += static_cast<double>(src_o[static_cast<int64_t>(order[j]) * inner]);
  const double start = base == nullptr ? 0.0 : static_cast<double>(base[item]);
  out[item] = static_cast<scalar_t>(start + alpha * acc);
}

unsigned int blocks_for(int64_t count) { return static_cast<unsigned int>((count + kThreads - 1) / kThreads); }

at::Tensor empty_unfilled(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, device, std::nullopt));
}

struct ScratchLayout {
  size_t total = 0;
  size_t add(size_t bytes) {
    const size_t offset = total;
    total += (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
    return offset;
  }
};

// K: 32 sorted entries per chunk, or the power of two nearest above sqrt(mean segment length) when
// segments are long (at most 1024). A function of the shapes only.
int32_t chunk_size_for(int64_t num_entries, int64_t size) {
  const double mean = static_cast<double>(num_entries) / static_cast<double>(size > 0 ? size : 1);
  int32_t chunk = 32;
  while (chunk < 1024 && static_cast<double>(chunk) * chunk < mean) chunk *= 2;
  return chunk;
}

// Writes index's sort plan into plan (int32 [2 n + size + 1], layout in ../segment_scatter.cpp): the keys
// (asserted in [0, size)) sorted stably with their entry ids, then each row's first sorted position.
void sort_into_plan(const at::Tensor& index, int64_t size, int32_t* plan, cudaStream_t stream) {
  const int64_t num_entries = index.numel();
  const at::Tensor index_c = index.contiguous();
  const int32_t entries = static_cast<int32_t>(num_entries);
  int end_bit = 1;
  while (end_bit < 32 && (static_cast<uint64_t>(size - 1) >> end_bit) != 0) ++end_bit;
  auto* sorted_keys = reinterpret_cast<uint32_t*>(plan);
  int32_t* order = plan + num_entries;
  int32_t* segment_start = plan + 2 * num_entries;
  if (num_entries > 0) {
    size_t sort_bytes = 0;
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                                   sorted_keys, static_cast<const int32_t*>(nullptr), order, entries,
                                                   0, end_bit, stream));
    ScratchLayout layout;
    const size_t keys_at = layout.add(sizeof(uint32_t) * num_entries);
    const size_t ids_at = layout.add(sizeof(int32_t) * num_entries);
    const size_t sort_at = layout.add(sort_bytes);
    const at::Tensor scratch = empty_unfilled({static_cast<int64_t>(layout.total)}, at::kByte, index.device());
    auto* bytes = static_cast<unsigned char*>(scratch.data_ptr());
    auto* keys = reinterpret_cast<uint32_t*>(bytes + keys_at);
    auto* ids = reinterpret_cast<int32_t*>(bytes + ids_at);
    AT_DISPATCH_INDEX_TYPES(index_c.scalar_type(), "segment_sort_plan_keys", [&] {
      segment_key_kernel<index_t><<<blocks_for(num_entries), kThreads, 0, stream>>>(
          entries, size, index_c.data_ptr<index_t>(), keys, ids);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(bytes + sort_at, sort_bytes, keys, sorted_keys, ids, order,
                                                   entries, 0, end_bit, stream));
  }
  segment_start_kernel<<<blocks_for(size + 1), kThreads, 0, stream>>>(entries, size, sorted_keys, segment_start);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out = base + alpha * (the sums of src's entries by index), out contiguous of the output shape. base is
// undefined (zeros) or contiguous of that shape; it may be out itself (each output element reads its own base
// element, then writes it) but src must not overlap out. plan is index's sort plan or undefined (sorted here).
// Checked by the callers.
void segment_scatter_add_into(const at::Tensor& src, const at::Tensor& index, int64_t size, int64_t dim,
                              const at::Tensor& base_c, double alpha, const at::Tensor& plan, at::Tensor& out) {
  const int64_t num_entries = src.size(dim);
  TORCH_CHECK(num_entries < INT_MAX && size < static_cast<int64_t>(UINT32_MAX),
              "segment_scatter_add: src.size(dim) must be below 2^31 - 1 and size below 2^32 - 1, got ",
              num_entries, " and ", size);
  if (out.numel() == 0) return;
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= src.size(d);
  for (int64_t d = dim + 1; d < src.dim(); ++d) inner *= src.size(d);
  if (num_entries == 0) {  // nothing to add: out = base
    if (!base_c.defined()) {
      out.zero_();
    } else if (!base_c.is_same(out)) {
      out.copy_(base_c);
    }
    return;
  }
  const at::Tensor src_c = src.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int32_t chunk_size = chunk_size_for(num_entries, size);
  const int64_t num_slots = num_entries / chunk_size;
  const int64_t outer_inner = outer * inner;

  at::Tensor own_plan;
  if (!plan.defined()) {
    own_plan = empty_unfilled({2 * num_entries + size + 1}, at::kInt, src.device());
    sort_into_plan(index, size, own_plan.data_ptr<int32_t>(), stream);
  }
  const int32_t* sorted = plan.defined() ? plan.data_ptr<int32_t>() : own_plan.data_ptr<int32_t>();
  const auto* sorted_keys = reinterpret_cast<const uint32_t*>(sorted);
  const int32_t* order = sorted + num_entries;
  const int32_t* segment_start = sorted + 2 * num_entries;
  at::Tensor partials;
  if (num_slots > 0) partials = empty_unfilled({num_slots * outer_inner}, at::kDouble, src.device());

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src_c.scalar_type(), "segment_scatter_add_cuda", [&] {
    const scalar_t* src_data = src_c.data_ptr<scalar_t>();
    double* partial_data = num_slots > 0 ? partials.data_ptr<double>() : nullptr;
    if (num_slots > 0) {
      const int64_t chunk_items = num_slots * outer_inner;
      segment_chunk_kernel<scalar_t><<<blocks_for(chunk_items), kThreads, 0, stream>>>(
          chunk_items, outer_inner, inner, num_entries, chunk_size, sorted_keys, segment_start, order, src_data,
          partial_data);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const int64_t row_items = out.numel();
    segment_row_kernel<scalar_t><<<blocks_for(row_items), kThreads, 0, stream>>>(
        row_items, size, inner, num_entries, chunk_size, segment_start, order, src_data, partial_data,
        base_c.defined() ? base_c.data_ptr<scalar_t>() : nullptr, alpha, outer_inner, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor segment_sort_plan_cuda(const at::Tensor& index, int64_t size) {
  TORCH_CHECK(index.is_cuda() && index.dim() == 1 &&
                  (index.scalar_type() == at::kLong || index.scalar_type() == at::kInt),
              "segment_sort_plan: index must be a 1-D int64 or int32 CUDA tensor, got ", index.scalar_type(), " ",
              index.sizes(), " on ", index.device());
  TORCH_CHECK(size >= 0 && size < INT_MAX && index.numel() < INT_MAX,
              "segment_sort_plan: size and index.numel() must be below 2^31 - 1, got ", size, " and ", index.numel());
  const c10::cuda::CUDAGuard device_guard(index.device());
  at::Tensor plan = empty_unfilled({2 * index.numel() + size + 1}, at::kInt, index.device());
  sort_into_plan(index, size, plan.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream());
  return plan;
}

at::Tensor segment_scatter_add_cuda(const at::Tensor& src, const at::Tensor& index, int64_t size, int64_t dim,
                                    const std::optional<at::Tensor>& base, double alpha,
                                    const std::optional<at::Tensor>& plan) {
  const std::vector<int64_t> shape = segment_scatter_output_shape(src, index, size, dim, base);
  check_sort_plan(plan, index, size);
  TORCH_CHECK(src.is_cuda(), "segment_scatter_add: src must be a CUDA tensor, got ", src.device());
  const c10::cuda::CUDAGuard device_guard(src.device());
  at::Tensor out = empty_unfilled(shape, src.scalar_type(), src.device());
  segment_scatter_add_into(src, index, size, dim, base.has_value() ? base->contiguous() : at::Tensor(), alpha,
                           plan.value_or(at::Tensor()), out);
  return out;
}

// self += alpha * the sums of src's entries by index along dim: written in place where self is contiguous and src
// does not overlap it, else into a contiguous buffer copied back into self.
void segment_scatter_add_inplace_cuda(const at::Tensor& self, const at::Tensor& src, const at::Tensor& index,
                                      int64_t dim, double alpha, const std::optional<at::Tensor>& plan) {
  segment_scatter_output_shape(src, index, self.dim() > dim ? self.size(dim) : 0, dim, self);
  check_sort_plan(plan, index, self.size(dim));
  TORCH_CHECK(src.is_cuda(), "segment_scatter_add_: src must be a CUDA tensor, got ", src.device());
  const c10::cuda::CUDAGuard device_guard(src.device());
  const bool in_place = self.is_contiguous() && at::get_overlap_status(self, src) == at::MemOverlapStatus::No;
  at::Tensor out = in_place ? self : empty_unfilled(self.sizes(), self.scalar_type(), self.device());
  segment_scatter_add_into(src, index, self.size(dim), dim, in_place ? self : self.contiguous(), alpha,
                           plan.value_or(at::Tensor()), out);
  if (!in_place) self.copy_(out);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepep_lightning, CUDA, m) {
  m.impl("segment_scatter_add", &segment_scatter_add_cuda);
  m.impl("segment_scatter_add_", &segment_scatter_add_inplace_cuda);
  m.impl("segment_sort_plan", &segment_sort_plan_cuda);
}

}  // namespace deepep_lightning
