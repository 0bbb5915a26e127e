// NCCL without a link-time dependency: libnccl.so.2 (or $TESSERA_NCCL_LIBRARY) is opened with
// dlopen at the first context-parallel call that communicates, and the handful of functions it
// needs are resolved with dlsym. A build host without NCCL builds and runs everything else.
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "core/settings.hpp"
#include "cp/cp_internal.hpp"
#include "tessera/context_parallel.hpp"

namespace tessera {
namespace detail {
namespace {

constexpr int kMinimumVersion = 20700;  // 2.7.0: ncclSend / ncclRecv

std::mutex g_mutex;
NcclApi g_api;
bool g_loaded = false;

int normalised_version(int code) {
  // NCCL < 2.9 encoded major * 1000 + minor * 100 + patch.
  return code < 10000 ? (code / 1000) * 10000 + (code % 1000 / 100) * 100 + code % 100 : code;
}

std::string version_string(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." +
         std::to_string(code % 100);
}

template <class Function>
void resolve(void* handle, const std::string& library, const char* name, Function& out) {
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) {
    throw Error(Error::Kind::kUnsupported, "context parallel: " + library + " has no " + name +
                                               " (not an NCCL library, or one older than 2.7)");
  }
  out = reinterpret_cast<Function>(symbol);
}

void load_locked() {
  if (g_loaded) return;
  const std::string& override_path = settings().nccl_library;
  const std::string library = !override_path.empty() ? override_path : "libnccl.so.2";
  disable_nccl_nvls();  // before NCCL reads its environment
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    throw Error(Error::Kind::kUnsupported,
                "context parallel needs NCCL: could not load " + library + " (" +
                    (reason ? reason : "unknown error") +
                    "); install NCCL >= 2.7 (e.g. the libnccl2 package or the nvidia-nccl-cu12 "
                    "wheel) or set TESSERA_NCCL_LIBRARY to its path");
  }
  NcclApi api;
  try {
    resolve(handle, library, "ncclGetVersion", api.get_version);
    resolve(handle, library, "ncclGetErrorString", api.get_error_string);
    resolve(handle, library, "ncclGroupStart", api.group_start);
    resolve(handle, library, "ncclGroupEnd", api.group_end);
    resolve(handle, library, "ncclSend", api.send);
    resolve(handle, library, "ncclRecv", api.recv);
    resolve(handle, library, "ncclAllGather", api.all_gather);
    resolve(handle, library, "ncclCommCount", api.comm_count);
    resolve(handle, library, "ncclCommUserRank", api.comm_user_rank);
    int code = 0;
    if (api.get_version(&code) != 0) {
      throw Error(Error::Kind::kUnsupported, "context parallel: ncclGetVersion failed in " +
                                                 library);
    }
    api.version = normalised_version(code);
    if (api.version < kMinimumVersion) {
      throw Error(Error::Kind::kUnsupported,
                  "context parallel needs NCCL >= 2.7 (ncclSend / ncclRecv); " + library +
                      " is " + version_string(api.version));
    }
  } catch (...) {
    dlclose(handle);
    throw;
  }
  g_api = api;  // the handle stays open for the life of the process
  g_loaded = true;
}

}  // namespace

const NcclApi& nccl_api() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  load_locked();
  return g_api;
}

void nccl_check(const NcclApi& api, int result, const char* what) {
  if (result == 0) return;
  const char* text = api.get_error_string ? api.get_error_string(result) : nullptr;
  throw Error(Error::Kind::kRuntime, std::string("context parallel: ") + what + " failed: " +
                                         (text ? text : "NCCL error " + std::to_string(result)));
}

}  // namespace detail

bool nccl_available(std::string* why) {
  try {
    const detail::NcclApi& api = detail::nccl_api();
    if (why != nullptr) *why = "NCCL " + detail::version_string(api.version);
    return true;
  } catch (const Error& error) {
    if (why != nullptr) *why = error.what();
    return false;
  }
}

std::string disable_nccl_nvls() {
  // setenv(..., 0): a value the user (or the launcher) set wins.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  return detail::environment_value("NCCL_NVLS_ENABLE").value_or("");
}

}  // namespace tessera
