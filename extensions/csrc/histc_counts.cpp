// deepep_lightning::histc_counts: how many elements of `self` fall in each of `bins` equal bins over [low, high].
//
//   histc_counts(self, bins, low, high) -> int64 [bins]
//
// The bin of an element is PyTorch's (histc_bin in histc_counts.h); elements outside [low, high] and NaN
// are not counted. The counts are integers, and integer addition is exact in any order, so the CUDA
// kernel may add with atomics and stay bitwise reproducible: what makes PyTorch's floating-point histc
// refuse deterministic mode is its float atomicAdd, not the atomics. The caller casts the counts to the
// input's dtype. The Python layer (deepep_lightning/ops/histograms.py) resolves the range (min == max
// takes the data's) and validates before this op runs (DESIGN.md section 7); the checks here guard
// direct torch.ops callers.
#include "histc_counts.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>

namespace deepep_lightning {

void check_histc_counts_inputs(const at::Tensor& self, int64_t bins, double low, double high) {
  const char* op = "deepep_lightning::histc_counts";
  TORCH_CHECK(at::isFloatingType(self.scalar_type()), op, ": self must be floating point, got ",
              self.scalar_type());
  TORCH_CHECK(bins > 0, op, ": bins must be > 0, got ", bins);
  TORCH_CHECK(std::isfinite(low) && std::isfinite(high) && low < high, op,
              ": the range must be finite with low < high, got [", low, ", ", high, "]");
}

namespace {

at::Tensor histc_counts_cpu(const at::Tensor& self, int64_t bins, double low, double high) {
  check_histc_counts_inputs(self, bins, low, high);
  const at::Tensor values = self.contiguous();
  at::Tensor counts = at::zeros({bins}, values.options().dtype(at::kLong));
  int64_t* c = counts.data_ptr<int64_t>();
  const int64_t n = values.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "histc_counts_cpu", [&] {
    using acc_t = histc_acc_t<scalar_t>;
    const scalar_t* v = values.data_ptr<scalar_t>();
    const acc_t lo = static_cast<acc_t>(low), hi = static_cast<acc_t>(high);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t bin = histc_bin<acc_t>(static_cast<acc_t>(v[i]), lo, hi, bins);
      if (bin >= 0) ++c[bin];
    }
  });
  return counts;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepep_lightning, m) { m.def("histc_counts(Tensor self, int bins, float low, float high) -> Tensor"); }

TORCH_LIBRARY_IMPL(deepep_lightning, CPU, m) { m.impl("histc_counts", &histc_counts_cpu); }

}  // namespace deepep_lightning
