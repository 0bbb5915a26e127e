// Benchmark support on CUDA devices (devtools/bench_support.hpp): on-device random fill, event
// timing with an L2 flush, and device peaks computed from the hardware (never typed in).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "core/settings.hpp"
#include "devtools/bench_support.hpp"

namespace tessera::devtools {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(Error::Kind::kRuntime,
                std::string("tessera: CUDA error in ") + what + ": " + cudaGetErrorString(status));
  }
}

// splitmix64: a counter-based hash, so element i's value does not depend on the launch shape.
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void fill_random_kernel(void* ptr, int64_t count, int dtype, uint64_t seed,
                                   float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    const uint64_t bits = splitmix64(seed * 0x100000001b3ull + static_cast<uint64_t>(i));
    const float unit = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    const float value = (2.0f * unit - 1.0f) * scale;
    switch (static_cast<DType>(dtype)) {
      case DType::kFloat32: static_cast<float*>(ptr)[i] = value; break;
      case DType::kFloat16: static_cast<__half*>(ptr)[i] = __float2half(value); break;
      case DType::kBFloat16:
        static_cast<__nv_bfloat16*>(ptr)[i] = __float2bfloat16(value);
        break;
      default: static_cast<uint8_t*>(ptr)[i] = static_cast<uint8_t>(bits >> 56) & 0x77; break;
    }
  }
}

__global__ void flush_kernel(int4* buffer, int64_t count, int salt) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    buffer[i] = make_int4(salt, salt, salt, salt);
  }
}

// Reads `count` int4 and stores nothing unless the xor of everything read equals `salt` (never,
// for the buffers here): a pure DRAM read that the compiler cannot drop. Used as the read-mode
// L2 flush (it leaves the L2 full of clean lines) and as the read ceiling.
__global__ void read_kernel(const int4* buffer, int64_t count, int salt, int* sink) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    const int4 v = __ldcs(buffer + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == salt) *sink = acc;
}

// TESSERA_BENCH_FLUSH (settings().bench_flush): how the timed loops evict the inputs from L2
// before each timed call.
//   write (default, also triton's do_bench): overwrite a 256 MB scratch buffer. The L2 is left
//          full of dirty lines, whose write-back the timed kernel pays (up to the L2's size).
//   read:  read the scratch buffer instead: the L2 is left full of clean lines.
//   none:  no flush (inputs that fit in L2 are served from it).
using FlushMode = detail::BenchFlush;

FlushMode flush_mode() { return detail::settings().bench_flush; }

// The scratch buffer of one timed loop and its per-iteration flush.
struct L2Flush {
  FlushMode mode = FlushMode::kNone;
  int4* buffer = nullptr;
  int* sink = nullptr;
  int64_t count = 0;

  L2Flush(size_t bytes, FlushMode wanted) {
    count = static_cast<int64_t>(bytes / sizeof(int4));
    mode = count > 0 ? wanted : FlushMode::kNone;
    if (mode == FlushMode::kNone) return;
    check_cuda(cudaMalloc(&buffer, count * sizeof(int4)), "flush alloc");
    check_cuda(cudaMalloc(&sink, sizeof(int)), "flush alloc");
    flush_kernel<<<1024, 256>>>(buffer, count, 0x5a5a5a5a);  // defined contents for reads
    check_cuda(cudaGetLastError(), "flush_kernel launch");
  }
  ~L2Flush() {
    if (buffer != nullptr) cudaFree(buffer);
    if (sink != nullptr) cudaFree(sink);
  }
  L2Flush(const L2Flush&) = delete;
  L2Flush& operator=(const L2Flush&) = delete;

  void run(cudaStream_t stream, int iteration) const {
    if (mode == FlushMode::kWrite) {
      flush_kernel<<<1024, 256, 0, stream>>>(buffer, count, iteration);
    } else if (mode == FlushMode::kRead) {
      read_kernel<<<1024, 256, 0, stream>>>(buffer, count, 1, sink);  // xor of 0x5a.. is 0
    }
  }
};

// Dense bf16 tensor-core FLOP per clock per SM, by architecture (vendor whitepapers):
// A100 (sm_80) 2048, sm_86/sm_89 (GeForce/L-series) 1024, H100/H200 (sm_90) 4096.
double tensor_flop_per_clock_per_sm(int major, int minor) {
  if (major == 9) return 4096.0;
  if (major == 8 && minor == 0) return 2048.0;
  if (major == 8) return 1024.0;
  if (major >= 10) return 8192.0;
  return 512.0;
}

}  // namespace

void cuda_fill_random(void* ptr, int64_t count, DType dtype, uint64_t seed, float scale,
                      void* stream) {
  if (count == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 65536));
  fill_random_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      ptr, count, static_cast<int>(dtype), seed, scale);
  check_cuda(cudaGetLastError(), "fill_random_kernel launch");
}

const char* bench_flush_name() {
  switch (flush_mode()) {
    case FlushMode::kWrite: return "write";
    case FlushMode::kRead: return "read";
    case FlushMode::kNone: return "none";
  }
  return "?";
}

TimingStats cuda_time_ms(void (*launch)(void*), void* context, int warmup, int iters,
                         void* stream, size_t flush_bytes) {
  auto s = static_cast<cudaStream_t>(stream);
  const L2Flush flush(flush_bytes, flush_mode());
  for (int i = 0; i < warmup; ++i) launch(context);
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "event create");
  check_cuda(cudaEventCreate(&stop), "event create");
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    flush.run(s, i);
    check_cuda(cudaEventRecord(start, s), "event record");
    launch(context);
    check_cuda(cudaEventRecord(stop, s), "event record");
    check_cuda(cudaEventSynchronize(stop), "event synchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "event elapsed");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return summarize(std::move(times));
}

