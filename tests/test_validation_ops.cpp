// Bad-input tests of the C++ API's ops: RoPE, paged-KV append, block table -> CSR, merge (the
// fixture and its contract: common/validation_fixture.hpp; the attention calls:
// test_validation.cpp).
#include <gtest/gtest.h>

#include <cstdint>

#include "common/validation_fixture.hpp"
#include "tessera/tessera.hpp"

namespace tessera {
namespace {

using test::kAppendRows;
using test::kHeadDim;
using test::kKvHeads;
using test::kNumPages;
using test::kPageSize;
using test::kQoHeads;
using test::kTotalQ;
using test::ValidationTest;

// ---------------------------------------------------------------- RoPE

TEST_F(ValidationTest, RopeRotaryDimOdd) {
  RopeOptions options;
  options.rotary_dim = 7;
  expect_invalid([&] { rope(options); }, "rope.rotary_dim");
}

TEST_F(ValidationTest, RopeRotaryDimAboveHeadDim) {
  RopeOptions options;
  options.rotary_dim = kHeadDim + 2;
  expect_invalid([&] { rope(options); }, "rope.rotary_dim");
}

TEST_F(ValidationTest, RopePositionsWrongLength) {
  positions = make_view(positions_values.data(), DType::kInt32, {kTotalQ - 1});
  expect_invalid([&] { rope(); }, "positions");
}

TEST_F(ValidationTest, RopeKeyHeadDimDiffers) {
  k_rope = make_view(out.k.data(), DType::kFloat32, {kTotalQ, 2 * kKvHeads, kHeadDim / 2});
  expect_invalid([&] { rope(); }, "k");
}

TEST_F(ValidationTest, RopeHeadsOrHeadDimBeyondLimit) {
  // No token, so nothing would be read, and every other argument agrees (k, positions, a
  // rotary_dim within the kernels' table): only the extent bound rejects these. The kernels
  // index heads and features in 32 bits.
  positions = make_view(positions_values.data(), DType::kInt32, {0});
  RopeOptions options;
  options.rotary_dim = 64;
  q = make_view(out.q.data(), DType::kFloat32, {0, kQoHeads, int64_t{1} << 32});
  k_rope = make_view(out.k.data(), DType::kFloat32, {0, kKvHeads, int64_t{1} << 32});
  expect_invalid([&] { rope(options); }, "q");
  q = make_view(out.q.data(), DType::kFloat32, {0, 65537, kHeadDim});
  k_rope = make_view(out.k.data(), DType::kFloat32, {0, kKvHeads, kHeadDim});
  expect_invalid([&] { rope(); }, "q");
  // The limits themselves are accepted.
  q = make_view(out.q.data(), DType::kFloat32, {0, 65536, 4096});
  k_rope = make_view(out.k.data(), DType::kFloat32, {0, 65536, 4096});
  EXPECT_NO_THROW(rope(options));
}

TEST_F(ValidationTest, RopeRotaryDimBeyondKernelTable) {
  // head_dim 512 is within the ops' limit, but the CUDA RoPE kernels hold the cos/sin of at most
  // 128 pairs (a larger rotary_dim overflowed their host and shared-memory tables). No token.
  q = make_view(out.q.data(), DType::kFloat32, {0, kQoHeads, 512});
  k_rope = make_view(out.k.data(), DType::kFloat32, {0, kKvHeads, 512});
  positions = make_view(positions_values.data(), DType::kInt32, {0});
  expect_invalid([&] { rope(); }, "rope.rotary_dim");
  RopeOptions options;
  options.rotary_dim = 258;
  expect_invalid([&] { rope(options); }, "rope.rotary_dim");
}

TEST_F(ValidationTest, RopeThetaNotPositive) {
  RopeOptions options;
  options.rope_theta = 0.0f;
  expect_invalid([&] { rope(options); }, "rope.rope_theta");
}

// ---------------------------------------------------------------- paged-KV append

TEST_F(ValidationTest, AppendBeyondPageTable) {
  // Request 1 appends 3 rows, but its one page (page 2, last page length 2) holds only 2 keys.
  append_indptr_values = {0, 0, 3};
  page_indptr_values = {0, 2, 3};
  last_page_len_values = {2, 2};
  expect_invalid([&] { append(); }, "page_indptr");
}

TEST_F(ValidationTest, AppendIndptrEndDiffersFromRows) {
  append_indptr_values = {0, 1, 2};
  expect_invalid([&] { append(); }, "append_indptr");
}

TEST_F(ValidationTest, AppendKeyValueShapesDiffer) {
  v_new = make_view(v_new_data.data(), DType::kFloat32, {kAppendRows - 1, kKvHeads, kHeadDim});
  expect_invalid([&] { append(); }, "v_new");
}

TEST_F(ValidationTest, AppendCacheHeadsDiffer) {
  k_new = make_view(k_new_data.data(), DType::kFloat32, {kAppendRows, 1, 2 * kHeadDim});
  v_new = make_view(v_new_data.data(), DType::kFloat32, {kAppendRows, 1, 2 * kHeadDim});
  expect_invalid([&] { append(); }, "k_cache");
}

TEST_F(ValidationTest, AppendHeadDimBeyondLimit) {
  // No row is appended and the cache has the same head_dim: only the extent bound rejects it
  // (the cache views, larger than their buffers, are never touched).
  append_indptr_values = {0, 0, 0};
  k_new = make_view(k_new_data.data(), DType::kFloat32, {0, kKvHeads, 4100});
  v_new = make_view(v_new_data.data(), DType::kFloat32, {0, kKvHeads, 4100});
  cache.k_cache =
      make_view(out.k_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, 4100});
  cache.v_cache =
      make_view(out.v_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, 4100});
  expect_invalid([&] { append(); }, "k_new");
}

