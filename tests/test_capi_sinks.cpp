// Attention sinks through the C ABI: tessera_run_options (an extensible struct with a size
// field) and the *_v2 run and one-shot calls. Each v2 call with sinks agrees with the C++ API
// given the same RunOptions, with NULL options it is the v1 call, a struct_size that predates
// the sinks field reads no sinks, and bad sinks or a zero struct_size fail by name.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/capi_fixture.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace {

using namespace tessera::test::capi;

class CApiSinksTest : public CApiTest {
 protected:
  void SetUp() override {
    CApiTest::SetUp();
    for (int64_t h = 0; h < kQoHeads; ++h) sinks.set(h, 0.5f * static_cast<float>(h) - 0.75f);
    tessera_run_options_default(&run_options);
    run_options.sinks = sinks.dl();
  }
  tessera::RunOptions run_options_cpp() { return tessera::RunOptions{sinks.view()}; }

  // op 0: ragged prefill, 1: paged prefill, 2: decode; one-shot or plan + run (v2 calls).
  tessera_status call(int op, bool one_shot, HostTensor& out, HostTensor& out_lse,
                      const tessera_run_options* run) {
    const tessera_paged_kv kv = paged_kv();
    if (one_shot) {
      if (op == 0) {
        return tessera_ragged_prefill_v2(q.dl(), k.dl(), v.dl(), qo_indptr.dl(), kv_indptr.dl(),
                                         out.dl(), out_lse.dl(), &options, nullptr, run);
      }
      if (op == 1) {
        return tessera_paged_prefill_v2(q.dl(), &kv, qo_indptr.dl(), out.dl(), out_lse.dl(),
                                        &options, nullptr, run);
      }
      return tessera_decode_v2(q_decode.dl(), &kv, out.dl(), out_lse.dl(), &options, nullptr, run);
    }
    tessera_plan* plan = nullptr;
    tessera_status status =
        op == 0 ? tessera_plan_ragged_prefill(qo_indptr_host.data(), kv_indptr_host.data(), kBatch,
                                              kQoHeads, kKvHeads, kHeadDim, &options, kDLCPU, 0,
                                              &plan)
        : op == 1
            ? tessera_plan_paged_prefill(qo_indptr_host.data(), page_indptr_host.data(),
                                         last_page_len_host.data(), kBatch, kPageSize, kQoHeads,
                                         kKvHeads, kHeadDim, &options, kDLCPU, 0, &plan)
            : tessera_plan_decode(page_indptr_host.data(), last_page_len_host.data(), kBatch,
                                  kPageSize, kQoHeads, kKvHeads, kHeadDim, kQPerRequest, &options,
                                  kDLCPU, 0, &plan);
    if (status != TESSERA_OK) return status;
    std::vector<unsigned char> workspace(tessera_plan_workspace_bytes(plan) + 1);
    if (op == 0) {
      status = tessera_run_ragged_prefill_v2(plan, q.dl(), k.dl(), v.dl(), qo_indptr.dl(),
                                             kv_indptr.dl(), out.dl(), out_lse.dl(),
                                             workspace.data(), workspace.size(), nullptr, run);
    } else if (op == 1) {
      status = tessera_run_paged_prefill_v2(plan, q.dl(), &kv, qo_indptr.dl(), out.dl(),
                                            out_lse.dl(), workspace.data(), workspace.size(),
                                            nullptr, run);
    } else {
      status = tessera_run_decode_v2(plan, q_decode.dl(), &kv, out.dl(), out_lse.dl(),
                                     workspace.data(), workspace.size(), nullptr, run);
    }
    tessera_plan_destroy(plan);
    return status;
  }
  // The C++ API's answer with sinks (one-shot calls).
  void cpp(int op, HostTensor& out, HostTensor& out_lse) {
    if (op == 0) {
      tessera::ragged_prefill(q.view(), k.view(), v.view(), qo_indptr.view(), kv_indptr.view(),
                              out.view(), out_lse.view(), options_cpp(), nullptr,
                              run_options_cpp());
    } else if (op == 1) {
      tessera::paged_prefill(q.view(), paged_kv_cpp(), qo_indptr.view(), out.view(),
                             out_lse.view(), options_cpp(), nullptr, run_options_cpp());
    } else {
      tessera::decode(q_decode.view(), paged_kv_cpp(), out.view(), out_lse.view(), options_cpp(),
                      nullptr, run_options_cpp());
    }
  }
  HostTensor& out_of(int op) { return op == 2 ? o_decode : o; }
  HostTensor& lse_of(int op) { return op == 2 ? lse_decode : lse; }

