// `tessera check`: the correctness sweep alone — random configurations (the generator the test
// suite uses) run on the chosen backend and compared with the double-precision reference.
#pragma once

#include <cstdint>
#include <string>

namespace tessera::cli {

struct CheckOptions {
  std::string backend = "auto";
  int num_configs = 100;
  uint64_t seed = 2026;
};

int run_check(const CheckOptions& options);

}  // namespace tessera::cli
