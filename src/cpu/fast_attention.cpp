// Driver of the fast CPU attention path: checks the plan against the problem, picks the kernel
// for the host's ISA, runs the plan's work items on a persistent thread pool and merges split-KV
// partials.
//
// Work items write disjoint outputs (final rows or their own partial rows) and each is computed
// by one thread from start to end, so the result is bit-identical for any thread count and any
// schedule. Threads therefore pull items from one shared counter in plan order instead of
// replaying the plan's per-worker lists: the plan's worker count is a GPU notion (persistent
// CTAs) and the CPU balances better dynamically.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"
#include "core/workspace_layout.hpp"
#include "cpu/cpu_info.hpp"
#include "cpu/fast_attention_impl.hpp"
#include "cpu/sink.hpp"
#include "tessera/backend.hpp"

namespace tessera::detail {
namespace {

// Persistent worker threads: spawning threads per call costs tens of microseconds, as much as a
// whole decode step.
class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

  // Runs task(participant) for participant = 0 .. participants-1 concurrently, the caller being
  // participant 0, and returns when all are done (rethrowing the first exception). A call made
  // while the pool is busy (another caller thread, or a nested call) runs on its own thread only,
  // which the tasks handle since they share work through a counter.
  void run(int participants, const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || participants <= 1) {
      task(0);
      return;
    }
    adopt_after_fork();
    const int helpers = participants - 1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(workers_.size()) < helpers) {
        const int index = static_cast<int>(workers_.size());
        workers_.emplace_back([this, index] { worker_main(index); });
      }
      task_ = &task;
      active_ = helpers;
      remaining_ = helpers;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    std::exception_ptr caller_error;
    try {
      task(0);
    } catch (...) {
      caller_error = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [this] { return remaining_ == 0; });
    task_ = nullptr;
    if (caller_error) std::rethrow_exception(caller_error);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  ThreadPool() = default;

  void worker_main(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (index >= active_) continue;
      const std::function<void(int)>* task = task_;
      lock.unlock();
      std::exception_ptr error;
      try {
        (*task)(index + 1);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error && !error_) error_ = error;
      if (--remaining_ == 0) finished_.notify_one();
    }
  }

  // A forked child inherits the pool object but not its threads: forget them (their handles
  // are leaked on purpose; joining threads that do not exist here would hang) and start afresh.
  void adopt_after_fork() {
    const pid_t pid = getpid();
    if (owner_pid_ == pid) return;
    if (!workers_.empty()) new std::vector<std::thread>(std::move(workers_));
    workers_.clear();
    owner_pid_ = pid;
  }

  std::mutex busy_;  // held by the caller owning the pool for one run()
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable finished_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* task_ = nullptr;
  int active_ = 0;     // helpers taking part in the current run
  int remaining_ = 0;  // helpers still running it
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  pid_t owner_pid_ = getpid();
};