TimingStats cuda_graph_time_ms(void (*launch)(void*, void*), void* context, int warmup,
                               int iters, size_t flush_bytes) {
  // Owns the stream, the graph and its executable; ends a capture an error left open.
  struct GraphReplay {
    cudaStream_t stream = nullptr;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ~GraphReplay() {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (stream != nullptr && cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
          status != cudaStreamCaptureStatusNone) {
        cudaGraph_t broken = nullptr;
        cudaStreamEndCapture(stream, &broken);
        if (broken != nullptr) cudaGraphDestroy(broken);
      }
      if (exec != nullptr) cudaGraphExecDestroy(exec);
      if (graph != nullptr) cudaGraphDestroy(graph);
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
  } replay;
  check_cuda(cudaStreamCreateWithFlags(&replay.stream, cudaStreamNonBlocking), "stream create");
  launch(context, replay.stream);  // one call outside capture: per-device kernel setup
  check_cuda(cudaStreamSynchronize(replay.stream), "stream synchronize");
  check_cuda(cudaStreamBeginCapture(replay.stream, cudaStreamCaptureModeThreadLocal),
             "begin capture");
  launch(context, replay.stream);
  check_cuda(cudaStreamEndCapture(replay.stream, &replay.graph), "end capture");
  check_cuda(cudaGraphInstantiate(&replay.exec, replay.graph, 0), "graph instantiate");
  return cuda_time_ms(
      [](void* r) {
        auto* self = static_cast<GraphReplay*>(r);
        check_cuda(cudaGraphLaunch(self->exec, self->stream), "graph launch");
      },
      &replay, warmup, iters, replay.stream, flush_bytes);
}

void cuda_device_peaks(int device, double* dense_bf16_tflops, double* dram_tbps,
                       std::string* how) {
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  int clock_khz = 0, memory_clock_khz = 0, bus_bits = 0;
  check_cuda(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device), "clock rate");
  check_cuda(cudaDeviceGetAttribute(&memory_clock_khz, cudaDevAttrMemoryClockRate, device),
             "memory clock rate");
  check_cuda(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device),
             "memory bus width");
  const double per_sm = tensor_flop_per_clock_per_sm(prop.major, prop.minor);
  *dense_bf16_tflops = prop.multiProcessorCount * per_sm * clock_khz * 1e3 / 1e12;
  // Double data rate: two transfers per memory clock.
  *dram_tbps = 2.0 * memory_clock_khz * 1e3 * (bus_bits / 8.0) / 1e12;
  if (how) {
    *how = std::to_string(prop.multiProcessorCount) + " SMs x " +
           std::to_string(clock_khz / 1000) + " MHz x " + std::to_string(int(per_sm)) +
           " bf16 FLOP/clk/SM; memory " + std::to_string(memory_clock_khz / 1000) + " MHz x " +
           std::to_string(bus_bits) + "-bit x 2";
  }
}

double cuda_read_ceiling_ms(size_t bytes, int iters, size_t flush_bytes) {
  const int64_t count = static_cast<int64_t>(bytes / sizeof(int4));
  if (count <= 0) return 0.0;
  struct Buffers {
    int4* data = nullptr;
    int* sink = nullptr;
    int blocks = 0;
    int64_t count = 0;
    ~Buffers() {
      if (data != nullptr) cudaFree(data);
      if (sink != nullptr) cudaFree(sink);
    }
  } buffers;
  buffers.count = count;
  check_cuda(cudaMalloc(&buffers.data, count * sizeof(int4)), "read ceiling alloc");
  check_cuda(cudaMalloc(&buffers.sink, sizeof(int)), "read ceiling alloc");
  flush_kernel<<<1024, 256>>>(buffers.data, count, 0x12345678);
  check_cuda(cudaGetLastError(), "flush_kernel launch");
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  // 8 CTAs of 256 threads per SM, each thread striding over the buffer with 16-byte loads.
  buffers.blocks = static_cast<int>(std::min<int64_t>(int64_t{sms} * 8, (count + 255) / 256));
  return cuda_time_ms(
      [](void* context) {
        auto* b = static_cast<Buffers*>(context);
        read_kernel<<<b->blocks, 256>>>(b->data, b->count, 1, b->sink);
        check_cuda(cudaGetLastError(), "read_kernel launch");
      },
      &buffers, 3, iters, nullptr, flush_bytes).median;
}

namespace {
// A parameter block the size of the decode kernels' (DecodeArgs is ~0.5 KB).
struct LaunchFloorParams {
  unsigned char bytes[512];
};
__global__ void empty_kernel() {}
__global__ void empty_kernel_params(const __grid_constant__ LaunchFloorParams) {}
}  // namespace

double cuda_launch_floor_us(int calls, bool large_params) {
  const LaunchFloorParams params{};
  const auto launch = [&] {
    if (large_params) {
      empty_kernel_params<<<132, 128>>>(params);
    } else {
      empty_kernel<<<132, 128>>>();
    }
  };
  for (int i = 0; i < 200; ++i) launch();
  double best = 1e30;
  for (int batch = 0; batch < 20; ++batch) {
    check_cuda(cudaDeviceSynchronize(), "synchronize");
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) launch();
    const auto stop = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::micro>(stop - start).count() / calls);
  }
  check_cuda(cudaGetLastError(), "empty_kernel launch");
  check_cuda(cudaDeviceSynchronize(), "synchronize");
  return best;
}

}  // namespace tessera::devtools