TEST_F(ValidationTest, AppendFusedRopeRotaryDimBeyondKernelTable) {
  k_new = make_view(k_new_data.data(), DType::kFloat32, {0, kKvHeads, 512});
  v_new = make_view(v_new_data.data(), DType::kFloat32, {0, kKvHeads, 512});
  // No row is appended: the cache views, larger than their buffers, are never touched.
  append_indptr_values = {0, 0, 0};
  cache.k_cache =
      make_view(out.k_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, 512});
  cache.v_cache =
      make_view(out.v_cache.data(), DType::kFloat32, {kNumPages, kPageSize, kKvHeads, 512});
  const RopeOptions rope_options;
  expect_invalid([&] { append_paged_kv_cache(k_new, v_new, append_indptr, cache, &rope_options); },
                 "rope.rotary_dim");
}

TEST_F(ValidationTest, AppendRequestBeyondInt32Keys) {
  // Pages of 2^30 tokens: request 0's five pages hold 4 * 2^30 + 1 keys, which KVSource::kv_len
  // (int32) wrapped to 1, so the row was appended at position 0 instead of being refused.
  const int64_t page_size = int64_t{1} << 30;
  cache.k_cache =
      make_view(out.k_cache.data(), DType::kFloat32, {1, page_size, kKvHeads, kHeadDim});
  cache.v_cache =
      make_view(out.v_cache.data(), DType::kFloat32, {1, page_size, kKvHeads, kHeadDim});
  page_indptr_values = {0, 5, 5};
  page_indices_values = {0, 0, 0, 0, 0};
  cache.page_indices = make_view(page_indices_values.data(), DType::kInt32, {5});
  last_page_len_values = {1, 1};
  append_indptr_values = {0, 1, 1};
  k_new = make_view(k_new_data.data(), DType::kFloat32, {1, kKvHeads, kHeadDim});
  v_new = make_view(v_new_data.data(), DType::kFloat32, {1, kKvHeads, kHeadDim});
  expect_invalid([&] { append(); }, "page_indptr");
}

TEST_F(ValidationTest, AppendBatchBeyondInt32) {
  // 2^31 requests: the backends count requests in int32. Rejected before any array is read.
  // The page table's arrays have the lengths such a batch needs, so only the bound rejects it
  // (none of these views, larger than their buffers, is read).
  const int64_t batch = int64_t{1} << 31;
  append_indptr = make_view(append_indptr_values.data(), DType::kInt32, {batch + 1});
  cache.page_indptr = make_view(page_indptr_values.data(), DType::kInt32, {batch + 1});
  cache.last_page_len = make_view(last_page_len_values.data(), DType::kInt32, {batch});
  expect_invalid([&] { append(); }, "append_indptr");
}

TEST_F(ValidationTest, AppendPageIndexOutOfRange) {
  page_indices_values[3] = kNumPages + 3;
  expect_invalid([&] { append(); }, "page_indices");
}

TEST_F(ValidationTest, AppendLastPageLenAbovePageSize) {
  last_page_len_values[0] = kPageSize + 1;
  expect_invalid([&] { append(); }, "last_page_len");
}

TEST_F(ValidationTest, AppendRopeRotaryDimOdd) {
  RopeOptions options;
  options.rotary_dim = 3;
  expect_invalid([&] { append_paged_kv_cache(k_new, v_new, append_indptr, cache, &options); },
                 "rope.rotary_dim");
}

// ---------------------------------------------------------------- block table -> CSR

TEST_F(ValidationTest, BlockTableTooNarrowForSeqLens) {
  seq_lens_values[1] = 3 * kPageSize + 1;  // needs 4 pages, the table has 3 columns
  expect_invalid([&] { to_csr(); }, "seq_lens");
}

TEST_F(ValidationTest, BlockTableSeqLenNegative) {
  seq_lens_values[0] = -1;
  expect_invalid([&] { to_csr(); }, "seq_lens");
}

TEST_F(ValidationTest, BlockTableNotInt32) {
  block_table.dtype = DType::kInt64;
  expect_invalid([&] { to_csr(); }, "block_table");
}

TEST_F(ValidationTest, BlockTablePageIndptrWrongLength) {
  csr_indptr = make_view(out.csr_indptr.data(), DType::kInt32, {2});
  expect_invalid([&] { to_csr(); }, "page_indptr");
}

