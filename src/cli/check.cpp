#include "cli/check.hpp"

#include <cstdio>
#include <iostream>
#include <random>

#include "cli/bench.hpp"
#include "common/api_runner.hpp"
#include "tessera/backend.hpp"

namespace tessera::cli {

int run_check(const CheckOptions& options) {
  const Device device = resolve_backend(options.backend);
  std::cout << "tessera check: " << describe_device(device) << ", " << options.num_configs
            << " random configurations (seed " << options.seed << ") vs the double reference\n";
  std::mt19937_64 rng(options.seed);
  test::RandomCaseOptions limits;
  if (device.type == DeviceType::kCUDA) {
    // The CUDA kernels serve fp16/bf16 q with K/V of the same dtype (decode also takes fp8).
    limits.q_dtypes = {DType::kFloat16, DType::kBFloat16};
    limits.allow_fp8_kv = false;
  }
  int failures = 0;
  for (int i = 0; i < options.num_configs; ++i) {
    test::AttentionCase test_case = test::random_case(rng, limits);
    test::AttentionBuffers buffers = test::make_buffers(test_case, rng);
    const test::Outputs expected = test::run_reference(buffers);
    std::string verdict;
    try {
      const test::Outputs actual = test::run_through_api(buffers, device);
      const test::Comparison result = test::compare_outputs(buffers, actual, expected);
      if (!result.ok(test::default_tolerance(test_case), test::default_lse_tolerance(test_case))) {
        verdict = "WRONG: " + result.describe();
      }
    } catch (const std::exception& error) {
      verdict = std::string("ERROR: ") + error.what();
    }
    if (!verdict.empty()) {
      ++failures;
      std::cout << "[" << i << "] " << test_case.describe() << "\n    " << verdict << "\n";
    }
    if ((i + 1) % 25 == 0) std::cerr << "  " << i + 1 << "/" << options.num_configs << "\n";
  }
  std::printf("%d passed, %d failed\n", options.num_configs - failures, failures);
  return failures ? 1 : 0;
}

}  // namespace tessera::cli