  HostTensor sinks{{kQoHeads}, kF32};
  tessera_run_options run_options{};
};

TEST(CApiSinksInfo, RunOptionsDefault) {
  tessera_run_options run_options;
  std::memset(&run_options, 0x5a, sizeof(run_options));
  tessera_run_options_default(&run_options);
  EXPECT_EQ(run_options.struct_size, sizeof(tessera_run_options));
  EXPECT_EQ(run_options.sinks, nullptr);
  tessera_run_options_default(nullptr);  // a no-op
}

TEST_F(CApiSinksTest, V2CallsWithSinksMatchCpp) {
  for (int op = 0; op < 3; ++op) {
    for (bool one_shot : {true, false}) {
      HostTensor out = out_of(op), out_lse = lse_of(op);
      ASSERT_EQ(call(op, one_shot, out, out_lse, &run_options), TESSERA_OK) << tessera_last_error();
      HostTensor expected = out_of(op), expected_lse = lse_of(op);
      cpp(op, expected, expected_lse);
      expect_close(out, expected, 0.0f);
      expect_close(out_lse, expected_lse, 0.0f);
      // Without sinks (NULL options, or options without sinks): another answer.
      HostTensor plain = out_of(op), plain_lse = lse_of(op);
      ASSERT_EQ(call(op, one_shot, plain, plain_lse, nullptr), TESSERA_OK) << tessera_last_error();
      EXPECT_NE(plain_lse.bytes(), out_lse.bytes()) << "op " << op;
    }
  }
}

TEST_F(CApiSinksTest, V1CallsAreV2WithoutRunOptions) {
  const tessera_paged_kv kv = paged_kv();
  HostTensor o1 = o, lse1 = lse, o2 = o, lse2 = lse;
  ASSERT_EQ(tessera_paged_prefill(q.dl(), &kv, qo_indptr.dl(), o1.dl(), lse1.dl(), &options,
                                  nullptr),
            TESSERA_OK);
  tessera_run_options none;
  tessera_run_options_default(&none);
  ASSERT_EQ(call(1, true, o2, lse2, &none), TESSERA_OK) << tessera_last_error();
  expect_close(o2, o1, 0.0f);
  expect_close(lse2, lse1, 0.0f);
}

// A caller built against a header whose struct ended before `sinks` passes a smaller size:
// the library reads no sinks (whatever lies past that size).
TEST_F(CApiSinksTest, OlderStructSizeReadsNoSinks) {
  HostTensor plain = o_decode, plain_lse = lse_decode;
  ASSERT_EQ(call(2, true, plain, plain_lse, nullptr), TESSERA_OK);
  tessera_run_options older = run_options;
  older.struct_size = sizeof(size_t);
  HostTensor out = o_decode, out_lse = lse_decode;
  ASSERT_EQ(call(2, false, out, out_lse, &older), TESSERA_OK) << tessera_last_error();
  expect_close(out, plain, 0.0f);
  expect_close(out_lse, plain_lse, 0.0f);
}

TEST_F(CApiSinksTest, BadSinksAndStructSizeFailByName) {
  HostTensor half_sinks({kQoHeads}, kF16), short_sinks({kQoHeads - 1}, kF32);
  for (int op = 0; op < 3; ++op) {
    for (bool one_shot : {true, false}) {
      for (HostTensor* bad : {&half_sinks, &short_sinks}) {
        tessera_run_options options_bad = run_options;
        options_bad.sinks = bad->dl();
        HostTensor out = out_of(op), out_lse = lse_of(op);
        expect_failure(call(op, one_shot, out, out_lse, &options_bad),
                       TESSERA_ERROR_INVALID_ARGUMENT, "sinks");
        EXPECT_EQ(out.bytes(), out_of(op).bytes()) << "a failed call wrote o";
      }
      tessera_run_options zero = run_options;
      zero.struct_size = 0;
      HostTensor out = out_of(op), out_lse = lse_of(op);
      expect_failure(call(op, one_shot, out, out_lse, &zero), TESSERA_ERROR_INVALID_ARGUMENT,
                     "run_options");
    }
  }
}

}  // namespace
