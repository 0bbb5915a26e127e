// Faults on the CPU (issue 38 item 4; docs/RELIABILITY.md, "Faults"): a workspace one byte too
// small for run_*, a one-shot call whose own workspace cannot be allocated, a missing, empty,
// truncated, garbage, wrong-version, wrong-field, unreadable tuning file, and a host without a
// usable CUDA driver or backend (this build host has no libcuda). Each case checks the error's
// kind (or C ABI status) and text, that no output changed, and that the next valid call works.
// The GPU faults (out of device memory, a capturing stream, a device reset) are in
// test_cuda_faults.cpp.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/capi_fixture.hpp"
#include "common/scoped_env.hpp"
#include "common/validation_fixture.hpp"
#include "core/dispatch.hpp"
#include "core/tuning.hpp"
#include "core/validate.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace tessera {
namespace {

using test::ScopedEnv;
using test::capi::HostTensor;
using test::capi::int_tensor;
using test::capi::kF32;
using test::capi::kSentinel;

using test::error_of;
using test::expect_contains;

// ---------------------------------------------------------------- workspace too small

// Long enough key ranges that the CPU planner splits them (pieces of >= 512 keys over 4
// workers), so every plan needs a workspace for its partial results.
constexpr int kQoHeads = 4, kKvHeads = 2, kHeadDim = 32, kPageSize = 16;
const std::vector<int32_t> kQoIndptr{0, 3, 4}, kKvIndptr{0, 1500, 2200};
const std::vector<int32_t> kPageIndptr{0, 94, 138}, kLastPageLen{12, 12};  // 1500 and 700 keys

// A host buffer with 64-byte alignment, poisoned with 0xab.
struct WorkspaceBuffer {
  explicit WorkspaceBuffer(size_t bytes) : storage((bytes + 127) / 64 * 64 + 64, 0xab) {}
  void* data() {
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    return storage.data() + ((64 - address % 64) % 64);
  }
  std::vector<unsigned char> storage;
};

class FaultsWorkspace : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_threads_ = num_threads();
    set_num_threads(4);
    q.fill_pattern(1);
    k.fill_pattern(2);
    v.fill_pattern(3);
    k_cache.fill_pattern(4);
    v_cache.fill_pattern(5);
    q_decode.fill_pattern(6);
    for (int32_t page = 0; page < 138; ++page) page_indices.ints()[page] = 137 - page;
    options.causal = true;
  }
  void TearDown() override { set_num_threads(saved_threads_); }

  PagedKVCache paged() {
    PagedKVCache cache;
    cache.k_cache = k_cache.view();
    cache.v_cache = v_cache.view();
    cache.page_indptr = page_indptr.view();
    cache.page_indices = page_indices.view();
    cache.last_page_len = last_page_len.view();
    return cache;
  }

  // One op's fault: poisoned outputs, a run with `plan.workspace_bytes - 1` bytes, then with a
  // null pointer, each rejected naming 'workspace' with nothing written (outputs and workspace
  // bytes compared); then the right workspace, whose result must equal the one-shot call's.
  void check_op(const char* op, const Plan& plan,
                const std::function<void(const TensorView&, const TensorView&, Workspace)>& run,
                const std::function<void(const TensorView&, const TensorView&)>& one_shot,
                std::vector<int64_t> o_shape) {
    SCOPED_TRACE(op);
    ASSERT_GT(plan.workspace_bytes, 0u) << "the case must need a workspace";
    HostTensor o(o_shape, kF32), lse({o_shape[0], o_shape[1]}, kF32);
    o.fill(kSentinel);
    lse.fill(kSentinel);
    const std::vector<unsigned char> o_before = o.bytes(), lse_before = lse.bytes();
    WorkspaceBuffer workspace(plan.workspace_bytes);
    const std::vector<unsigned char> workspace_before = workspace.storage;

    const size_t short_bytes = plan.workspace_bytes - 1;
    const std::string message = error_of(
        [&] {
          run(o.view(), lse.view(), Workspace{workspace.data(), short_bytes});
        },
        Error::Kind::kInvalidArgument);
    expect_contains(message, std::string("tessera::") + op + ": 'workspace'");
    expect_contains(message, "the plan needs " + std::to_string(plan.workspace_bytes) +
                                 " bytes, got " + std::to_string(short_bytes));
    const std::string null_message = error_of(
        [&] {
          run(o.view(), lse.view(), Workspace{nullptr, plan.workspace_bytes});
        },
        Error::Kind::kInvalidArgument);
    expect_contains(null_message, "'workspace': data pointer is null");
    EXPECT_EQ(o.bytes(), o_before) << "o written by a failed call";
    EXPECT_EQ(lse.bytes(), lse_before) << "lse written by a failed call";
    EXPECT_EQ(workspace.storage, workspace_before) << "workspace written by a failed call";

    ASSERT_NO_THROW(run(o.view(), lse.view(), Workspace{workspace.data(), plan.workspace_bytes}));
    HostTensor o_expected(o_shape, kF32), lse_expected({o_shape[0], o_shape[1]}, kF32);
    one_shot(o_expected.view(), lse_expected.view());
    test::capi::expect_close(o, o_expected, 1e-5f);
    test::capi::expect_close(lse, lse_expected, 1e-5f);
  }

  HostTensor q{{4, kQoHeads, kHeadDim}, kF32};
  HostTensor k{{2200, kKvHeads, kHeadDim}, kF32}, v{{2200, kKvHeads, kHeadDim}, kF32};
  HostTensor qo_indptr = int_tensor(kQoIndptr), kv_indptr = int_tensor(kKvIndptr);
  HostTensor k_cache{{138, kPageSize, kKvHeads, kHeadDim}, kF32};
  HostTensor v_cache{{138, kPageSize, kKvHeads, kHeadDim}, kF32};
  HostTensor page_indptr = int_tensor(kPageIndptr), last_page_len = int_tensor(kLastPageLen);
  HostTensor page_indices{{138}, test::capi::kI32};
  HostTensor q_decode{{2, kQoHeads, kHeadDim}, kF32};
  AttentionOptions options;

 private:
  int saved_threads_ = 0;
};

