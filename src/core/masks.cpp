// Validation of the per-call masks (RunOptions::custom_mask / mask_indptr / tree_mask; their
// definition in include/tessera/attention.hpp, their bits in core/masks.hpp): the shared half of
// run_ragged_prefill, run_paged_prefill and run_decode (and so of the one-shot calls and the
// C ABI), called after the plan's other tensors were checked and before anything is written.
#include "core/masks.hpp"

#include <string>

#include "core/attention_run.hpp"

namespace tessera::detail {
namespace {

constexpr const char* kCustomMask = "run_options.custom_mask";
constexpr const char* kMaskIndptr = "run_options.mask_indptr";
constexpr const char* kTreeMask = "run_options.tree_mask";

int64_t bytes_for_bits(int64_t bits) {
  return (bits + 7) / 8;
}

// custom_mask + mask_indptr of a prefill plan on the CPU.
void set_custom_mask(const ArgChecker& check, const Plan& plan, const RunOptions& run_options,
                     KeyMask& key_mask) {
  const TensorView& mask = run_options.custom_mask;
  const TensorView& indptr = run_options.mask_indptr;
  check.require(has_value(indptr), kMaskIndptr,
                "expected int32 [batch_size + 1] byte offsets of each request's bits in "
                "run_options.custom_mask, got none");
  check.require(has_value(mask), kCustomMask,
                "expected the uint8 bit-packed mask that run_options.mask_indptr indexes, got "
                "none");
  check.tensor(mask, kCustomMask, 1, "[bytes] of uint8 (bits packed little-endian)");
  check.dtype_is(mask, kCustomMask, DType::kUInt8);
  check.device_is(mask, kCustomMask, plan.device);
  check.index_array(indptr, kMaskIndptr, plan.batch_size + 1, plan.device);
  // A CPU plan: the offsets are host memory (CUDA plans never get here).
  const int32_t* offsets = indptr.ptr<const int32_t>();
  const int64_t length = mask.shape[0];
  check.require(offsets[0] >= 0, kMaskIndptr, [&] {
    return "expected a first value >= 0, got mask_indptr[0] = " + std::to_string(offsets[0]);
  });
  for (int32_t r = 0; r < plan.batch_size; ++r) {
    const int64_t bytes = int64_t{offsets[r + 1]} - offsets[r];
    if (bytes < 0) {
      check.fail(kMaskIndptr, "expected non-decreasing values, got mask_indptr[" +
                                  std::to_string(r) + "] = " + std::to_string(offsets[r]) +
                                  " > mask_indptr[" + std::to_string(r + 1) +
                                  "] = " + std::to_string(offsets[r + 1]));
    }
    const int64_t needed = bytes_for_bits(int64_t{plan.q_lens[r]} * plan.kv_lens[r]);
    if (bytes < needed) {
      const std::string lengths = "(q_len " + std::to_string(plan.q_lens[r]) + ", kv_len " +
                                  std::to_string(plan.kv_lens[r]) + ")";
      check.fail(kMaskIndptr, "request " + std::to_string(r) + " " + lengths +
                                  " needs ceil(q_len x kv_len / 8) = " + std::to_string(needed) +
                                  " bytes of mask, got mask_indptr[" + std::to_string(r + 1) +
                                  "] - mask_indptr[" + std::to_string(r) +
                                  "] = " + std::to_string(bytes));
    }
  }
  check.require(offsets[plan.batch_size] <= length, kMaskIndptr, [&] {
    return "mask_indptr[batch_size] = " + std::to_string(offsets[plan.batch_size]) +
           " exceeds the " + std::to_string(length) + " bytes of run_options.custom_mask";
  });
  key_mask.custom = mask.ptr<const uint8_t>();
  key_mask.custom_indptr = offsets;
}

// tree_mask of a decode plan on the CPU.
void set_tree_mask(const ArgChecker& check, const Plan& plan, const RunOptions& run_options,
                   KeyMask& key_mask) {
  const TensorView& tree = run_options.tree_mask;
  check.tensor(tree, kTreeMask, 2, "[batch_size, bytes_per_request] of uint8");
  check.dtype_is(tree, kTreeMask, DType::kUInt8);
  check.device_is(tree, kTreeMask, plan.device);
  check.dim_is(tree, kTreeMask, 0, plan.batch_size, "batch_size of the plan");
  const int64_t q_per_request = plan.batch_size > 0 ? plan.q_lens[0] : 1;
  const int64_t needed = bytes_for_bits(q_per_request * q_per_request);
  check.require(plan.batch_size == 0 || tree.shape[1] >= needed, kTreeMask, [&] {
    return "expected at least ceil(q_per_request^2 / 8) = " + std::to_string(needed) +
           " bytes per request (q_per_request " + std::to_string(q_per_request) + "), got " +
           shape_string(tree);
  });
  key_mask.tree = tree.ptr<const uint8_t>();
  key_mask.tree_stride = tree.stride[0];
}

}  // namespace

void set_key_mask(const ArgChecker& check, const Plan& plan, const RunOptions& run_options,
                  AttentionProblem& problem) {
  const bool custom = has_value(run_options.custom_mask) || has_value(run_options.mask_indptr);
  const bool tree = has_value(run_options.tree_mask);
  if (!custom && !tree) return;
  const bool decode = plan.op == AttentionOp::kDecode;
  if (decode && custom) {
    check.fail(has_value(run_options.custom_mask) ? kCustomMask : kMaskIndptr,
               "custom masks apply to prefill (ragged and paged); decode takes "
               "run_options.tree_mask");
  }
  if (!decode && tree) {
    check.fail(kTreeMask,
               "tree masks apply to decode (q_per_request draft tokens per request); prefill "
               "takes run_options.custom_mask with run_options.mask_indptr");
  }
  const char* field = tree                                 ? kTreeMask
                      : has_value(run_options.custom_mask) ? kCustomMask
                                                           : kMaskIndptr;
  if (plan.device.type != DeviceType::kCPU) {
    check.unsupported(field, std::string(tree ? "tree" : "custom") +
                                 " masks run on the CPU backend only for now; this plan is for " +
                                 device_name(plan.device));
  }
  if (tree) {
    set_tree_mask(check, plan, run_options, problem.key_mask);
  } else {
    set_custom_mask(check, plan, run_options, problem.key_mask);
  }
}

}  // namespace tessera::detail