TEST_F(ValidationTest, BlockTableWiderThanInt32) {
  block_table = make_view(block_table_values.data(), DType::kInt32, {0, int64_t{1} << 31});
  seq_lens = make_view(seq_lens_values.data(), DType::kInt32, {0});
  csr_indptr = make_view(out.csr_indptr.data(), DType::kInt32, {1});
  csr_last = make_view(out.csr_last.data(), DType::kInt32, {0});
  expect_invalid([&] { to_csr(); }, "block_table");
}

TEST_F(ValidationTest, BlockTablePagesBeyondInt32) {
  // Two requests of 2^31 - 1 one-token pages: 2^32 - 2 pages in all, which page_indptr (int32)
  // cannot count. page_indices is large enough, so only that bound stops the conversion (which
  // wrapped page_indptr and wrote out of bounds). Nothing is read past the two lengths.
  block_table = make_view(block_table_values.data(), DType::kInt32, {2, INT32_MAX});
  seq_lens_values = {INT32_MAX, INT32_MAX};
  csr_indices = make_view(out.csr_indices.data(), DType::kInt32, {int64_t{1} << 32});
  expect_invalid(
      [&] { block_table_to_csr(block_table, seq_lens, 1, csr_indptr, csr_indices, csr_last); },
      "seq_lens");
}

TEST_F(ValidationTest, BlockTablePageSizeZero) {
  expect_invalid(
      [&] { block_table_to_csr(block_table, seq_lens, 0, csr_indptr, csr_indices, csr_last); },
      "page_size");
}

// ---------------------------------------------------------------- merge

TEST_F(ValidationTest, MergeShapeMismatch) {
  o_b = make_view(merge_b.data(), DType::kFloat32, {3, 1, 16});
  expect_invalid([&] { merge(); }, "o_b");
}

TEST_F(ValidationTest, MergeLseWrongDtype) {
  lse_a.dtype = DType::kFloat16;
  expect_invalid([&] { merge(); }, "lse_a");
}

TEST_F(ValidationTest, MergeOutputRowsDiffer) {
  merge_out = make_view(out.merge_out.data(), DType::kFloat32, {2, 2, 8});
  expect_invalid([&] { merge(); }, "o_out");
}

TEST_F(ValidationTest, MergeStatesIndptrBeyondStates) {
  states_indptr_values = {0, 2, 4};
  expect_invalid([&] { merge_many(); }, "indptr");
}

TEST_F(ValidationTest, MergeStatesIndptrNotMonotone) {
  states_indptr_values = {0, 2, 1};
  expect_invalid([&] { merge_many(); }, "indptr");
}

TEST_F(ValidationTest, MergeHeadDimBeyondLimit) {
  // Zero rows: no element is touched, yet a head_dim past 4096 (the fuzzer found 2^34, which
  // made the CPU merge allocate 128 GiB) is refused for every operand.
  o_a = make_view(merge_a.data(), DType::kFloat32, {0, 1, int64_t{1} << 34});
  o_b = make_view(merge_b.data(), DType::kFloat32, {0, 1, int64_t{1} << 34});
  merge_out = make_view(out.merge_out.data(), DType::kFloat32, {0, 1, int64_t{1} << 34});
  lse_a = make_view(merge_lse_a.data(), DType::kFloat32, {0, 1});
  lse_b = make_view(merge_lse_b.data(), DType::kFloat32, {0, 1});
  merge_lse_out = make_view(out.merge_lse_out.data(), DType::kFloat32, {0, 1});
  expect_invalid([&] { merge(); }, "o_a");
  // At the limit: accepted.
  for (TensorView* view : {&o_a, &o_b, &merge_out}) view->shape[2] = 4096;
  EXPECT_NO_THROW(merge());
}

TEST_F(ValidationTest, MergeStatesHeadsAndHeadDimBeyondLimit) {
  // No state and no output row, every operand of the same shape: only the bound rejects.
  states_indptr = make_view(states_indptr_values.data(), DType::kInt32, {1});
  const auto shapes = [&](int64_t heads, int64_t dim) {
    states = make_view(merge_a.data(), DType::kFloat32, {0, heads, dim});
    lse_a = make_view(merge_lse_a.data(), DType::kFloat32, {0, heads});
    states_out = make_view(out.merge_out.data(), DType::kFloat32, {0, heads, dim});
    states_lse_out = make_view(out.merge_lse_out.data(), DType::kFloat32, {0, heads});
  };
  shapes(1, 4097);
  expect_invalid([&] { merge_many(); }, "states");
  shapes(65537, 8);
  expect_invalid([&] { merge_many(); }, "states");
  shapes(65536, 4096);
  EXPECT_NO_THROW(merge_many());
}

TEST_F(ValidationTest, MergeStatesLseOutWrongShape) {
  states_lse_out = make_view(out.merge_lse_out.data(), DType::kFloat32, {2, 3});
  expect_invalid([&] { merge_many(); }, "lse_out");
}

}  // namespace
}  // namespace tessera