TEST_F(FaultsWorkspace, OneByteTooSmallForRaggedPrefill) {
  const Plan plan =
      plan_ragged_prefill(kQoIndptr, kKvIndptr, kQoHeads, kKvHeads, kHeadDim, options);
  check_op(
      "run_ragged_prefill", plan,
      [&](const TensorView& o, const TensorView& lse, Workspace workspace) {
        run_ragged_prefill(plan, q.view(), k.view(), v.view(), qo_indptr.view(), kv_indptr.view(),
                           o, lse, workspace);
      },
      [&](const TensorView& o, const TensorView& lse) {
        ragged_prefill(q.view(), k.view(), v.view(), qo_indptr.view(), kv_indptr.view(), o, lse,
                       options);
      },
      {4, kQoHeads, kHeadDim});
}

TEST_F(FaultsWorkspace, OneByteTooSmallForPagedPrefill) {
  const Plan plan = plan_paged_prefill(kQoIndptr, kPageIndptr, kLastPageLen, kPageSize, kQoHeads,
                                       kKvHeads, kHeadDim, options);
  check_op(
      "run_paged_prefill", plan,
      [&](const TensorView& o, const TensorView& lse, Workspace workspace) {
        run_paged_prefill(plan, q.view(), paged(), qo_indptr.view(), o, lse, workspace);
      },
      [&](const TensorView& o, const TensorView& lse) {
        paged_prefill(q.view(), paged(), qo_indptr.view(), o, lse, options);
      },
      {4, kQoHeads, kHeadDim});
}

TEST_F(FaultsWorkspace, OneByteTooSmallForDecode) {
  const Plan plan =
      plan_decode(kPageIndptr, kLastPageLen, kPageSize, kQoHeads, kKvHeads, kHeadDim, options);
  check_op(
      "run_decode", plan,
      [&](const TensorView& o, const TensorView& lse, Workspace workspace) {
        run_decode(plan, q_decode.view(), paged(), o, lse, workspace);
      },
      [&](const TensorView& o, const TensorView& lse) {
        decode(q_decode.view(), paged(), o, lse, options);
      },
      {2, kQoHeads, kHeadDim});
}

