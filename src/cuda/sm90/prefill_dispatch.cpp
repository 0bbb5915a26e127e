// Which prefill kernel family serves a problem on a CUDA device (host only, no CUDA headers).
#include <cstdlib>
#include <string>

#include "cuda/sm90/prefill_api.hpp"
#include "cuda/sm90/prefill_traits.cuh"

namespace tessera::detail::sm90 {
namespace {

int block_m_of(int bucket) {
  switch (bucket) {
    case 64: return PrefillTraits<64>::kBlockM;
    case 128: return PrefillTraits<128>::kBlockM;
    case 256: return PrefillTraits<256>::kBlockM;
    default: return 0;
  }
}

}  // namespace

bool page_by_page_v(int head_dim, bool paged, int32_t page_size) {
  static const bool enabled = [] {
    const char* text = std::getenv("TESSERA_SM90_PAGED_V");
    return text == nullptr || std::string(text) != "0";
  }();
  using Traits = PrefillTraitsD128Paged;
  return enabled && paged && head_dim == Traits::kHeadDim && page_size < Traits::kBlockN;
}

WideTiles wide_tiles_mode() {
  static const WideTiles mode = [] {
    const char* text = std::getenv("TESSERA_SM90_WIDE");
    if (text == nullptr || *text == '\0') return WideTiles::kLongKeys;
    return std::string(text) == "0" ? WideTiles::kOff : WideTiles::kAlways;
  }();
  return mode;
}

std::string prefill_unsupported_reason(int sm_major, int head_dim, int num_qo_heads,
                                       int num_kv_heads, DType q_dtype, DType kv_dtype) {
  const char* forced = std::getenv("TESSERA_PREFILL_KERNEL");
  if (forced != nullptr && std::string(forced) == "sm80") {
    return "TESSERA_PREFILL_KERNEL=sm80 selects the portable kernels";
  }
  if (sm_major != 9) return "the device is not sm_90 (Hopper)";
  if (q_dtype != DType::kFloat16 && q_dtype != DType::kBFloat16) {
    return "q is not fp16/bf16";
  }
  if (kv_dtype != q_dtype) return "k/v do not have q's dtype";
  const int bucket = prefill_head_dim_bucket(head_dim);
  if (bucket == 0) return "head_dim " + std::to_string(head_dim) + " has no sm90 bucket";
  const int group = num_kv_heads > 0 ? num_qo_heads / num_kv_heads : 0;
  if (prefill_tile_rows(block_m_of(bucket), group) == 0) {
    return "a GQA group of " + std::to_string(group) + " query heads is wider than the " +
           std::to_string(block_m_of(bucket)) + "-row sm90 tile";
  }
  return {};
}

bool serves_decode(int sm_major, int head_dim, int num_qo_heads, int num_kv_heads, DType q_dtype,
                   DType kv_dtype) {
  // Opt-in (TESSERA_DECODE_KERNEL=sm90): measured slower than the sm80 decode kernels on paged
  // caches of 16-token pages (2.6 vs 4.5 TB/s at 256 x 16k, docs/PERF.md), whose per-page TMA
  // boxes the producer cannot issue fast enough.
  const char* forced = std::getenv("TESSERA_DECODE_KERNEL");
  if (forced == nullptr || std::string(forced) != "sm90") return false;
  return prefill_unsupported_reason(sm_major, head_dim, num_qo_heads, num_kv_heads, q_dtype,
                                    kv_dtype)
      .empty();
}

}  // namespace tessera::detail::sm90
