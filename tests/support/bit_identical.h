// Two training runs compared bit for bit: each step's loss, verdict, scale and gradient norm (as
// the float the logs show: the sharded steps sum the norm's segments in another order, whose
// doubles may differ in the last bits), the model file and every checkpoint section. For any
// record with .fit (train::FitResult), .model_bin and .checkpoint (section name -> bytes);
// `what` names the case in failures.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace replica::testing {

inline uint32_t float_bits(double v) {
  const float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

template <typename Run>
void expect_bit_identical(const Run& a, const Run& b, const std::string& what) {
  ASSERT_EQ(a.fit.history.size(), b.fit.history.size()) << what;
  for (size_t i = 0; i < a.fit.history.size(); ++i) {
    const auto &x = a.fit.history[i], &y = b.fit.history[i];
    EXPECT_EQ(x.loss, y.loss) << what << " step " << i + 1;
    EXPECT_EQ(x.applied, y.applied) << what << " step " << i + 1;
    EXPECT_EQ(x.scale, y.scale) << what << " step " << i + 1;
    if (x.applied) {  // a skipped step's norm is inf or NaN (an overflow): not a number to compare
      EXPECT_EQ(float_bits(x.grad_norm), float_bits(y.grad_norm)) << what << " step " << i + 1 << ": grad norm";
    }
  }
  EXPECT_TRUE(a.model_bin == b.model_bin) << what << ": model.bin differs";
  ASSERT_EQ(a.checkpoint.size(), b.checkpoint.size()) << what;
  for (const auto& [name, bytes] : a.checkpoint) {
    ASSERT_TRUE(b.checkpoint.count(name)) << what << ": no section " << name;
    EXPECT_TRUE(b.checkpoint.at(name) == bytes) << what << ": checkpoint section '" << name << "' differs";
  }
}

}  // namespace replica::testing