// The same through the C ABI: status, last error, outputs, then a successful call.
TEST_F(FaultsWorkspace, OneByteTooSmallThroughTheCApi) {
  tessera_attention_options c_options;
  tessera_attention_options_default(&c_options);
  c_options.causal = 1;
  tessera_plan* plan = nullptr;
  ASSERT_EQ(tessera_plan_decode(kPageIndptr.data(), kLastPageLen.data(), 2, kPageSize, kQoHeads,
                                kKvHeads, kHeadDim, 1, &c_options, kDLCPU, 0, &plan),
            TESSERA_OK)
      << tessera_last_error();
  const size_t bytes = tessera_plan_workspace_bytes(plan);
  ASSERT_GT(bytes, 0u);
  WorkspaceBuffer workspace(bytes);
  HostTensor o({2, kQoHeads, kHeadDim}, kF32), lse({2, kQoHeads}, kF32);
  o.fill(kSentinel);
  lse.fill(kSentinel);
  const std::vector<unsigned char> o_before = o.bytes(), lse_before = lse.bytes();
  const tessera_paged_kv kv{k_cache.dl(),      v_cache.dl(),       page_indptr.dl(),
                            page_indices.dl(), last_page_len.dl(), TESSERA_KV_LAYOUT_NHD};
  EXPECT_EQ(tessera_run_decode(plan, q_decode.dl(), &kv, o.dl(), lse.dl(), workspace.data(),
                               bytes - 1, nullptr),
            TESSERA_ERROR_INVALID_ARGUMENT);
  const std::string message = tessera_last_error();
  expect_contains(message, "'workspace'");
  expect_contains(message,
                  "needs " + std::to_string(bytes) + " bytes, got " + std::to_string(bytes - 1));
  EXPECT_EQ(o.bytes(), o_before);
  EXPECT_EQ(lse.bytes(), lse_before);
  EXPECT_EQ(tessera_run_decode(plan, q_decode.dl(), &kv, o.dl(), lse.dl(), workspace.data(), bytes,
                               nullptr),
            TESSERA_OK)
      << tessera_last_error();
  EXPECT_STREQ(tessera_last_error(), "");
  EXPECT_NE(o.bytes(), o_before);
  tessera_plan_destroy(plan);
}

// ---------------------------------------------------------------- host memory

// The one-shot calls' own workspace (detail::ScratchBuffer): an allocation that cannot succeed
// is Error(kOutOfMemory) naming the op, 'workspace' and the bytes, not std::bad_alloc. (Run
// directly: no one-shot problem of this host's size needs 2^62 bytes.) Skipped under the
// sanitizers, whose allocators abort on such a request instead of returning null.
TEST(FaultsHostMemory, OneShotWorkspaceThatCannotBeAllocated) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ASan / TSan abort on a 2^62-byte malloc (allocator_may_return_null=0)";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  GTEST_SKIP() << "ASan / TSan abort on a 2^62-byte malloc (allocator_may_return_null=0)";
#endif
#endif
  const size_t bytes = size_t{1} << 62;
  const detail::ArgChecker check("decode");
  const std::string message =
      error_of([&] { detail::ScratchBuffer scratch(check, {}, bytes); }, Error::Kind::kOutOfMemory);
  expect_contains(message, "tessera::decode: 'workspace'");
  expect_contains(message, std::to_string(bytes) + " bytes could not be allocated");
  // And the library goes on: a one-shot call that fits.
  HostTensor q({1, 2, 8}, kF32), k({3, 1, 8}, kF32), v({3, 1, 8}, kF32), o({1, 2, 8}, kF32);
  q.fill_pattern(1);
  k.fill_pattern(2);
  v.fill(0.5f);
  HostTensor qo = int_tensor({0, 1}), kv = int_tensor({0, 3});
  ASSERT_NO_THROW(ragged_prefill(q.view(), k.view(), v.view(), qo.view(), kv.view(), o.view()));
  for (int64_t i = 0; i < o.numel(); ++i) EXPECT_NEAR(o.get(i), 0.5f, 1e-6f) << i;
}

// ---------------------------------------------------------------- tuning file

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("tessera_test_faults_" + std::to_string(::getpid()) + "_" + name);
}

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

const std::string kGoodEntry =
    "decode device=\"NVIDIA H200\" head_dim=128 group=4 kv=bf16 variant=3 min_chunk=256\n";

