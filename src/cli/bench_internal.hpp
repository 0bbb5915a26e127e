// The pieces of `tessera bench` shared by its files (bench.cpp: the main table; bench_suites.cpp:
// the cases; bench_plan.cpp: --suite plan; bench_floor.cpp: --suite overhead and roofline).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "cli/bench.hpp"

namespace tessera::cli {

std::string format_double(double value, int precision);

// The suites' case builders: a dense prefill of `tokens` tokens in requests of `seq` with
// hidden / head_dim heads, and the GQA 32/8 d128 shapes of every op (page: page size, paged ops).
BenchCase prefill_case(int head_dim, int seq, bool causal, int tokens, int hidden);
BenchCase gqa_case(AttentionOp op, int batch, int q_len, int kv_len, bool causal, int page);
// The cases of `--suite serving` (GPU).
std::vector<BenchCase> serving_cases();
// The decode cases of the standard CUDA suite (`--suite roofline` reads the same shapes).
std::vector<BenchCase> decode_suite_cases();

// FLOP and byte counts of a case: visible (row, key) pairs of all requests and heads' rows, and
// keys of all requests.
double visible_pairs(const BenchCase& c);
double total_keys(const BenchCase& c);

// Larger than the 50-60 MB L2 of current data-centre GPUs.
inline constexpr size_t kL2FlushBytes = 256ull << 20;

int run_plan_bench(const BenchOptions& options);
int run_overhead_bench(const BenchOptions& options);
int run_roofline_bench(const BenchOptions& options);

}  // namespace tessera::cli
