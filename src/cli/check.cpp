#include "cli/check.hpp"

namespace tessera::cli {
int run_check(const CheckOptions&) { return 0; }
}  // namespace tessera::cli