// Every file that cannot be used is kMalformed with "path[:line]: why", serves no entry, and
// gets the same one-line warning naming the fallback; only an absent file at the default
// location is silent.
TEST(FaultsTuningFile, EveryUnusableFileIsReportedTheSameWay) {
  struct Case {
    const char* name;
    std::string bytes;
    std::string expected;  // what the error says after the path (it may go on)
  };
  const Case cases[] = {
      {"empty", "", ": empty file: no version line 'tessera-tune 1'"},
      {"comments only", "# written by hand\n\n", ":2: no version line 'tessera-tune 1'"},
      {"truncated version line", "tessera-tu", ":1: expected the version line 'tessera-tune 1'"},
      {"truncated entry", "tessera-tune 1\n" + kGoodEntry + "decode device=\"NVIDIA H200\" hea",
       ":3: expected key=value, got 'hea'"},
      {"truncated in a quote", "tessera-tune 1\ndecode device=\"NVIDIA H2",
       ":2: unterminated quote"},
      {"truncated value", "tessera-tune 1\ndecode device=\"D\" head_dim=12",
       ":2: head_dim: expected 64, 128 or 256, got '12'"},
      {"binary garbage",
       std::string("\x7f"
                   "ELF\x02\x01\x01\0\0\0\xff\xfe\n",
                   14),
       ":1: expected the version line 'tessera-tune 1' first"},
      {"wrong version", "tessera-tune 7\n" + kGoodEntry,
       ":1: version 7 is not supported (this build reads 1)"},
      {"unknown field",
       "tessera-tune 1\n" + kGoodEntry.substr(0, kGoodEntry.size() - 1) + " speed=9\n",
       ":2: unknown field 'speed'"},
      {"missing field", "tessera-tune 1\ndecode device=\"D\" head_dim=128 group=4 kv=bf16\n",
       ":2: missing field 'variant'"},
      {"wrong value",
       "tessera-tune 1\ndecode device=\"D\" head_dim=128 group=4 kv=int8 "
       "variant=1 min_chunk=512\n",
       ":2: kv: expected bf16, fp16, fp8_e4m3 or fp8_e5m2, got 'int8'"},
      {"wrong keyword", "tessera-tune 1\nprefill device=\"D\"\n",
       ":2: expected an entry starting with 'decode', got 'prefill'"},
  };
  const std::filesystem::path path = temp_path("case.txt");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    write_bytes(path, c.bytes);
    const detail::TuningFile file = detail::read_tuning_file(path.string());
    EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
    EXPECT_TRUE(file.table.empty());
    EXPECT_EQ(file.error.rfind(path.string() + c.expected, 0), 0u)
        << file.error << "\ndoes not start with\n"
        << path.string() + c.expected;
    const std::string warning = detail::tuning_file_warning(file, /*named=*/false);
    EXPECT_EQ(warning, "tessera: ignoring the tuning file: " + file.error +
                           " (the built-in decode defaults are used)\n");
    EXPECT_EQ(detail::tuning_file_warning(file, /*named=*/true), warning);
  }
  // The same entry in a whole file loads (so the cases above fail for their fault alone).
  write_bytes(path, "tessera-tune 1\n" + kGoodEntry);
  const detail::TuningFile good = detail::read_tuning_file(path.string());
  ASSERT_EQ(good.status, detail::TuningFileStatus::kLoaded) << good.error;
  EXPECT_EQ(good.table.decode.size(), 1u);
  EXPECT_EQ(detail::tuning_file_warning(good, true), "");
  std::filesystem::remove(path);
}

