// CPU conversion of a vLLM / FlashAttention block table into Tessera's CSR page table.
//
// Request b with seq_lens[b] tokens owns pages_b = ceil(seq_lens[b] / page_size) pages: the first
// pages_b entries of its block-table row, in order. Its last page holds
// seq_lens[b] - (pages_b - 1) * page_size tokens, in [1, page_size]. A request with no token has
// no page; its last_page_len is written as 0 (PagedKVCache ignores it for such a request, and 0
// keeps kv_len = 0 consistent for any reader that does not special-case empty requests).
#include <cstdint>

#include "core/backends.hpp"

namespace tessera::detail {

void cpu_block_table_to_csr(const TensorView& block_table, const int32_t* seq_lens, int page_size,
                            int32_t* page_indptr, int32_t* page_indices, int32_t* last_page_len) {
  const int64_t batch_size = block_table.shape[0];
  const int32_t* table = block_table.ptr<const int32_t>();
  const int64_t row_stride = block_table.stride[0];
  const int64_t column_stride = block_table.ndim > 1 ? block_table.stride[1] : 1;

  page_indptr[0] = 0;
  for (int64_t request = 0; request < batch_size; ++request) {
    const int32_t seq_len = seq_lens[request];
    // In 64 bits: seq_len + page_size - 1 may not fit in int32 for a sequence near INT32_MAX.
    const int32_t pages =
        static_cast<int32_t>((static_cast<int64_t>(seq_len) + page_size - 1) / page_size);
    const int32_t first = page_indptr[request];
    for (int32_t page = 0; page < pages; ++page) {
      page_indices[first + page] = table[request * row_stride + page * column_stride];
    }
    page_indptr[request + 1] = first + pages;
    last_page_len[request] = pages == 0 ? 0 : seq_len - (pages - 1) * page_size;
  }
}

}  // namespace tessera::detail
