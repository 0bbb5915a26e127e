// head_dim_qk != head_dim_vo through the C ABI: tessera_plan_options (extensible by
// struct_size) and the *_v2 plan calls. Each op planned with head_dim_vo 16 (the fixture's
// head_dim is 32) runs on v / v_cache / o of width 16 and agrees with the C++ API; the one-shot
// calls take the width from v; tessera_plan_head_dim_vo reports it; a struct_size that predates
// the field reads none (equal widths), and bad widths or a zero struct_size fail by name.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/capi_fixture.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace {

using namespace tessera::test::capi;

constexpr int kVo = 16;

class CApiHeadDimVoTest : public CApiTest {
 protected:
  void SetUp() override {
    CApiTest::SetUp();
    v_narrow.fill_pattern(7);
    v_cache_narrow.fill_pattern(8);
    for (HostTensor* output : {&o_narrow, &o_decode_narrow}) output->fill(kSentinel);
    tessera_plan_options_default(&plan_options);
    plan_options.head_dim_vo = kVo;
  }
  tessera_paged_kv narrow_kv() {
    tessera_paged_kv kv = paged_kv();
    kv.v_cache = v_cache_narrow.dl();
    return kv;
  }
  tessera::PagedKVCache narrow_kv_cpp() {
    tessera::PagedKVCache cache = paged_kv_cpp();
    cache.v_cache = v_cache_narrow.view();
    return cache;
  }
  tessera_status plan(int op, const tessera_plan_options* extra, tessera_plan** out) {
    if (op == 0) {
      return tessera_plan_ragged_prefill_v2(qo_indptr_host.data(), kv_indptr_host.data(), kBatch,
                                            kQoHeads, kKvHeads, kHeadDim, &options, extra, kDLCPU,
                                            0, out);
    }
    if (op == 1) {
      return tessera_plan_paged_prefill_v2(qo_indptr_host.data(), page_indptr_host.data(),
                                           last_page_len_host.data(), kBatch, kPageSize, kQoHeads,
                                           kKvHeads, kHeadDim, &options, extra, kDLCPU, 0, out);
    }
    return tessera_plan_decode_v2(page_indptr_host.data(), last_page_len_host.data(), kBatch,
                                  kPageSize, kQoHeads, kKvHeads, kHeadDim, kQPerRequest, &options,
                                  extra, kDLCPU, 0, out);
  }
  tessera_status run(int op, const tessera_plan* p, HostTensor& out, HostTensor& out_lse) {
    std::vector<unsigned char> workspace(tessera_plan_workspace_bytes(p) + 1);
    const tessera_paged_kv kv = narrow_kv();
    if (op == 0) {
      return tessera_run_ragged_prefill(p, q.dl(), k.dl(), v_narrow.dl(), qo_indptr.dl(),
                                        kv_indptr.dl(), out.dl(), out_lse.dl(), workspace.data(),
                                        workspace.size(), nullptr);
    }
    if (op == 1) {
      return tessera_run_paged_prefill(p, q.dl(), &kv, qo_indptr.dl(), out.dl(), out_lse.dl(),
                                       workspace.data(), workspace.size(), nullptr);
    }
    return tessera_run_decode(p, q_decode.dl(), &kv, out.dl(), out_lse.dl(), workspace.data(),
                              workspace.size(), nullptr);
  }
  // The C++ API's answer (one-shot calls take the width from v).
  void cpp(int op, HostTensor& out, HostTensor& out_lse) {
    if (op == 0) {
      tessera::ragged_prefill(q.view(), k.view(), v_narrow.view(), qo_indptr.view(),
                              kv_indptr.view(), out.view(), out_lse.view(), options_cpp());
    } else if (op == 1) {
      tessera::paged_prefill(q.view(), narrow_kv_cpp(), qo_indptr.view(), out.view(),
                             out_lse.view(), options_cpp());
    } else {
      tessera::decode(q_decode.view(), narrow_kv_cpp(), out.view(), out_lse.view(), options_cpp());
    }
  }
  HostTensor& out_of(int op) { return op == 2 ? o_decode_narrow : o_narrow; }
  HostTensor& lse_of(int op) { return op == 2 ? lse_decode : lse; }

