// `tessera info` (the build and the devices) and `tessera settings` (the environment variables
// Tessera reads, with the value in force).
#pragma once

namespace tessera::cli {

int run_info();

}  // namespace tessera::cli
