// Which implementation of the deterministic refused-ops backwards runs (grid_sample_backward.cu,
// upsample_bilinear_backward.cu): DEEPEP_REFUSED_OPS_KERNEL, read on every call so that one process
// can time both side by side (benchmarks/bench_refused_ops.py --compare-v1).
//   unset, "" or "v2": the current kernels (the default);
//   "v1": the previous kernels (*_v1.cu), kept until v2 is measured on the GPU, then deleted.
// Both are deterministic; they differ in speed and, for upsampling, in the last bits.
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace deepep {

int refused_ops_kernel_version() {
  const char* value = std::getenv("DEEPEP_REFUSED_OPS_KERNEL");
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "v2") == 0) return 2;
  TORCH_CHECK(std::strcmp(value, "v1") == 0,
              "DEEPEP_REFUSED_OPS_KERNEL must be unset, 'v1' or 'v2', got '", value, "'");
  return 1;
}

}  // namespace deepep
