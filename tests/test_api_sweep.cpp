// The user's path: random cases through the public plan/run API with the real planner, on the
// CPU (always) and on the GPU (when present), compared with the double-precision oracle.
#include <gtest/gtest.h>

#include <random>

#include "common/api_runner.hpp"
#include "tessera/backend.hpp"

namespace tessera::test {
namespace {

void sweep(Device device, int num_cases, uint64_t seed) {
  std::mt19937_64 rng(seed);
  RandomCaseOptions limits;
  if (device.type == DeviceType::kCUDA) {
    limits.q_dtypes = {DType::kFloat16, DType::kBFloat16};
    limits.allow_fp8_kv = false;  // fp8 KV: decode only (covered by the decode tests)
  }
  for (int i = 0; i < num_cases; ++i) {
    AttentionCase test_case = random_case(rng, limits);
    if (device.type == DeviceType::kCUDA && op_of(test_case) != AttentionOp::kDecode) {
      // CUDA prefill copies 16-byte rows: strides must be multiples of 8 elements (what any
      // framework's tensors with head_dim % 8 == 0 have). Unaligned views are rejected with a
      // clear error (CudaPrefill.RejectsStridesThatAreNotMultiplesOf8); decode takes any.
      for (int32_t* pad : {&test_case.q_head_pad, &test_case.q_token_pad, &test_case.o_head_pad,
                           &test_case.o_token_pad, &test_case.kv_head_pad,
                           &test_case.kv_token_pad}) {
        *pad = (*pad + 7) / 8 * 8;
      }
    }
    AttentionBuffers buffers = make_buffers(test_case, rng);
    const Outputs expected = run_reference(buffers);
    const Outputs actual = run_through_api(buffers, device);
    const Comparison result = compare_outputs(buffers, actual, expected);
    ASSERT_TRUE(
        result.ok(default_tolerance(test_case), default_lse_tolerance(test_case)))
        << "case " << i << ": " << test_case.describe() << "\n"
        << result.describe();
  }
}

TEST(ApiSweep, CpuRandomCasesMatchTheReference) { sweep(Device{DeviceType::kCPU, 0}, 250, 91); }

TEST(ApiSweep, CpuSingleThreadGivesTheSameAnswers) {
  const int saved = num_threads();
  set_num_threads(1);
  sweep(Device{DeviceType::kCPU, 0}, 40, 92);
  set_num_threads(saved);
}

TEST(ApiSweep, CudaRandomCasesMatchTheReference) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
  sweep(Device{DeviceType::kCUDA, 0}, 300, 93);
}

}  // namespace
}  // namespace tessera::test
