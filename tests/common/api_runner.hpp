// Runs a random attention case (tests/common/attention_testing.hpp) end to end through the
// public plan/run API with the real planner, on the CPU or on a CUDA device: the path a user
// takes. Used by the API sweep test and by `tessera check`. No gtest dependency.
#pragma once

#include "common/attention_testing.hpp"
#include "tessera/attention.hpp"

namespace tessera::test {

AttentionOptions options_of(const AttentionCase& test_case);
// The public op serving a case: decode for uniform queries over a paged cache.
AttentionOp op_of(const AttentionCase& test_case);

// plan_* for the case's lengths on `device` (the public planner and the backend's knobs).
Plan plan_for(const AttentionBuffers& buffers, Device device);

// Copies the case to `device` (in place on the CPU), poisons o/lse and a workspace with NaN,
// runs plan_for()'s plan (or `plan` when given) through run_ragged_prefill / run_paged_prefill /
// run_decode and returns the outputs (as host bytes laid out like buffers.o / buffers.lse).
// `masks` (optional): its custom_mask, mask_indptr and tree_mask join the run options as they
// are (host views: CPU plans, tests/test_masks.cpp).
Outputs run_through_api(AttentionBuffers& buffers, Device device, const Plan* plan = nullptr,
                        const RunOptions* masks = nullptr);

// The double-precision oracle's outputs for the case.
Outputs run_reference(AttentionBuffers& buffers);

}  // namespace tessera::test
