// Shared cases of the attention-sink tests (tests/test_sinks.cpp on the CPU,
// tests/test_cuda_sinks.cpp on the GPU): the matrix of shapes (op x GQA x mask x head_dim x
// dtype), the random case of one shape (with empty requests, requests with fewer keys than
// queries and a long one) and an independent check of an output against the definition
// (include/tessera/attention.hpp) from the sink-free reference.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/attention_testing.hpp"

namespace tessera::test {

// default_seed, or TESSERA_TEST_SEED when set (to reproduce or vary a random run).
uint64_t sinks_seed(uint64_t default_seed);

enum class SinksOp : int32_t { kRagged, kPaged, kDecode };
const char* sinks_op_name(SinksOp op);

enum class SinksMask : int32_t { kNone, kCausal, kWindow, kCausalSoftCap };
inline constexpr SinksMask kAllSinksMasks[] = {SinksMask::kNone, SinksMask::kCausal,
                                               SinksMask::kWindow, SinksMask::kCausalSoftCap};

struct SinksShape {
  SinksOp op = SinksOp::kRagged;
  SinksMask mask = SinksMask::kNone;
  int32_t group_size = 1;  // query heads per kv head (2 kv heads)
  int32_t head_dim = 64;
  DType dtype = DType::kFloat16;
  int32_t page_size = 16;
  int32_t q_per_request = 1;  // decode
  int32_t long_kv = 0;        // > 0: request 1 has this many keys (split-KV)
  int32_t long_q = 0;         // > 0 (prefill): request 1 has this many queries
  std::string describe() const;
};

// op x mask x GQA 1 / 4 / 8 x head_dims, dtypes fp16 / bf16 in turn, decode's q_per_request
// 1..4 in turn.
std::vector<SinksShape> sinks_matrix(SinksOp op, const std::vector<int32_t>& head_dims);

// Four requests: one without keys (o = 0, lse = sink), a long one, one with fewer keys than
// queries (causal rows without keys) and a random one; stride padding; with_sinks and lse on.
AttentionCase sinks_case(const SinksShape& shape, std::mt19937_64& rng);

// "" when `actual` (an implementation's outputs on buffers, which has sinks) is within
// tolerance of `expected` (the reference with sinks) and every row without keys is o = 0,
// lse = its sink; otherwise what failed.
std::string check_sinks(const AttentionBuffers& buffers, const Outputs& actual,
                        const Outputs& expected, double tolerance, double lse_tolerance);

}  // namespace tessera::test
