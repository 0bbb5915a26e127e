// Device-agnostic buffers for the CLI: allocation on the CPU or a CUDA device, random fill,
// poisoning and copies back to the host.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/types.hpp"

namespace tessera::cli {

class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

  // Uniform values in [-scale, scale) of `dtype`, reproducible from `seed`.
  void fill_random(DType dtype, uint64_t seed, float scale = 1.0f);
  // Every byte set to 0xff: NaN in fp16, bf16 and fp32, so unwritten outputs show.
  void poison();
  void copy_from_host(const void* source, size_t bytes, size_t offset = 0);
  void copy_to_host(void* destination, size_t bytes, size_t offset = 0) const;

 private:
  Device device_{};
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace tessera::cli
