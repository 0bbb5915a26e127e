// `tessera tune`: times the decode kernel variants (CUDA cores or tensor cores with several
// warps x stages) and split-KV minimum chunks on the GPU for a grid of GQA groups, head_dims
// and K/V dtypes, checks every candidate against the reference, and writes the best per shape
// into the tuning file that decode dispatch reads (src/core/tuning.hpp).
#pragma once

#include <string>

namespace tessera::cli {

struct TuneOptions {
  std::string out_path;  // empty: the standard location (detail::default_tuning_file_path)
  bool dry_run = false;  // measure and print, write nothing
  int iterations = 10;   // timed runs per (candidate, batch shape)
  std::string filter;    // non-empty: only the shapes whose label ("d128 group 4 bf16") has it
                         // as whole words
  bool progress = true;
};

// Returns the process exit status: 0 when every tuned shape found a correct candidate (and the
// file was written), non-zero without a CUDA device or when a shape had none.
int run_tune(const TuneOptions& options);

}  // namespace tessera::cli
