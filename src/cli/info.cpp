#include "cli/info.hpp"

#include <iostream>
#include <optional>
#include <sstream>
#include <string>

#include "core/settings.hpp"
#include "tessera/backend.hpp"
#include "tessera/types.hpp"

namespace tessera::cli {

int run_info() {
  const BuildInfo build = build_info();
  std::cout << "tessera " << build.version << "\n";
  if (build.cuda) {
    std::cout << "build: CUDA backend compiled in, archs " << build.cuda_archs << "\n";
  } else {
    std::cout << "build: no CUDA backend (CPU only; configure with -DTESSERA_ENABLE_CUDA=ON and "
                 "nvcc to build it)\n";
  }
  std::cout << "cpu kernels: " << build.cpu_isa;
  if (build.cpu_isa != build.cpu_isa_supported) {
    std::cout << " (TESSERA_CPU_ISA caps it; this CPU has " << build.cpu_isa_supported << ")";
  }
  std::cout << "\n"
            << describe_device(Device{DeviceType::kCPU, 0}) << "\n"
            << "cuda devices: " << cuda_device_count() << "\n";
  if (build.cuda && cuda_device_count() == 0) {
    std::cout << "  (" << cuda_unavailable_reason() << ")\n";
  }
  for (int i = 0; i < cuda_device_count(); ++i) {
    std::cout << "  " << describe_device(Device{DeviceType::kCUDA, i}) << "\n";
  }
  return 0;
}

namespace {

// Parses the environment again (the CLI runs no other thread now) and returns what the registry
// reported on stderr meanwhile: one "tessera: ignoring NAME='value': expected ..." line per
// malformed value, whose default is in force.
std::string parse_settings_again() {
  std::ostringstream captured;
  std::streambuf* const saved = std::cerr.rdbuf(captured.rdbuf());
  try {
    detail::reload_settings();
  } catch (...) {
    std::cerr.rdbuf(saved);
    throw;
  }
  std::cerr.rdbuf(saved);
  return captured.str();
}

}  // namespace

int run_settings(const std::string& markdown_scope) {
  using detail::SettingScope;
  if (!markdown_scope.empty()) {
    for (SettingScope scope :
         {SettingScope::kUser, SettingScope::kDeveloper, SettingScope::kExternal}) {
      if (markdown_scope == detail::setting_scope_name(scope)) {
        std::cout << detail::settings_markdown(scope);
        return 0;
      }
    }
    throw Error(Error::Kind::kInvalidArgument,
                "--markdown: expected user, developer or external, got '" + markdown_scope + "'");
  }
  // Each malformed value is named below (the registry may have said so on stderr already).
  const std::string warnings = parse_settings_again();
  std::cout << "Environment variables Tessera reads (the value in force: from the environment, "
               "or the default)\n";
  for (const detail::SettingDoc& doc : detail::setting_docs()) {
    const std::optional<std::string> value = detail::environment_value(doc.name);
    const char* fallback = *doc.default_value ? doc.default_value : "unset";
    std::cout << "\n"
              << doc.name << " (" << detail::setting_scope_name(doc.scope) << ", " << doc.type
              << ", default " << fallback << ")\n"
              << "  " << doc.doc << "\n"
              << "  in force: ";
    if (!value || value->empty()) {
      std::cout << fallback << " (default)\n";
    } else if (warnings.find(std::string("ignoring ") + doc.name + "=") != std::string::npos) {
      std::cout << fallback << " (default; the environment's '" << *value << "' is ignored)\n";
    } else {
      std::cout << "'" << *value << "' (from the environment)\n";
    }
  }
  return 0;
}

}  // namespace tessera::cli
