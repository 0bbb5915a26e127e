// Custom and tree masks through the C ABI: tessera_run_options' custom_mask, mask_indptr and
// tree_mask (uint8 and int32 DLPack tensors) on the *_v2 run and one-shot calls. Each call with
// masks agrees bit for bit with the C++ API given the same RunOptions and differs from the call
// without them; a struct_size that stops before the mask fields reads none of them (whatever
// those fields hold), one that stops inside reads exactly the fields it covers; bad masks fail
// by name (a dtype the converter does not know, the C++ checks' errors), leaving the outputs
// untouched.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <random>
#include <vector>

#include "common/capi_fixture.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace {

using namespace tessera::test::capi;

// Requests of the fixture: prefill q_lens {3, 1, 4} x kv_lens {5, 2, 9} (15, 2 and 36 bits:
// 2, 1 and 5 bytes), decode kQPerRequest = 2 drafts (4 bits: 1 byte per request).
class CApiMasksTest : public CApiTest {
 protected:
  void SetUp() override {
    CApiTest::SetUp();
    std::mt19937 rng(34004);
    unsigned char* mask_bytes = bytes_of(custom);
    for (int64_t i = 0; i < custom.numel(); ++i) mask_bytes[i] = static_cast<unsigned char>(rng());
    // Bits (i * 2 + d): two sibling drafts, each sees only itself (causal decode would let draft
    // 1 see draft 0).
    unsigned char* tree_bytes = bytes_of(tree);
    for (int64_t i = 0; i < tree.numel(); ++i) tree_bytes[i] = 0b1001;
    tessera_run_options_default(&prefill_options);
    prefill_options.custom_mask = custom.dl();
    prefill_options.mask_indptr = mask_indptr.dl();
    tessera_run_options_default(&decode_options);
    decode_options.tree_mask = tree.dl();
  }
  static unsigned char* bytes_of(HostTensor& tensor) {
    return reinterpret_cast<unsigned char*>(tensor.ints());
  }
  tessera::RunOptions cpp_options(int op) {
    tessera::RunOptions result;
    if (op == 2) {
      result.tree_mask = tree.view();
    } else {
      result.custom_mask = custom.view();
      result.mask_indptr = mask_indptr.view();
    }
    return result;
  }
  const tessera_run_options* options_of(int op) const {
    return op == 2 ? &decode_options : &prefill_options;
  }

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
        op == 0
            ? tessera_plan_ragged_prefill(qo_indptr_host.data(), kv_indptr_host.data(), kBatch,
                                          kQoHeads, kKvHeads, kHeadDim, &options, kDLCPU, 0, &plan)
        : op == 1 ? tessera_plan_paged_prefill(
                        qo_indptr_host.data(), page_indptr_host.data(), last_page_len_host.data(),
                        kBatch, kPageSize, kQoHeads, kKvHeads, kHeadDim, &options, kDLCPU, 0, &plan)
                  : tessera_plan_decode(page_indptr_host.data(), last_page_len_host.data(), kBatch,
                                        kPageSize, kQoHeads, kKvHeads, kHeadDim, kQPerRequest,
                                        &options, kDLCPU, 0, &plan);
    if (status != TESSERA_OK) return status;
    std::vector<unsigned char> workspace(tessera_plan_workspace_bytes(plan) + 1);
    if (op == 0) {
      status = tessera_run_ragged_prefill_v2(plan, q.dl(), k.dl(), v.dl(), qo_indptr.dl(),
                                             kv_indptr.dl(), out.dl(), out_lse.dl(),
                                             workspace.data(), workspace.size(), nullptr, run);
    } else if (op == 1) {
      status =
          tessera_run_paged_prefill_v2(plan, q.dl(), &kv, qo_indptr.dl(), out.dl(), out_lse.dl(),
                                       workspace.data(), workspace.size(), nullptr, run);
    } else {
      status = tessera_run_decode_v2(plan, q_decode.dl(), &kv, out.dl(), out_lse.dl(),
                                     workspace.data(), workspace.size(), nullptr, run);
    }
    tessera_plan_destroy(plan);
    return status;
  }
  // The C++ API's answer with the same masks (one-shot calls).
  void cpp(int op, HostTensor& out, HostTensor& out_lse) {
    const tessera::RunOptions run = cpp_options(op);
    if (op == 0) {
      tessera::ragged_prefill(q.view(), k.view(), v.view(), qo_indptr.view(), kv_indptr.view(),
                              out.view(), out_lse.view(), options_cpp(), nullptr, run);
    } else if (op == 1) {
      tessera::paged_prefill(q.view(), paged_kv_cpp(), qo_indptr.view(), out.view(), out_lse.view(),
                             options_cpp(), nullptr, run);
    } else {
      tessera::decode(q_decode.view(), paged_kv_cpp(), out.view(), out_lse.view(), options_cpp(),
                      nullptr, run);
    }
  }
  HostTensor& out_of(int op) { return op == 2 ? o_decode : o; }
  HostTensor& lse_of(int op) { return op == 2 ? lse_decode : lse; }

  HostTensor custom{{9}, kU8};  // 8 bytes of segments and one spare
  HostTensor mask_indptr = int_tensor({0, 2, 3, 8});
  HostTensor tree{{kBatch, 1}, kU8};
  tessera_run_options prefill_options{}, decode_options{};
};

