// head_dim_qk != head_dim_vo on a CUDA device (issue 34 item 2): the CUDA kernels serve only the
// equal case, so planning another pair is Error(kUnsupported) naming options.head_dim_vo for
// every op, before anything is launched; the equal pair given explicitly plans as 0 does.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/gpu_test_support.hpp"
#include "common/validation_fixture.hpp"
#include "tessera/tessera.hpp"

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

TEST(CudaHeadDimVo, OtherPairsAreUnsupportedByName) {
  TESSERA_SKIP_WITHOUT_GPU();
  const Device gpu{DeviceType::kCUDA, 0};
  const std::vector<int32_t> qo{0, 3, 5}, kv{0, 40, 70}, pages{0, 3, 5}, last{8, 6};
  for (int32_t vo : {64, 512}) {
    AttentionOptions options;
    options.head_dim_vo = vo;
    EXPECT_TRUE(
        test::fails_with([&] { (void)plan_ragged_prefill(qo, kv, 8, 2, 192, options, gpu); },
                         Error::Kind::kUnsupported, "'options.head_dim_vo'"));
    EXPECT_TRUE(test::fails_with(
        [&] { (void)plan_paged_prefill(qo, pages, last, 16, 8, 2, 128, options, gpu); },
        Error::Kind::kUnsupported, "'options.head_dim_vo'"));
    EXPECT_TRUE(
        test::fails_with([&] { (void)plan_decode(pages, last, 16, 8, 2, 128, options, gpu); },
                         Error::Kind::kUnsupported, "'options.head_dim_vo'"));
  }
  AttentionOptions equal;
  equal.head_dim_vo = 128;
  const Plan plan = plan_decode(pages, last, 16, 8, 2, 128, equal, gpu);
  const Plan same = plan_decode(pages, last, 16, 8, 2, 128, {}, gpu);
  EXPECT_EQ(plan.head_dim_v(), 128);
  EXPECT_EQ(plan.workspace_bytes, same.workspace_bytes);
  EXPECT_EQ(plan.kernel, same.kernel);
}

#else

TEST(CudaHeadDimVo, NeedsTheCudaBackend) {
  GTEST_SKIP() << "built without the CUDA backend";
}

#endif

}  // namespace
}  // namespace tessera
