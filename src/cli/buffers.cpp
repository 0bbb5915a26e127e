#include "cli/buffers.hpp"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/half.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#include "devtools/bench_support.hpp"
#endif

namespace tessera::cli {

Buffer::Buffer(Device device, size_t bytes) : device_(device), bytes_(bytes) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    data_ = std::malloc(bytes);
    if (!data_) throw Error(Error::Kind::kRuntime, "tessera bench: out of host memory");
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  data_ = detail::cuda_alloc(bytes);
#endif
}

Buffer::~Buffer() {
  if (!data_) return;
  if (device_.type == DeviceType::kCPU) {
    std::free(data_);
  } else {
#if defined(TESSERA_HAVE_CUDA)
    detail::cuda_free(data_);
#endif
  }
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  std::swap(device_, other.device_);
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

void Buffer::fill_random(DType dtype, uint64_t seed, float scale) {
  const int64_t count = static_cast<int64_t>(bytes_ / dtype_size(dtype));
  if (device_.type == DeviceType::kCPU) {
    uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int64_t i = 0; i < count; ++i) {
      state ^= state << 13;  // xorshift64
      state ^= state >> 7;
      state ^= state << 17;
      const float unit = static_cast<float>(state >> 40) * (1.0f / 16777216.0f);
      detail::store_from_float(data_, dtype, i, (2.0f * unit - 1.0f) * scale);
    }
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  devtools::cuda_fill_random(data_, count, dtype, seed, scale, nullptr);
#endif
}

void Buffer::poison() {
  if (device_.type == DeviceType::kCPU) {
    std::memset(data_, 0xff, bytes_);
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  detail::cuda_memset(data_, 0xff, bytes_, nullptr);
#endif
}

void Buffer::copy_from_host(const void* source, size_t bytes, size_t offset) {
  if (device_.type == DeviceType::kCPU) {
    std::memcpy(static_cast<char*>(data_) + offset, source, bytes);
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  detail::cuda_copy_to_device(static_cast<char*>(data_) + offset, source, bytes, nullptr);
#endif
}

void Buffer::copy_to_host(void* destination, size_t bytes, size_t offset) const {
  if (device_.type == DeviceType::kCPU) {
    std::memcpy(destination, static_cast<const char*>(data_) + offset, bytes);
    return;
  }
#if defined(TESSERA_HAVE_CUDA)
  detail::cuda_copy_to_host(destination, static_cast<const char*>(data_) + offset, bytes,
                            nullptr);
#endif
}

}  // namespace tessera::cli
