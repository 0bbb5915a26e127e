// Threads sharing one library state (issue 38 item 2), on the CPU backend: plans made and run
// concurrently from 8 threads (ragged prefill, paged prefill and decode; mixed shapes, GQA
// ratios, page sizes, masks and dtypes), every result compared with the double-precision
// reference; one plan run from 8 threads at once (plans are immutable); and the first touch of
// the process-wide state (tuning file, CPU ISA choice, thread count, the CPU thread pool, the
// planner) by threads released together by a latch. tools/tsan-test.sh runs this binary under
// ThreadSanitizer, which reports any data race these tests provoke.
//
// Threads record failures as text; the test thread reports them (gtest assertions stay on the
// test thread). TESSERA_TEST_REDUCED=1 (the sanitizer runs) shrinks the case counts.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <latch>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/scoped_env.hpp"
#include "core/settings.hpp"
#include "core/tuning.hpp"
#include "cpu/cpu_info.hpp"
#include "tessera/backend.hpp"
#include "tessera/tessera.hpp"

namespace tessera::test {
namespace {

constexpr int kThreads = 8;
constexpr Device kCpu{DeviceType::kCPU, 0};

bool reduced() {
  const char* env = std::getenv("TESSERA_TEST_REDUCED");
  return env != nullptr && std::string(env) == "1";
}

uint64_t seed(uint64_t fallback) {
  const char* env = std::getenv("TESSERA_TEST_SEED");
  return env ? std::strtoull(env, nullptr, 10) : fallback;
}

enum class Kind { kRagged, kPaged, kDecode };

// A random case of `kind`, small enough for the double reference under ThreadSanitizer.
AttentionCase mixed_case(std::mt19937_64& rng, Kind kind) {
  RandomCaseOptions limits;
  limits.max_batch = 3;
  limits.max_q_len = 48;
  limits.max_kv_len = 160;
  limits.max_kv_heads = 2;
  limits.max_group = 8;  // GQA 1..8
  limits.head_dims = {64, 128};
  limits.any_head_dim_probability = 0.1;
  limits.max_reference_macs = 1'500'000;
  limits.allow_paged = kind != Kind::kRagged;
  AttentionCase c = random_case(rng, limits);
  if (kind == Kind::kRagged) {
    c.paged = false;
    c.uniform_q = false;
    return c;
  }
  if (!c.paged) {
    c.paged = true;
    const int32_t sizes[] = {1, 16, 64, 7};
    c.page_size = sizes[std::uniform_int_distribution<int>(0, 3)(rng)];
    c.layout = rng() % 2 ? KVLayout::kNHD : KVLayout::kHND;
    c.spare_pages = static_cast<int32_t>(rng() % 3);
  }
  if (kind == Kind::kDecode) {
    c.uniform_q = true;
    const int32_t q = std::uniform_int_distribution<int32_t>(1, 4)(rng);
    for (int32_t& len : c.q_lens) len = q;
  } else {
    c.uniform_q = false;
  }
  return c;
}

// Runs one case through the public API and compares it with the reference; "" when it matches.
std::string check_case(AttentionBuffers& buffers, const Plan* plan = nullptr) {
  const AttentionCase& c = buffers.test_case;
  const Outputs expected = run_reference(buffers);
  const Outputs actual = run_through_api(buffers, kCpu, plan);
  const Comparison result = compare_outputs(buffers, actual, expected);
  if (result.ok(default_tolerance(c), default_lse_tolerance(c))) return {};
  return c.describe() + "\n" + result.describe();
}

// Collects the failures of many threads; reports them on the test thread.
class Failures {
 public:
  void add(std::string what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (list_.size() < 10) list_.push_back(std::move(what));
    ++count_;
  }
  void report() const {
    EXPECT_EQ(count_, 0) << count_ << " failures, the first:";
    for (const std::string& failure : list_) ADD_FAILURE() << failure;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> list_;
  int count_ = 0;
};

// Runs body(thread) on kThreads threads released together; rethrows nothing (an exception is
// a failure of its thread).
template <class Body>
void on_threads(Failures& failures, Body body) {
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      try {
        body(t);
      } catch (const std::exception& error) {
        failures.add("thread " + std::to_string(t) + ": " + error.what());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

std::string write_tuning_file() {
  const std::filesystem::path path = std::filesystem::temp_directory_path() /
                                     ("tessera_threads_" + std::to_string(getpid()) + ".txt");
  detail::TuningTable table;
  table.decode[{"Threads GPU", 128, 4, DType::kBFloat16}] = {3, 256};
  detail::write_tuning_file(path.string(), table);
  return path.string();
}

// First in the file, so in a plain run of the binary it is the process's first use of the
// lazily initialised state: the tuning file, the ISA choice, the default thread count, the CPU
// thread pool and the planner. (The settings snapshot is read while the library loads.) All
// threads start at once and must see one and the same state. (Run after another test of the
// file, e.g. shuffled, the tuning file was already loaded without this one: its entry is then
// not checked.)
TEST(Threads, FirstTouchOfTheSharedStateFromManyThreadsAtOnce) {
  const std::string path = write_tuning_file();
  ScopedEnv tune("TESSERA_TUNE_FILE", path.c_str());  // before the threads: reloads settings
  std::mt19937_64 rng(seed(381));
  AttentionBuffers buffers = make_buffers(mixed_case(rng, Kind::kPaged), rng);
  const Outputs expected = run_reference(buffers);

  Failures failures;
  std::vector<const detail::Settings*> seen_settings(kThreads);
  std::vector<const detail::TuningFile*> seen_files(kThreads);
  std::vector<int> seen_isa(kThreads), seen_threads(kThreads), seen_variant(kThreads);
  std::vector<Outputs> outputs(kThreads);
  on_threads(failures, [&](int t) {
    seen_settings[t] = &detail::settings();
    seen_files[t] = &detail::process_tuning_file();
    const detail::ResolvedDecodeTuning tuned = detail::resolve_decode_tuning(
        {"Threads GPU", 128, 4, DType::kBFloat16}, std::nullopt, std::nullopt, {0, 512});
    seen_variant[t] = tuned.value.variant;
    seen_isa[t] = static_cast<int>(detail::selected_cpu_isa());
    seen_threads[t] = num_threads();
    AttentionBuffers mine = buffers;  // own outputs; the same inputs
    outputs[t] = run_through_api(mine, kCpu);
    const Comparison result = compare_outputs(mine, outputs[t], expected);
    if (!result.ok(default_tolerance(mine.test_case), default_lse_tolerance(mine.test_case))) {
      failures.add(mine.test_case.describe() + "\n" + result.describe());
    }
  });
  failures.report();
  std::filesystem::remove(path);
  if (seen_files[0]->path == path) {
    ASSERT_EQ(seen_files[0]->status, detail::TuningFileStatus::kLoaded) << seen_files[0]->error;
    EXPECT_EQ(seen_variant[0], 3) << "the tuning file's entry was not used";
  }
  for (int t = 1; t < kThreads; ++t) {
    EXPECT_EQ(seen_variant[t], seen_variant[0]) << "thread " << t;
    EXPECT_EQ(seen_settings[t], seen_settings[0]) << "thread " << t;
    EXPECT_EQ(seen_files[t], seen_files[0]) << "thread " << t;
    EXPECT_EQ(seen_isa[t], seen_isa[0]) << "thread " << t;
    EXPECT_EQ(seen_threads[t], seen_threads[0]) << "thread " << t;
    // One thread per work item, whoever runs it: the same bits from every thread.
    EXPECT_EQ(outputs[t].o, outputs[0].o) << "thread " << t;
    EXPECT_EQ(outputs[t].lse, outputs[0].lse) << "thread " << t;
  }
}

// 8 threads, each planning and running its own stream of mixed cases (the three ops in turn,
// random shapes, GQA ratios, page sizes, masks, dtypes), all on the one CPU thread pool.
TEST(Threads, PlansMadeAndRunConcurrentlyMatchTheReference) {
  const int per_thread = reduced() ? 16 : 60;
  const uint64_t base = seed(382);
  Failures failures;
  on_threads(failures, [&](int t) {
    std::mt19937_64 rng(base * 1000 + static_cast<uint64_t>(t));
    for (int i = 0; i < per_thread; ++i) {
      const Kind kind = static_cast<Kind>((i + t) % 3);
      AttentionBuffers buffers = make_buffers(mixed_case(rng, kind), rng);
      if (std::string failure = check_case(buffers); !failure.empty()) {
        failures.add("thread " + std::to_string(t) + " case " + std::to_string(i) + ": " + failure);
      }
    }
  });
  failures.report();
}

// One plan per op, run from 8 threads at once, each into its own outputs (same inputs): every
// thread matches the reference and the others bit for bit.
TEST(Threads, OnePlanRunFromManyThreadsAtOnce) {
  std::mt19937_64 rng(seed(383));
  for (const Kind kind : {Kind::kRagged, Kind::kPaged, Kind::kDecode}) {
    AttentionBuffers buffers = make_buffers(mixed_case(rng, kind), rng);
    const Plan plan = plan_for(buffers, kCpu);
    const Outputs expected = run_reference(buffers);
    Failures failures;
    std::vector<Outputs> outputs(kThreads);
    const int repeats = reduced() ? 2 : 5;
    on_threads(failures, [&](int t) {
      AttentionBuffers mine = buffers;
      for (int r = 0; r < repeats; ++r) {
        outputs[t] = run_through_api(mine, kCpu, &plan);
        const Comparison result = compare_outputs(mine, outputs[t], expected);
        if (!result.ok(default_tolerance(mine.test_case), default_lse_tolerance(mine.test_case))) {
          failures.add(mine.test_case.describe() + "\n" + result.describe());
        }
      }
    });
    failures.report();
    for (int t = 1; t < kThreads; ++t) {
      EXPECT_EQ(outputs[t].o, outputs[0].o) << buffers.test_case.describe() << " thread " << t;
      EXPECT_EQ(outputs[t].lse, outputs[0].lse) << buffers.test_case.describe();
    }
  }
}

// Plans of one shape made on 8 threads at once are the same plan (the planner keeps no state
// between calls that another thread could disturb).
TEST(Threads, ConcurrentPlansOfOneShapeAreIdentical) {
  std::mt19937_64 rng(seed(384));
  for (const Kind kind : {Kind::kRagged, Kind::kPaged, Kind::kDecode}) {
    AttentionBuffers buffers = make_buffers(mixed_case(rng, kind), rng);
    const Plan reference = plan_for(buffers, kCpu);
    Failures failures;
    std::vector<Plan> plans(kThreads);
    on_threads(failures, [&](int t) {
      for (int r = 0; r < 20; ++r) plans[t] = plan_for(buffers, kCpu);
    });
    failures.report();
    for (int t = 0; t < kThreads; ++t) {
      EXPECT_EQ(plans[t].explain(), reference.explain()) << "thread " << t;
      EXPECT_EQ(plans[t].worker_indptr, reference.worker_indptr) << "thread " << t;
      EXPECT_EQ(plans[t].workspace_bytes, reference.workspace_bytes) << "thread " << t;
    }
  }
}

// The process-wide knobs are atomics: reading them while another thread sets them is defined
// (set_num_threads between runs changes how many pool threads join, never the answer).
TEST(Threads, KnobsChangedWhileOtherThreadsRun) {
  std::mt19937_64 rng(seed(385));
  AttentionBuffers buffers = make_buffers(mixed_case(rng, Kind::kRagged), rng);
  const Outputs expected = run_reference(buffers);
  Failures failures;
  on_threads(failures, [&](int t) {
    AttentionBuffers mine = buffers;
    for (int r = 0; r < (reduced() ? 3 : 10); ++r) {
      if (t == 0) set_num_threads(1 + r % 3);
      if (t == 1) (void)index_checking();
      const Outputs actual = run_through_api(mine, kCpu);
      const Comparison result = compare_outputs(mine, actual, expected);
      if (!result.ok(default_tolerance(mine.test_case), default_lse_tolerance(mine.test_case))) {
        failures.add("thread " + std::to_string(t) + ": " + mine.test_case.describe() + "\n" +
                     result.describe());
      }
    }
  });
  set_num_threads(0);  // the default again
  failures.report();
}

}  // namespace
}  // namespace tessera::test
