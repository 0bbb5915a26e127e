#include "cuda/kernel_registry.hpp"

#include "cuda/prefill_args.hpp"
#include "tessera/types.hpp"

namespace tessera::detail {

const char* kernel_family_name(KernelFamily family) {
  switch (family) {
    case KernelFamily::kSm90Prefill: return "sm90 prefill";
    case KernelFamily::kSm80Prefill: return "sm80 prefill";
    case KernelFamily::kSm80DecodeMma: return "sm80 decode (mma.sync)";
    case KernelFamily::kSm80Decode: return "sm80 decode (CUDA cores)";
  }
  return "?";
}

const KernelInstance* KernelRow::instance(DType q_dtype, DType kv_dtype) const {
  for (const KernelInstance& entry : instances) {
    if (entry.q_dtype == q_dtype && entry.kv_dtype == kv_dtype) return &entry;
  }
  return nullptr;
}

std::string KernelRow::label() const {
  // append(), not operator+ on literals: GCC 12's -Wrestrict misfires on the latter.
  std::string text(kernel_family_name(family));
  text.append(" d").append(std::to_string(shape.head_dim));
  if (has(kKernelWideTiles)) text.append(" wide");
  if (has(kKernelPagedV)) text.append(" paged-V");
  if (has(kKernelSoftCap)) text.append(" soft-cap");
  switch (family) {
    case KernelFamily::kSm90Prefill:
    case KernelFamily::kSm80Prefill:
      text.append(" ").append(std::to_string(shape.block_m));
      text.append("x").append(std::to_string(shape.block_n));
      if (family == KernelFamily::kSm80Prefill) {
        text.append(" v").append(std::to_string(shape.variant));
      }
      break;
    case KernelFamily::kSm80DecodeMma:
      if (shape.variant > 0) {
        text.append(" variant ").append(std::to_string(shape.variant));
      } else {
        text.append(" row tiles ").append(std::to_string(shape.rows / 16));
      }
      text.append(", <= ").append(std::to_string(shape.rows)).append(" rows");
      break;
    case KernelFamily::kSm80Decode:
      text.append(", ").append(std::to_string(shape.rows)).append(" rows per slot");
      break;
  }
  return text;
}

std::span<const KernelRow> kernel_registry() {
  static const KernelRows rows = [] {
    KernelRows all;
    // Order is preference inside a family only; select_kernel decides between families.
    sm90::add_prefill_rows_d64_wide(all);
    sm90::add_prefill_rows_d64(all);
    sm90::add_prefill_rows_d128_wide(all);
    sm90::add_prefill_rows_d128_paged(all);
    sm90::add_prefill_rows_d128(all);
    sm90::add_prefill_rows_d256(all);
    sm80::add_prefill_rows_d64(all);
    sm80::add_prefill_rows_d128(all);
    sm80::add_prefill_rows_d256(all);
    sm80::add_decode_rows_d64(all);
    sm80::add_decode_rows_d128(all);
    sm80::add_decode_rows_d256(all);
    for (size_t i = 0; i < all.size(); ++i) all[i].id = static_cast<int32_t>(i);
    return all;
  }();
  return rows;
}

const KernelRow& kernel_row(int32_t id) {
  const std::span<const KernelRow> rows = kernel_registry();
  if (id < 0 || static_cast<size_t>(id) >= rows.size()) {
    throw Error(Error::Kind::kInvalidArgument,
                "plan: kernel id " + std::to_string(id) + " is not a row of this build's kernel "
                "registry (" + std::to_string(rows.size()) + " rows): was the plan made by "
                "another build, or for the CPU?");
  }
  return rows[static_cast<size_t>(id)];
}

const KernelRow* find_kernel_row(KernelFamily family, int head_dim_bucket, uint32_t features,
                                 int variant, int rows) {
  for (const KernelRow& row : kernel_registry()) {
    if (row.family == family && row.shape.head_dim == head_dim_bucket &&
        row.features == features && (variant < 0 || row.shape.variant == variant) &&
        (rows < 0 || row.shape.rows == rows)) {
      return &row;
    }
  }
  return nullptr;
}

}  // namespace tessera::detail
