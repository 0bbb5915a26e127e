// Small helpers shared by GPU test files: the skip-without-device guard, seeds and the reduced
// (compute-sanitizer friendly) mode from the environment, random picks, an owning device buffer
// and CUDA tensor views over it. Header-only; only meaningful in builds with the CUDA backend.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "tessera/types.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"

namespace tessera::test {

inline constexpr Device kGpu{DeviceType::kCUDA, 0};

#define TESSERA_SKIP_WITHOUT_GPU()                             \
  do {                                                         \
    if (::tessera::detail::cuda_device_count_or_zero() == 0) { \
      GTEST_SKIP() << "no CUDA device: GPU tests skipped";     \
    }                                                          \
  } while (0)

// TESSERA_TEST_SEED overrides a file's default seed (to reproduce or vary a random run).
inline uint64_t seed_from_env(uint64_t default_seed) {
  const char* env = std::getenv("TESSERA_TEST_SEED");
  return env ? std::strtoull(env, nullptr, 10) : default_seed;
}

// TESSERA_TEST_REDUCED=1: shrink random suites (compute-sanitizer runs).
inline bool reduced_run() {
  const char* env = std::getenv("TESSERA_TEST_REDUCED");
  return env != nullptr && std::string(env) == "1";
}

inline int32_t uniform(std::mt19937_64& rng, int32_t low, int32_t high) {  // inclusive
  return std::uniform_int_distribution<int32_t>(low, high)(rng);
}
inline bool chance(std::mt19937_64& rng, double p) {
  return std::bernoulli_distribution(p)(rng);
}
template <class T>
T pick(std::mt19937_64& rng, const std::vector<T>& values) {
  return values[static_cast<size_t>(uniform(rng, 0, static_cast<int32_t>(values.size()) - 1))];
}

// Owning device allocation, optionally initialised from a host vector.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes = 0) : bytes_(bytes), data_(detail::cuda_alloc(bytes)) {}
  template <class T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    upload(host);
  }
  ~DeviceBuffer() { detail::cuda_free(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <class T>
  void upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size() * sizeof(T), bytes_);
    detail::cuda_copy_to_device(data_, host.data(), bytes_, nullptr);
  }
  template <class T>
  std::vector<T> download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    detail::cuda_copy_to_host(host.data(), data_, bytes_, nullptr);
    return host;
  }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
  void* data_ = nullptr;
};

inline TensorView gpu_view(const DeviceBuffer& buffer, DType dtype,
                           std::initializer_list<int64_t> shape,
                           std::initializer_list<int64_t> stride) {
  return make_view(buffer.data(), dtype, shape, stride, kGpu);
}
inline TensorView gpu_index_view(const DeviceBuffer& buffer, int64_t count) {
  return make_view(buffer.data(), DType::kInt32, {count}, kGpu);
}

}  // namespace tessera::test

#endif  // TESSERA_HAVE_CUDA