// Per-thread scratch memory, grown on demand and kept for the next call.
class ScratchBuffer {
 public:
  void* reserve(size_t bytes) {
    if (bytes > capacity_) {
      data_.reset(new std::byte[bytes]);
      capacity_ = bytes;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<std::byte[]> data_;
  size_t capacity_ = 0;
};

[[noreturn]] void invalid(const std::string& message) {
  throw Error(Error::Kind::kInvalidArgument, "cpu attention: " + message);
}

std::string item_text(const WorkItem& item, size_t index) {
  return "plan.work[" + std::to_string(index) + "] (request " + std::to_string(item.request) +
         ", kv_head " + std::to_string(item.kv_head) + ", q " + std::to_string(item.q_start) + "+" +
         std::to_string(item.q_len) + ", kv " + std::to_string(item.kv_start) + ".." +
         std::to_string(item.kv_end) + ", partial_row " + std::to_string(item.partial_row) + ")";
}

// Every index a work item or merge dereferences is checked here, so a plan built for other
// lengths (or a stale plan) raises an error instead of reading or writing out of bounds.
void check_plan(const Plan& plan, const AttentionProblem& problem, const Workspace& workspace) {
  if (problem.num_kv_heads <= 0 || problem.num_qo_heads <= 0 ||
      problem.num_qo_heads % problem.num_kv_heads != 0) {
    invalid("num_qo_heads (" + std::to_string(problem.num_qo_heads) +
            ") must be a positive multiple of num_kv_heads (" +
            std::to_string(problem.num_kv_heads) + ")");
  }
  if (problem.head_dim <= 0) invalid("head_dim must be positive");
  if (plan.head_dim != problem.head_dim || plan.head_dim_v() != problem.head_dim_v() ||
      plan.num_qo_heads != problem.num_qo_heads ||
      plan.num_kv_heads != problem.num_kv_heads || plan.batch_size != problem.batch_size) {
    invalid("plan was made for another shape (plan: batch " + std::to_string(plan.batch_size) +
            ", heads " + std::to_string(plan.num_qo_heads) + "/" +
            std::to_string(plan.num_kv_heads) + ", head_dim " + std::to_string(plan.head_dim) +
            "; tensors: batch " + std::to_string(problem.batch_size) + ", heads " +
            std::to_string(problem.num_qo_heads) + "/" + std::to_string(problem.num_kv_heads) +
            ", head_dim " + std::to_string(problem.head_dim) + ")");
  }
  const DType q_dtype = problem.q_dtype;
  if (q_dtype != DType::kFloat32 && q_dtype != DType::kFloat16 && q_dtype != DType::kBFloat16) {
    throw Error(Error::Kind::kUnsupported, std::string("cpu attention: q dtype ") +
                                               dtype_name(q_dtype) +
                                               " (expected float32, float16 or bfloat16)");
  }
  const DType kv_dtype = problem.kv.dtype;
  if (kv_dtype == DType::kInt32 || kv_dtype == DType::kInt64 || kv_dtype == DType::kUInt8) {
    throw Error(Error::Kind::kUnsupported,
                std::string("cpu attention: kv dtype ") + dtype_name(kv_dtype));
  }
  const int64_t group_size = problem.group_size();
  const int64_t partial_rows = plan.num_partial_rows;
  for (size_t index = 0; index < plan.work.size(); ++index) {
    const WorkItem& item = plan.work[index];
    bool ok = item.request >= 0 && item.request < problem.batch_size && item.kv_head >= 0 &&
              item.kv_head < problem.num_kv_heads && item.q_start >= 0 && item.q_len >= 0;
    ok = ok && static_cast<int64_t>(item.q_start) + item.q_len <= problem.q_len(item.request) &&
         item.kv_start >= 0 && item.kv_start <= item.kv_end &&
         item.kv_end <= problem.kv.kv_len(item.request);
    ok = ok && (item.partial_row == -1 ||
                (item.partial_row >= 0 &&
                 item.partial_row + static_cast<int64_t>(item.q_len) * group_size <= partial_rows));
    if (!ok) invalid(item_text(item, index) + " does not fit the tensors");
  }
  for (size_t index = 0; index < plan.merges.size(); ++index) {
    const MergeItem& merge = plan.merges[index];
    bool ok = merge.request >= 0 && merge.request < problem.batch_size && merge.kv_head >= 0 &&
              merge.kv_head < problem.num_kv_heads && merge.q_start >= 0 && merge.q_len >= 0 &&
              merge.num_splits >= 0 && merge.first_partial_row >= 0;
    ok = ok && static_cast<int64_t>(merge.q_start) + merge.q_len <= problem.q_len(merge.request);
    ok = ok && merge.first_partial_row +
                       static_cast<int64_t>(merge.num_splits) * merge.q_len * group_size <=
                   partial_rows;
    if (!ok) invalid("plan.merges[" + std::to_string(index) + "] does not fit the tensors");
  }
  if (partial_rows > 0) {
    const size_t needed = WorkspaceLayout::of(plan).total;
    if (workspace.data == nullptr || workspace.bytes < needed) {
      invalid("workspace holds " + std::to_string(workspace.bytes) + " bytes, the plan needs " +
              std::to_string(needed));
    }
  }
}

FastKernelEntry kernel_for(CpuIsa isa) {
  if (!cpu_supports(isa)) {
    throw Error(Error::Kind::kUnsupported, std::string("cpu attention: this CPU cannot run the ") +
                                               cpu_isa_name(isa) + " kernels");
  }
  switch (isa) {
    case CpuIsa::kAvx512: return fast_kernel_avx512();
    case CpuIsa::kAvx2: return fast_kernel_avx2();
    case CpuIsa::kGeneric: break;
  }
  return fast_kernel_generic();
}

// Combines the num_splits float partials of every row of one merge item into the output, as
// one pass over all the keys would have: an empty split (lse = -inf) has weight 0, a NaN split
// (lse NaN: it met a NaN or +inf score) makes the row NaN (include/tessera/attention.hpp).
// The row's sink, if any, is folded into the merged row (the partials never hold it).
void merge_partials(const AttentionProblem& problem, const MergeItem& merge, const float* partial_o,
                    const float* partial_lse, std::vector<float>* row) {
  const int32_t group_size = problem.group_size();
  const int32_t head_dim = problem.head_dim_v();  // partials and o hold v-width rows
  const int64_t rows = static_cast<int64_t>(merge.q_len) * group_size;
  const int64_t first_token = static_cast<int64_t>(problem.q_begin(merge.request)) + merge.q_start;
  row->resize(head_dim);
  float* acc = row->data();
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float max_lse = -kInfinity;
    bool poisoned = false;  // a split met a NaN / +inf score (lse NaN): the row is NaN
    for (int32_t s = 0; s < merge.num_splits; ++s) {
      const float split_lse = partial_lse[merge.first_partial_row + s * rows + r];
      poisoned = poisoned || !(split_lse < kInfinity);
      max_lse = std::max(max_lse, split_lse);
    }
    std::fill(acc, acc + head_dim, poisoned ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
    float lse = poisoned ? std::numeric_limits<float>::quiet_NaN() : max_lse;
    if (!poisoned && max_lse != -kInfinity) {
      float weight_sum = 0.0f;
      for (int32_t s = 0; s < merge.num_splits; ++s) {
        const int64_t partial = merge.first_partial_row + s * rows + r;
        const float* o_split = partial_o + partial * head_dim;
        // An empty split (lse = -inf) has weight 0. It still adds 0 * its o, as one pass over
        // the keys adds p = 0 times v: its o is 0 unless a key of score -inf met an infinite
        // v there (0 * inf = NaN), which the split must not lose (write_rows writes every
        // partial row, empty ones too).
        if (partial_lse[partial] == -kInfinity) {
          for (int32_t d = 0; d < head_dim; ++d) acc[d] += 0.0f * o_split[d];
          continue;
        }
        const float weight = std::exp(partial_lse[partial] - max_lse);
        weight_sum += weight;
        for (int32_t d = 0; d < head_dim; ++d) acc[d] += weight * o_split[d];
      }
      const float inv = 1.0f / weight_sum;
      for (int32_t d = 0; d < head_dim; ++d) acc[d] *= inv;
      lse = max_lse + std::log(weight_sum);
    }
    const int64_t token = first_token + r / group_size;
    const int64_t qo_head = static_cast<int64_t>(merge.kv_head) * group_size + r % group_size;
    if (problem.sinks != nullptr) {  // the pieces hold no sink: fold it once, here
      const SinkFold fold = fold_sink(lse, problem.sinks[qo_head]);
      const float factor = static_cast<float>(fold.factor);
      for (int32_t d = 0; d < head_dim; ++d) acc[d] = std::isnan(factor) ? factor : acc[d] * factor;
      lse = static_cast<float>(fold.lse);
    }
    const int64_t o_offset = token * problem.o_stride_token + qo_head * problem.o_stride_head;
    for (int32_t d = 0; d < head_dim; ++d) {
      store_from_float(problem.o, problem.q_dtype, o_offset + d, acc[d]);
    }
    if (problem.lse) problem.lse[token * problem.lse_stride_token + qo_head] = lse;
  }
}

}  // namespace

void cpu_fast_attention_with_isa(const Plan& plan, const AttentionProblem& problem,
                                 Workspace workspace, CpuIsa isa) {
  check_plan(plan, problem, workspace);
  const FastKernelEntry kernel = kernel_for(isa);

  constexpr float kLog2E = 1.4426950408889634f;
  FastAttentionContext context;
  context.problem = &problem;
  context.group_size = problem.group_size();
  const float logit_scale = problem.sm_scale * problem.k_scale;
  context.soft_cap = problem.soft_cap;
  context.q_scale = problem.soft_cap > 0.0f ? logit_scale / problem.soft_cap : logit_scale * kLog2E;
  context.out_scale = problem.v_scale;
  std::array<float, 256> fp8_table{};
  if (problem.kv.dtype == DType::kFloat8E4M3 || problem.kv.dtype == DType::kFloat8E5M2) {
    const bool e4m3 = problem.kv.dtype == DType::kFloat8E4M3;
    for (int byte = 0; byte < 256; ++byte) {
      const uint8_t encoded = static_cast<uint8_t>(byte);
      fp8_table[byte] = e4m3 ? e4m3_to_float(encoded) : e5m2_to_float(encoded);
    }
    context.fp8_table = fp8_table.data();
  }
  if (plan.num_partial_rows > 0) {
    const WorkspaceLayout layout = WorkspaceLayout::of(plan);
    std::byte* base = static_cast<std::byte*>(workspace.data);
    context.partial_o = reinterpret_cast<float*>(base + layout.partial_o);
    context.partial_lse = reinterpret_cast<float*>(base + layout.partial_lse);
  }

  int32_t max_rows = 1;
  for (const WorkItem& item : plan.work) {
    max_rows = std::max(max_rows, item.q_len * context.group_size);
  }
  const size_t scratch_bytes =
      kernel.scratch_bytes(max_rows, problem.head_dim, problem.head_dim_v());

  ThreadPool& pool = ThreadPool::instance();
  const int64_t num_items = static_cast<int64_t>(plan.work.size());
  std::atomic<int64_t> next_item{0};
  const int item_threads =
      static_cast<int>(std::clamp<int64_t>(num_threads(), 1, std::max<int64_t>(num_items, 1)));
  pool.run(item_threads, [&](int) {
    thread_local ScratchBuffer scratch;
    void* memory = scratch.reserve(scratch_bytes);
    for (int64_t i = next_item.fetch_add(1); i < num_items; i = next_item.fetch_add(1)) {
      kernel.run_work_item(context, plan.work[i], memory);
    }
  });

  const int64_t num_merges = static_cast<int64_t>(plan.merges.size());
  if (num_merges == 0) return;
  std::atomic<int64_t> next_merge{0};
  const int merge_threads = static_cast<int>(std::clamp<int64_t>(num_threads(), 1, num_merges));
  pool.run(merge_threads, [&](int) {
    thread_local std::vector<float> row;  // kept across calls: no allocation per run
    for (int64_t i = next_merge.fetch_add(1); i < num_merges; i = next_merge.fetch_add(1)) {
      merge_partials(problem, plan.merges[i], context.partial_o, context.partial_lse, &row);
    }
  });
}

void cpu_fast_attention(const Plan& plan, const AttentionProblem& problem, Workspace workspace) {
  cpu_fast_attention_with_isa(plan, problem, workspace, selected_cpu_isa());
}

}  // namespace tessera::detail
