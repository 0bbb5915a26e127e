#pragma once

namespace tessera {
inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;
const char* version_string();
}  // namespace tessera
