// Benchmark support on CUDA devices (src/devtools/bench_support.cu): on-device random fill, event
// timing with an L2 flush, a graph-replay timer, the DRAM read ceiling, the launch floor and
// device peaks computed from the hardware. Part of tessera_devtools (the CLI, tests and bench
// drivers link it; the library does not). Host-callable, no CUDA headers needed to include it;
// defined only in builds with the CUDA backend (TESSERA_HAVE_CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "devtools/timing.hpp"
#include "tessera/types.hpp"

namespace tessera::devtools {

// Fills `count` elements of `dtype` with uniform values in [-scale, scale) from a counter-based
// hash of (seed, index): reproducible, never all zeros.
void cuda_fill_random(void* ptr, int64_t count, DType dtype, uint64_t seed, float scale,
                      void* stream);
// Times `iters` launches of `launch` (after `warmup` launches), each with CUDA events on
// `stream`: median, min and max in milliseconds. Before each timed launch `flush_bytes` of a
// scratch buffer are overwritten so the L2 holds nothing of the inputs (0: no flush);
// TESSERA_BENCH_FLUSH=read reads them instead (the L2 is left clean, not dirty), =none skips the
// flush.
TimingStats cuda_time_ms(void (*launch)(void*), void* context, int warmup, int iters, void* stream,
                         size_t flush_bytes);
// The same for a CUDA graph: `launch(context, stream)` runs once on a new stream (warm-up),
// is captured into a graph, and `iters` timed graph launches are measured, each after a flush
// of `flush_bytes` (outside the timed events).
TimingStats cuda_graph_time_ms(void (*launch)(void*, void*), void* context, int warmup, int iters,
                               size_t flush_bytes);
// Median milliseconds of a plain 16-byte-load read of `bytes` (the DRAM read ceiling for a kernel
// that reads that much), timed like cuda_time_ms with the same flush.
double cuda_read_ceiling_ms(size_t bytes, int iters, size_t flush_bytes);
// Host microseconds per launch of an empty 132 x 128 kernel (best of 20 batches of `calls`),
// with a 512-byte parameter block when `large_params`: the launch floor under run().
double cuda_launch_floor_us(int calls, bool large_params);
// The datasheet-style peaks of a device, derived from its SM count, clocks, memory bus and a
// table of per-SM tensor-core throughput by architecture. `how` says which numbers were used.
void cuda_device_peaks(int device, double* dense_bf16_tflops, double* dram_tbps, std::string* how);
// The name of the L2 flush in force (TESSERA_BENCH_FLUSH): "write", "read" or "none".
const char* bench_flush_name();

}  // namespace tessera::devtools
