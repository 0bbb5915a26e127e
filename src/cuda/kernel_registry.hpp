// The kernel registry: one row per compiled attention kernel shape, every dtype instance of it
// beside. Rows are appended by the translation units that instantiate the kernels (sm80/, sm90/)
// and read by select_kernel (kernel_select.cpp) once at plan time; the Plan keeps the row's id
// and the reason, and run() launches that row (host only, no CUDA headers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda/prefill_args.hpp"
#include "tessera/types.hpp"

namespace tessera::detail {

namespace sm80 {
struct DecodeArgs;
}

enum class KernelFamily : int32_t {
  kSm90Prefill,    // warp-specialised TMA + wgmma (sm_90a)
  kSm80Prefill,    // FA2-style mma.sync, every sm_80+ device
  kSm80DecodeMma,  // decode on mma.sync: q = K/V dtype, <= 128 packed rows per item
  kSm80Decode,     // decode on CUDA cores: every dtype pair, any alignment
};
const char* kernel_family_name(KernelFamily family);

enum KernelFeature : uint32_t {
  kKernelSoftCap = 1u << 0,    // logits soft-cap built in
  kKernelWideTiles = 1u << 1,  // 176 / 192-key tiles (ragged, unmasked, long requests)
  kKernelPagedV = 1u << 2,     // V copied one TMA box per page (pages shorter than a tile)
  kKernelFullRows = 1u << 3,   // decode mma: items of 9..16 packed rows (else <= 8)
};

// Tile traits of a row.
struct KernelShape {
  int head_dim = 0;  // instantiated head_dim (64, 128, 256); smaller multiples of 8 are padded
  int block_m = 0;   // packed query rows per CTA tile (prefill)
  int block_n = 0;   // keys per K/V tile
  int num_threads = 0;
  int stages = 0;
  size_t smem_bytes = 0;
  int rows = 0;     // decode: query rows per row slot (CUDA cores) or per item (mma)
  int variant = 0;  // sm80 prefill tile variant, or decode variant (core/tuning.hpp; 0 on the
                    // decode mma rows of wide groups, which are not tuned)
};

// One compiled instance (a dtype pair) of a row. Exactly one launch pointer is set, by family.
struct KernelInstance {
  DType q_dtype = DType::kFloat16;
  DType kv_dtype = DType::kFloat16;
  const char* name = "";
  // sm90 prefill (options: the plan's kernel_options): false (nothing launched, the reason in
  // *why) when TMA cannot describe q.
  bool (*try_prefill)(const PrefillArgs& args, uint32_t options, void* stream,
                      std::string* why) = nullptr;
  void (*prefill)(const PrefillArgs& args, void* stream) = nullptr;
  void (*decode)(const sm80::DecodeArgs& args, void* stream) = nullptr;
  int (*max_ctas_per_sm)(int device) = nullptr;
};

struct KernelRow {
  int32_t id = -1;  // index in kernel_registry()
  KernelFamily family = KernelFamily::kSm80Prefill;
  uint32_t features = 0;
  KernelShape shape;
  std::vector<KernelInstance> instances;

  bool has(KernelFeature feature) const { return (features & feature) != 0; }
  // The instance for (q, K/V) dtypes; nullptr when this row has none.
  const KernelInstance* instance(DType q_dtype, DType kv_dtype) const;
  // "sm90 prefill d128 paged-V 128x128" (for --explain and errors).
  std::string label() const;
};

// Every row, built on first use (thread-safe) from the rows the kernel translation units add.
std::span<const KernelRow> kernel_registry();
// The row of `id`; throws tessera::Error(kInvalidArgument) for an id that is not a row.
const KernelRow& kernel_row(int32_t id);
// The first row with this family, head_dim bucket, features and variant / rows (-1: any).
const KernelRow* find_kernel_row(KernelFamily family, int head_dim_bucket, uint32_t features,
                                 int variant = -1, int rows = -1);

// The per-translation-unit contributions (sm80/prefill_d*.cu, sm80/decode_d*.cu,
// sm90/prefill_d*.cu). Each appends its rows; ids are assigned by the registry.
using KernelRows = std::vector<KernelRow>;
namespace sm80 {
void add_prefill_rows_d64(KernelRows& rows);
void add_prefill_rows_d128(KernelRows& rows);
void add_prefill_rows_d256(KernelRows& rows);
void add_decode_rows_d64(KernelRows& rows);
void add_decode_rows_d128(KernelRows& rows);
void add_decode_rows_d256(KernelRows& rows);
}  // namespace sm80
namespace sm90 {
void add_prefill_rows_d64(KernelRows& rows);
void add_prefill_rows_d64_wide(KernelRows& rows);
void add_prefill_rows_d128(KernelRows& rows);
void add_prefill_rows_d128_wide(KernelRows& rows);
void add_prefill_rows_d128_paged(KernelRows& rows);
void add_prefill_rows_d256(KernelRows& rows);
}  // namespace sm90

}  // namespace tessera::detail