TEST(CApiMasksInfo, RunOptionsDefaultHasNoMasks) {
  tessera_run_options run_options;
  std::memset(&run_options, 0x5a, sizeof(run_options));
  tessera_run_options_default(&run_options);
  EXPECT_EQ(run_options.struct_size, sizeof(tessera_run_options));
  EXPECT_EQ(run_options.custom_mask, nullptr);
  EXPECT_EQ(run_options.mask_indptr, nullptr);
  EXPECT_EQ(run_options.tree_mask, nullptr);
  // The new fields come last: the layout up to enable_pdl is the one older callers know.
  EXPECT_GT(offsetof(tessera_run_options, custom_mask), offsetof(tessera_run_options, enable_pdl));
  EXPECT_GT(offsetof(tessera_run_options, tree_mask), offsetof(tessera_run_options, mask_indptr));
}

TEST_F(CApiMasksTest, V2CallsWithMasksMatchCpp) {
  for (int op = 0; op < 3; ++op) {
    for (bool one_shot : {true, false}) {
      HostTensor out = out_of(op), out_lse = lse_of(op);
      ASSERT_EQ(call(op, one_shot, out, out_lse, options_of(op)), TESSERA_OK)
          << tessera_last_error();
      HostTensor expected = out_of(op), expected_lse = lse_of(op);
      cpp(op, expected, expected_lse);
      expect_close(out, expected, 0.0f);
      expect_close(out_lse, expected_lse, 0.0f);
      // Without the masks: another answer.
      HostTensor plain = out_of(op), plain_lse = lse_of(op);
      ASSERT_EQ(call(op, one_shot, plain, plain_lse, nullptr), TESSERA_OK) << tessera_last_error();
      EXPECT_NE(plain_lse.bytes(), out_lse.bytes()) << "op " << op;
    }
  }
}

// A caller built against a header whose struct ended at enable_pdl passes that size: the
// library reads no mask field, whatever lies past it (here: descriptors that would fail). A size
// that covers custom_mask but not mask_indptr reads the mask alone, which then lacks offsets.
TEST_F(CApiMasksTest, StructSizeDecidesWhichMaskFieldsAreRead) {
  DLTensor broken{};  // ndim 0: rejected if it were read
  const size_t before_masks = offsetof(tessera_run_options, custom_mask);
  for (int op = 0; op < 3; ++op) {
    HostTensor plain = out_of(op), plain_lse = lse_of(op);
    ASSERT_EQ(call(op, true, plain, plain_lse, nullptr), TESSERA_OK) << tessera_last_error();
    tessera_run_options older = *options_of(op);
    older.struct_size = before_masks;
    older.custom_mask = older.mask_indptr = older.tree_mask = &broken;
    HostTensor out = out_of(op), out_lse = lse_of(op);
    ASSERT_EQ(call(op, false, out, out_lse, &older), TESSERA_OK) << tessera_last_error();
    expect_close(out, plain, 0.0f);
    expect_close(out_lse, plain_lse, 0.0f);
  }
  tessera_run_options partial = prefill_options;
  partial.struct_size = offsetof(tessera_run_options, mask_indptr);  // custom_mask only
  HostTensor out = o, out_lse = lse;
  expect_failure(call(0, false, out, out_lse, &partial), TESSERA_ERROR_INVALID_ARGUMENT,
                 "run_options.mask_indptr");
  EXPECT_EQ(out.bytes(), o.bytes()) << "a failed call wrote o";
}

TEST_F(CApiMasksTest, BadMasksFailByName) {
  HostTensor int8_mask({9}, DLDataType{kDLInt, 8, 1});
  HostTensor short_indptr = int_tensor({0, 2, 3});
  HostTensor small_segments = int_tensor({0, 1, 2, 3});  // request 0 needs 2 bytes
  HostTensor past_end = int_tensor({0, 2, 3, 10});       // 9 bytes
  HostTensor wide_tree({kBatch + 1, 1}, kU8);
  for (bool one_shot : {true, false}) {
    for (int op = 0; op < 2; ++op) {
      struct Bad {
        DLTensor* custom;
        DLTensor* indptr;
        DLTensor* tree;
        const char* field;
      };
      for (const Bad& bad :
           {Bad{int8_mask.dl(), mask_indptr.dl(), nullptr, "run_options.custom_mask"},
            Bad{custom.dl(), short_indptr.dl(), nullptr, "run_options.mask_indptr"},
            Bad{custom.dl(), small_segments.dl(), nullptr, "run_options.mask_indptr"},
            Bad{custom.dl(), past_end.dl(), nullptr, "run_options.mask_indptr"},
            Bad{custom.dl(), nullptr, nullptr, "run_options.mask_indptr"},
            Bad{nullptr, nullptr, tree.dl(), "run_options.tree_mask"}}) {
        tessera_run_options run = prefill_options;
        run.custom_mask = bad.custom;
        run.mask_indptr = bad.indptr;
        run.tree_mask = bad.tree;
        HostTensor out = o, out_lse = lse;
        expect_failure(call(op, one_shot, out, out_lse, &run), TESSERA_ERROR_INVALID_ARGUMENT,
                       bad.field);
        EXPECT_EQ(out.bytes(), o.bytes()) << "a failed call wrote o";
        EXPECT_EQ(out_lse.bytes(), lse.bytes()) << "a failed call wrote lse";
      }
    }
    for (const auto& [run, field] :
         {std::pair{prefill_options, "run_options.custom_mask"},  // decode takes no custom mask
          {tessera_run_options{sizeof(tessera_run_options), nullptr, 0, nullptr, nullptr,
                               wide_tree.dl()},
           "run_options.tree_mask"}}) {
      HostTensor out = o_decode, out_lse = lse_decode;
      expect_failure(call(2, one_shot, out, out_lse, &run), TESSERA_ERROR_INVALID_ARGUMENT, field);
      EXPECT_EQ(out.bytes(), o_decode.bytes()) << "a failed call wrote o";
    }
  }
}

}  // namespace