  HostTensor v_narrow{{kTotalKv, kKvHeads, kVo}, kF32};
  HostTensor v_cache_narrow{{kNumPages, kPageSize, kKvHeads, kVo}, kF32};
  HostTensor o_narrow{{kTotalQ, kQoHeads, kVo}, kF32};
  HostTensor o_decode_narrow{{kBatch * kQPerRequest, kQoHeads, kVo}, kF32};
  tessera_plan_options plan_options{};
};

TEST(CApiHeadDimVoInfo, PlanOptionsDefault) {
  tessera_plan_options plan_options;
  std::memset(&plan_options, 0x5a, sizeof(plan_options));
  tessera_plan_options_default(&plan_options);
  EXPECT_EQ(plan_options.struct_size, sizeof(tessera_plan_options));
  EXPECT_EQ(plan_options.head_dim_vo, 0);
  tessera_plan_options_default(nullptr);  // a no-op
  EXPECT_EQ(tessera_plan_head_dim_vo(nullptr), 0);
}

TEST_F(CApiHeadDimVoTest, V2PlansMatchCpp) {
  for (int op = 0; op < 3; ++op) {
    tessera_plan* p = nullptr;
    ASSERT_EQ(plan(op, &plan_options, &p), TESSERA_OK) << tessera_last_error();
    EXPECT_EQ(tessera_plan_head_dim_vo(p), kVo);
    HostTensor out = out_of(op), out_lse = lse_of(op);
    ASSERT_EQ(run(op, p, out, out_lse), TESSERA_OK) << tessera_last_error();
    tessera_plan_destroy(p);
    HostTensor expected = out_of(op), expected_lse = lse_of(op);
    cpp(op, expected, expected_lse);
    expect_close(out, expected, 0.0f);
    expect_close(out_lse, expected_lse, 0.0f);
    EXPECT_NE(out.get(0), kSentinel) << "op " << op;
  }
}

// NULL plan options and a struct that ends before head_dim_vo both plan equal widths: the narrow
// tensors are then rejected at run time, by name (o is checked before v).
TEST_F(CApiHeadDimVoTest, OlderStructSizeAndNullPlanEqualWidths) {
  tessera_plan_options older = plan_options;
  older.struct_size = sizeof(size_t);
  for (const tessera_plan_options* extra : {static_cast<const tessera_plan_options*>(nullptr),
                                            static_cast<const tessera_plan_options*>(&older)}) {
    tessera_plan* p = nullptr;
    ASSERT_EQ(plan(0, extra, &p), TESSERA_OK) << tessera_last_error();
    EXPECT_EQ(tessera_plan_head_dim_vo(p), kHeadDim);
    HostTensor out = o_narrow, out_lse = lse;
    expect_failure(run(0, p, out, out_lse), TESSERA_ERROR_INVALID_ARGUMENT, "o");
    EXPECT_EQ(out.bytes(), o_narrow.bytes()) << "a rejected run wrote o";
    tessera_plan_destroy(p);
  }
}

TEST_F(CApiHeadDimVoTest, BadWidthsAndStructSizesFailByName) {
  for (int32_t bad : {4, 12, 520}) {
    tessera_plan_options wrong = plan_options;
    wrong.head_dim_vo = bad;
    for (int op = 0; op < 3; ++op) {
      tessera_plan* p = nullptr;
      expect_failure(plan(op, &wrong, &p), TESSERA_ERROR_INVALID_ARGUMENT, "options.head_dim_vo");
      EXPECT_EQ(p, nullptr);
    }
  }
  tessera_plan_options zero = plan_options;
  zero.struct_size = 0;
  tessera_plan* p = nullptr;
  expect_failure(plan(2, &zero, &p), TESSERA_ERROR_INVALID_ARGUMENT, "plan_options");
  EXPECT_EQ(p, nullptr);
}

}  // namespace
