#include "common/sinks_testing.hpp"

#include <cstdlib>
#include <sstream>

namespace tessera::test {
namespace {

int32_t uniform(std::mt19937_64& rng, int32_t lo, int32_t hi) {  // inclusive
  return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
}

const char* mask_name(SinksMask mask) {
  switch (mask) {
    case SinksMask::kNone: return "none";
    case SinksMask::kCausal: return "causal";
    case SinksMask::kWindow: return "window";
    case SinksMask::kCausalSoftCap: return "causal+softcap";
  }
  return "?";
}

}  // namespace

uint64_t sinks_seed(uint64_t default_seed) {
  const char* env = std::getenv("TESSERA_TEST_SEED");
  return env ? std::strtoull(env, nullptr, 10) : default_seed;
}

const char* sinks_op_name(SinksOp op) {
  switch (op) {
    case SinksOp::kRagged: return "ragged";
    case SinksOp::kPaged: return "paged";
    case SinksOp::kDecode: return "decode";
  }
  return "?";
}

std::string SinksShape::describe() const {
  std::ostringstream text;
  text << sinks_op_name(op) << " mask=" << mask_name(mask) << " group=" << group_size
       << " d=" << head_dim << " " << dtype_name(dtype) << " page=" << page_size;
  if (op == SinksOp::kDecode) text << " q_per_request=" << q_per_request;
  if (long_kv > 0) text << " long_kv=" << long_kv;
  if (long_q > 0) text << " long_q=" << long_q;
  return text.str();
}

std::vector<SinksShape> sinks_matrix(SinksOp op, const std::vector<int32_t>& head_dims) {
  std::vector<SinksShape> shapes;
  int turn = 0;
  for (SinksMask mask : kAllSinksMasks) {
    for (int32_t group : {1, 4, 8}) {
      for (int32_t head_dim : head_dims) {
        SinksShape shape;
        shape.op = op;
        shape.mask = mask;
        shape.group_size = group;
        shape.head_dim = head_dim;
        shape.dtype = turn % 2 == 0 ? DType::kFloat16 : DType::kBFloat16;
        shape.page_size = turn % 3 == 0 ? 1 : 16;
        shape.q_per_request = 1 + turn % 4;
        ++turn;
        shapes.push_back(shape);
      }
    }
  }
  return shapes;
}

AttentionCase sinks_case(const SinksShape& shape, std::mt19937_64& rng) {
  AttentionCase c;
  c.num_kv_heads = 2;
  c.num_qo_heads = 2 * shape.group_size;
  c.head_dim = shape.head_dim;
  c.q_dtype = c.kv_dtype = shape.dtype;
  c.paged = shape.op != SinksOp::kRagged;
  c.page_size = shape.page_size;
  c.spare_pages = c.paged ? 2 : 0;
  c.causal = shape.mask == SinksMask::kCausal || shape.mask == SinksMask::kCausalSoftCap;
  if (shape.mask == SinksMask::kWindow) {
    c.window_left = uniform(rng, 0, 48);
    c.window_right = uniform(rng, 0, 1) == 0 ? -1 : uniform(rng, 0, 8);
  }
  if (shape.mask == SinksMask::kCausalSoftCap) c.soft_cap = 30.0f;
  // Request 0 sees no key, request 1 is the long one, request 2 has fewer keys than queries.
  const int32_t long_kv = shape.long_kv > 0 ? shape.long_kv : uniform(rng, 90, 300);
  c.kv_lens = {0, long_kv, 2, uniform(rng, 1, 120)};
  if (shape.op == SinksOp::kDecode) {
    c.uniform_q = true;
    c.q_lens.assign(4, shape.q_per_request);
  } else {
    c.q_lens = {3, shape.long_q > 0 ? shape.long_q : uniform(rng, 10, 70), 5, uniform(rng, 1, 40)};
  }
  if (shape.long_kv > 0) {  // the long request dominates (so that planners split it)
    c.kv_lens[3] = uniform(rng, 1, 8);
    if (!c.uniform_q) c.q_lens[3] = uniform(rng, 1, 2);
  }
  // NaN-filled stride padding (multiples of 8: 16-byte rows for the GPU copies).
  c.q_head_pad = 8;
  c.kv_token_pad = 8;
  c.o_token_pad = 8;
  c.with_lse = true;
  c.with_sinks = true;
  return c;
}

std::string check_sinks(const AttentionBuffers& buffers, const Outputs& actual,
                        const Outputs& expected, double tolerance, double lse_tolerance) {
  const Comparison result = compare_outputs(buffers, actual, expected);
  if (result.ok(tolerance, lse_tolerance)) return "";
  return result.describe() + "\n  case: " + buffers.test_case.describe();
}

}  // namespace tessera::test
