// Sets (or unsets, for nullptr) an environment variable for one scope and restores what was
// there before, re-reading the library's settings registry (core/settings.hpp) each time so the
// change is seen. Header-only; single-threaded test code only.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include "core/settings.hpp"

namespace tessera::test {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
    detail::reload_settings();
  }
  ~ScopedEnv() {
    if (saved_) {
      setenv(name_, saved_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
    detail::reload_settings();
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

}  // namespace tessera::test