TEST(FaultsTuningFile, MissingFolderAndUnreadableFiles) {
  const std::filesystem::path missing = temp_path("missing.txt");
  std::filesystem::remove(missing);
  detail::TuningFile file = detail::read_tuning_file(missing.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMissing);
  EXPECT_EQ(file.error, "");
  EXPECT_EQ(detail::tuning_file_warning(file, /*named=*/false), "");  // the default location
  EXPECT_EQ(detail::tuning_file_warning(file, /*named=*/true),
            "tessera: ignoring the tuning file: " + missing.string() +
                " (TESSERA_TUNE_FILE) does not exist (the built-in decode defaults are used)\n");

  const std::filesystem::path folder = temp_path("folder");
  std::filesystem::create_directories(folder);
  file = detail::read_tuning_file(folder.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
  EXPECT_EQ(file.error, folder.string() + ": is a folder, not a tuning file");

  if (::geteuid() == 0) {
    std::filesystem::remove_all(folder);
    GTEST_SKIP() << "running as root: permissions do not stop root from reading a file, so the "
                    "unreadable-file cases cannot be made here";
  }
  const std::filesystem::path locked = folder / "tune.txt";
  write_bytes(locked, "tessera-tune 1\n" + kGoodEntry);
  ASSERT_EQ(::chmod(locked.c_str(), 0), 0);
  file = detail::read_tuning_file(locked.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
  EXPECT_EQ(file.error, locked.string() + ": cannot be opened (Permission denied)");
  EXPECT_TRUE(file.table.empty());
  ASSERT_EQ(::chmod(locked.c_str(), 0600), 0);
  // A folder on the way that may not be searched: the file may be there, so not "missing".
  ASSERT_EQ(::chmod(folder.c_str(), 0), 0);
  file = detail::read_tuning_file(locked.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
  EXPECT_EQ(file.error, locked.string() + ": cannot be read (Permission denied)");
  ASSERT_EQ(::chmod(folder.c_str(), 0700), 0);
  file = detail::read_tuning_file(locked.string());
  EXPECT_EQ(file.status, detail::TuningFileStatus::kLoaded) << file.error;
  std::filesystem::remove_all(folder);
}

// The only test of this binary that loads the process-wide file: TESSERA_TUNE_FILE names a
// file cut short mid-entry. One warning on stderr, however often it is asked for; every decode
// knob then comes from the built-in defaults; attention keeps working.
TEST(FaultsTuningFile, ProcessFileThatIsCutShortFallsBackWithOneWarning) {
  const std::filesystem::path path = temp_path("process.txt");
  write_bytes(path, "tessera-tune 1\n" + kGoodEntry + "decode device=\"NVIDIA H200\" head_di");
  ScopedEnv tune("TESSERA_TUNE_FILE", path.c_str());
  ::testing::internal::CaptureStderr();
  const detail::TuningFile& file = detail::process_tuning_file();
  (void)detail::process_tuning_file();
  const detail::DecodeTuning defaults{1, 512};
  const detail::ResolvedDecodeTuning resolved = detail::resolve_decode_tuning(
      {"NVIDIA H200", 128, 4, DType::kBFloat16}, std::nullopt, std::nullopt, defaults);
  const std::string stderr_text = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(file.path, path.string()) << "the process file was loaded before this test";
  EXPECT_EQ(file.status, detail::TuningFileStatus::kMalformed);
  EXPECT_EQ(stderr_text, "tessera: ignoring the tuning file: " + path.string() +
                             ":3: expected key=value, got 'head_di' (the built-in decode "
                             "defaults are used)\n");
  // The entry on line 2 is well-formed but the file is ignored as a whole.
  EXPECT_EQ(resolved.value, defaults);
  EXPECT_EQ(resolved.variant_source, detail::TuningSource::kDefault);
  HostTensor q({1, 2, 8}, kF32), k({2, 1, 8}, kF32), v({2, 1, 8}, kF32), o({1, 2, 8}, kF32);
  q.fill_pattern(1);
  k.fill_pattern(2);
  v.fill(-0.25f);
  HostTensor qo = int_tensor({0, 1}), kv = int_tensor({0, 2});
  ASSERT_NO_THROW(ragged_prefill(q.view(), k.view(), v.view(), qo.view(), kv.view(), o.view()));
  for (int64_t i = 0; i < o.numel(); ++i) EXPECT_NEAR(o.get(i), -0.25f, 1e-6f) << i;
  std::filesystem::remove(path);
}

// ---------------------------------------------------------------- no CUDA driver / backend

// On this build host there is no libcuda.so.1: a CPU-only build has no CUDA backend, and a
// CUDA build's static runtime finds no driver. Either way the queries answer, a request for a
// CUDA device fails with kUnsupported quoting why, and the CPU keeps working. Skipped where a
// CUDA device is usable (that path is the GPU tests').
class FaultsNoCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() > 0) {
      GTEST_SKIP() << "a CUDA device is visible: the no-driver path cannot be reached here";
    }
    reason = cuda_unavailable_reason();
  }
  std::string reason;
};

TEST_F(FaultsNoCuda, QueriesAnswerAndSayWhy) {
  const BuildInfo build = build_info();
  EXPECT_FALSE(cuda_available());
  EXPECT_EQ(tessera_cuda_device_count(), 0);
  EXPECT_EQ(cuda_stream_capture_id(nullptr), 0u);
  uint64_t id = 1;
  EXPECT_EQ(tessera_stream_capture_id(nullptr, &id), TESSERA_OK) << tessera_last_error();
  EXPECT_EQ(id, 0u);
  EXPECT_EQ(reason, tessera_cuda_unavailable_reason());
  if (!build.cuda) {
    EXPECT_EQ(reason, "this build of tessera has no CUDA backend (built without nvcc)");
    EXPECT_EQ(describe_device({DeviceType::kCUDA, 0}), "cuda:0 (no CUDA backend in this build)");
  } else {
    expect_contains(reason, "cudaGetDeviceCount");
    if (reason.find("cudaErrorInsufficientDriver") != std::string::npos) {
      expect_contains(reason, "libcuda.so.1");
    }
    EXPECT_EQ(describe_device({DeviceType::kCUDA, 0}), "cuda:0 (no CUDA device: " + reason + ")");
  }
  expect_contains(describe_device({}), "cpu: ");
}

