// `tessera plan --explain`: builds a plan for given lengths and prints its work partition.
#pragma once

#include <string>

#include "tessera/attention.hpp"

namespace tessera::cli {

struct PlanOptions {
  std::string op = "prefill";   // prefill | paged | decode
  std::string q_lens, kv_lens;  // "1x16384,63x256"; kv_lens empty: the query lengths
  std::string backend = "auto";
  int num_qo_heads = 32, num_kv_heads = 8, head_dim = 128, page_size = 16;
  bool causal = false;
  bool explain = false;  // the only output: accepted for scripts that pass it
  AttentionOptions attention;
};

int run_plan(const PlanOptions& options);

}  // namespace tessera::cli
