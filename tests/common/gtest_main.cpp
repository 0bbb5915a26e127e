// The main() of the test binaries (instead of gtest_main). It runs the tests as gtest_main does;
// with --tessera-skip-code=N (tests/CMakeLists.txt passes 77, the tests' SKIP_RETURN_CODE) it
// exits with N when every test that ran was skipped (GTEST_SKIP: no GPU, no CUDA backend), so
// ctest reports such a binary as skipped instead of "Passed 0.00 s". A binary that ran a test
// exits 0 or 1 as before; run by hand (no flag) an all-skipped binary exits 0.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace {

constexpr const char kSkipCodeFlag[] = "--tessera-skip-code=";

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);  // removes gtest's flags, leaves ours
  int skip_code = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], kSkipCodeFlag, sizeof(kSkipCodeFlag) - 1) == 0) {
      skip_code = std::atoi(argv[i] + sizeof(kSkipCodeFlag) - 1);
    }
  }
  const int status = RUN_ALL_TESTS();
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  if (status == 0 && skip_code != 0 && unit.test_to_run_count() > 0 &&
      unit.skipped_test_count() == unit.test_to_run_count()) {
    return skip_code;
  }
  return status;
}