TEST_F(FaultsNoCuda, CudaRequestsFailClearlyAndTheCpuKeepsWorking) {
  const std::vector<int32_t> page_indptr{0, 1}, last_page_len{3};
  const std::string message = error_of(
      [&] {
        plan_decode(page_indptr, last_page_len, 4, 2, 1, 8, {}, {DeviceType::kCUDA, 0});
      },
      Error::Kind::kUnsupported);
  expect_contains(message, "tessera::plan_decode: 'device'");
  expect_contains(message, reason.substr(0, 40));
  const std::string reset = error_of([] { cuda_after_device_reset(0); }, Error::Kind::kUnsupported);
  expect_contains(reset, "tessera::cuda_after_device_reset: 'device'");

  // A one-shot call on (claimed) CUDA tensors: refused before anything reads their pointers.
  HostTensor q({1, 2, 8}, kF32), k_cache({1, 4, 1, 8}, kF32), v_cache({1, 4, 1, 8}, kF32);
  HostTensor o({1, 2, 8}, kF32);
  HostTensor indptr = int_tensor(page_indptr), indices = int_tensor({0});
  HostTensor last = int_tensor(last_page_len);
  q.fill_pattern(1);
  k_cache.fill_pattern(2);
  v_cache.fill(2.0f);
  o.fill(kSentinel);
  const std::vector<unsigned char> o_before = o.bytes();
  std::vector<HostTensor*> all{&q, &k_cache, &v_cache, &o, &indptr, &indices, &last};
  for (HostTensor* tensor : all) tensor->descriptor().device = DLDevice{kDLCUDA, 0};
  const tessera_paged_kv kv{k_cache.dl(), v_cache.dl(), indptr.dl(),
                            indices.dl(), last.dl(),    TESSERA_KV_LAYOUT_NHD};
  EXPECT_EQ(tessera_decode(q.dl(), &kv, o.dl(), nullptr, nullptr, nullptr),
            TESSERA_ERROR_UNSUPPORTED);
  expect_contains(tessera_last_error(), "tessera::decode: 'device'");
  EXPECT_EQ(o.bytes(), o_before);
  tessera_plan* plan = nullptr;
  EXPECT_EQ(tessera_plan_decode(page_indptr.data(), last_page_len.data(), 1, 4, 2, 1, 8, 1, nullptr,
                                kDLCUDA, 0, &plan),
            TESSERA_ERROR_UNSUPPORTED);
  EXPECT_EQ(plan, nullptr);
  expect_contains(tessera_last_error(), "'device'");
  EXPECT_EQ(tessera_cuda_after_device_reset(0), TESSERA_ERROR_UNSUPPORTED);
  expect_contains(tessera_last_error(), "'device'");

  // The same call on the CPU works, through both front ends.
  for (HostTensor* tensor : all) tensor->descriptor().device = DLDevice{kDLCPU, 0};
  const tessera_paged_kv cpu_kv{k_cache.dl(), v_cache.dl(), indptr.dl(),
                                indices.dl(), last.dl(),    TESSERA_KV_LAYOUT_NHD};
  ASSERT_EQ(tessera_decode(q.dl(), &cpu_kv, o.dl(), nullptr, nullptr, nullptr), TESSERA_OK)
      << tessera_last_error();
  for (int64_t i = 0; i < o.numel(); ++i) EXPECT_NEAR(o.get(i), 2.0f, 1e-6f) << i;
  o.fill(kSentinel);
  PagedKVCache cache;
  cache.k_cache = k_cache.view();
  cache.v_cache = v_cache.view();
  cache.page_indptr = indptr.view();
  cache.page_indices = indices.view();
  cache.last_page_len = last.view();
  ASSERT_NO_THROW(decode(q.view(), cache, o.view()));
  for (int64_t i = 0; i < o.numel(); ++i) EXPECT_NEAR(o.get(i), 2.0f, 1e-6f) << i;
}

}  // namespace
}  // namespace tessera
