// The CPU helpers of fixed_point_sum.h.
#include "fixed_point_sum.h"

#include <ATen/Dispatch.h>

#include <cmath>
#include <cstring>

namespace deepep_lightning::fixed_point {

void max_finite_abs_cpu(const at::Tensor& values, at::Tensor& max_bits) {
  float largest = 0.0f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "max_finite_abs_cpu", [&] {
    const scalar_t* data = values.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < values.numel(); ++i) {
      const float value = std::fabs(static_cast<float>(data[i]));
      if (std::isfinite(value) && value > largest) largest = value;
    }
  });
  int32_t bits = 0;
  std::memcpy(&bits, &largest, sizeof(bits));
  max_bits.fill_(bits);
}

float max_finite_abs_of(const at::Tensor& max_bits) {
  const int32_t bits = max_bits.const_data_ptr<int32_t>()[0];
  float largest = 0.0f;
  std::memcpy(&largest, &bits, sizeof(largest));
  return largest;
}

}  // namespace deepep_lightning::fixed_point
