// `tessera info` (the build and the devices) and `tessera settings` (the environment variables
// Tessera reads, with the value in force).
#pragma once

#include <string>

namespace tessera::cli {

int run_info();
// Every registered setting with its type, default, scope, doc and the value in force; with
// `markdown_scope` (user, developer or external) the registry's markdown table of that scope
// exactly as detail::settings_markdown gives it (the docs are generated from it).
int run_settings(const std::string& markdown_scope);

}  // namespace tessera::cli
