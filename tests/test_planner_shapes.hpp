// Random planner shapes and configs shared by tests/test_planner.cpp (properties) and
// tests/test_planner_reference.cpp (the fast search against a direct implementation).
#pragma once

#include <algorithm>
#include <random>

#include "core/planner.hpp"
#include "tessera/attention.hpp"

namespace tessera::detail::planner_test {

inline PlanShape random_shape(std::mt19937_64& rng, AttentionOp op) {
  PlanShape shape;
  shape.op = op;
  std::uniform_int_distribution<int> batch_dist(1, 12), len_dist(0, 700), group_dist(1, 8);
  std::uniform_int_distribution<int> coin(0, 1), kv_heads_dist(1, 4);
  const int batch = batch_dist(rng);
  const int q_per_request = std::uniform_int_distribution<int>(1, 4)(rng);
  for (int b = 0; b < batch; ++b) {
    const int kv_len = len_dist(rng);
    int q_len = op == AttentionOp::kDecode ? q_per_request : len_dist(rng);
    if (op != AttentionOp::kDecode && coin(rng)) q_len = std::min(q_len, kv_len);
    shape.q_lens.push_back(q_len);
    shape.kv_lens.push_back(kv_len);
  }
  shape.num_kv_heads = kv_heads_dist(rng);
  shape.num_qo_heads = shape.num_kv_heads * group_dist(rng);
  shape.head_dim = 128;
  shape.page_size = 16;
  shape.options.causal = coin(rng);
  if (coin(rng)) shape.options.window_left = std::uniform_int_distribution<int>(0, 300)(rng);
  if (!shape.options.causal && coin(rng)) {
    shape.options.window_right = std::uniform_int_distribution<int>(0, 50)(rng);
  }
  return shape;
}

inline PlanConfig random_config(std::mt19937_64& rng, int group) {
  PlanConfig config;
  config.q_tile_rows = std::max(group, std::uniform_int_distribution<int>(1, 128)(rng));
  config.num_workers = std::uniform_int_distribution<int>(1, 200)(rng);
  config.split_kv = std::uniform_int_distribution<int>(0, 3)(rng) != 0;
  config.min_kv_chunk = std::uniform_int_distribution<int>(16, 300)(rng);
  config.deterministic = std::uniform_int_distribution<int>(0, 3)(rng) == 0;
  return config;
}

}  // namespace tessera::detail::planner_test
