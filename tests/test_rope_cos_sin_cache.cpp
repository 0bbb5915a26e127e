// apply_rope_with_cos_sin_cache_inplace on the CPU (vLLM's rotary_embedding, FlashInfer's
// apply_rope_with_cos_sin_cache): against the rotation formula evaluated in double on an
// arbitrary table (the op only reads it), and against apply_rope_inplace with the table built
// the way that op computes its angles (then bit for bit); int32 and int64 positions, NeoX and
// GPT-J pairs, partial rotary_dim, strided views; bad input named, nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/validation_fixture.hpp"
#include "core/half.hpp"
#include "tessera/ops.hpp"

namespace tessera {
namespace {

struct Case {
  int nnz = 7, heads = 3, head_dim = 64, rotary_dim = 64, max_position = 50;
  DType dtype = DType::kFloat16;
  bool interleave = false, wide = false;
};

struct Data {
  Case c;
  int64_t token_stride = 0;
  std::vector<uint8_t> x;  // [nnz, heads, head_dim] with a padded token stride
  std::vector<float> table;
  std::vector<int32_t> positions32;
  std::vector<int64_t> positions64;

  Data(const Case& test_case, std::mt19937_64& rng) : c(test_case) {
    token_stride = int64_t{c.heads} * c.head_dim + 5;
    x.resize(static_cast<size_t>(c.nnz * token_stride) * dtype_size(c.dtype));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < c.nnz * token_stride; ++i) {
      detail::store_from_float(x.data(), c.dtype, i, normal(rng));
    }
    table.resize(static_cast<size_t>(c.max_position) * c.rotary_dim);
    for (float& value : table) value = normal(rng);
    std::uniform_int_distribution<int> position(0, c.max_position - 1);
    for (int i = 0; i < c.nnz; ++i) {
      positions32.push_back(position(rng));
      positions64.push_back(positions32.back());
    }
  }
  TensorView view() {
    return make_view(x.data(), c.dtype, {c.nnz, c.heads, c.head_dim},
                     {token_stride, c.head_dim, 1});
  }
  TensorView positions() {
    return c.wide ? make_view(positions64.data(), DType::kInt64, {c.nnz})
                  : make_view(positions32.data(), DType::kInt32, {c.nnz});
  }
  TensorView table_view() {
    return make_view(table.data(), DType::kFloat32, {c.max_position, c.rotary_dim});
  }
  double at(const std::vector<uint8_t>& bytes, int t, int h, int d) const {
    return detail::load_as_float(bytes.data(), c.dtype, t * token_stride + h * c.head_dim + d);
  }
};

double unit(DType dtype) {
  return dtype == DType::kFloat32 ? 0x1p-23 : dtype == DType::kFloat16 ? 0x1p-10 : 0x1p-7;
}

TEST(RopeCosSinCache, MatchesTheRotationFormula) {
  std::mt19937_64 rng(31);
  for (int trial = 0; trial < 48; ++trial) {
    Case c;
    c.dtype = std::vector<DType>{DType::kFloat32, DType::kFloat16, DType::kBFloat16}[trial % 3];
    c.head_dim = std::vector<int>{8, 64, 128, 80}[trial % 4];
    c.rotary_dim = trial % 2 ? c.head_dim : 2 * (1 + static_cast<int>(rng() % (c.head_dim / 2)));
    c.interleave = trial % 4 >= 2;
    c.wide = trial % 8 >= 4;
    c.nnz = 1 + static_cast<int>(rng() % 20);
    Data data(c, rng);
    const std::vector<uint8_t> before = data.x;
    apply_rope_with_cos_sin_cache_inplace(data.view(), {}, data.positions(), data.table_view(),
                                          c.interleave);
    const int half = c.rotary_dim / 2;
    for (int t = 0; t < c.nnz; ++t) {
      const float* row = data.table.data() + int64_t{data.positions32[t]} * c.rotary_dim;
      for (int h = 0; h < c.heads; ++h) {
        for (int d = 0; d < c.head_dim; ++d) {
          double expected = data.at(before, t, h, d);
          if (d < c.rotary_dim) {
            const int pair = c.interleave ? d / 2 : d % half;
            const int partner =
                c.interleave ? (d % 2 ? d - 1 : d + 1) : (d < half ? d + half : d - half);
            const bool first = c.interleave ? d % 2 == 0 : d < half;
            const double x = data.at(before, t, h, d), y = data.at(before, t, h, partner);
            const double cosine = row[pair], sine = row[half + pair];
            expected = first ? x * cosine - y * sine : x * cosine + y * sine;
          }
          const double actual = data.at(data.x, t, h, d);
          const double slack = 4 * unit(c.dtype) * (std::fabs(expected) + 1e-3) +
                               (c.dtype == DType::kFloat32 ? 1e-5 : 0.0);
          ASSERT_NEAR(actual, expected, slack)
              << "token " << t << " head " << h << " feature " << d << " rotary " << c.rotary_dim
              << (c.interleave ? " gptj" : " neox") << " " << dtype_name(c.dtype);
        }
      }
      // The token-stride padding is untouched.
      for (int64_t pad = c.heads * c.head_dim; pad < data.token_stride; ++pad) {
        ASSERT_EQ(std::memcmp(data.x.data() + (t * data.token_stride + pad) * dtype_size(c.dtype),
                              before.data() + (t * data.token_stride + pad) * dtype_size(c.dtype),
                              dtype_size(c.dtype)),
                  0);
      }
    }
  }
}

// The table apply_rope_inplace's angles make (float(p) * frequency in float, cos / sin in
// double, rounded): the two ops agree bit for bit on q and k.
TEST(RopeCosSinCache, EqualsApplyRopeWithItsOwnTable) {
  std::mt19937_64 rng(32);
  for (bool interleave : {false, true}) {
    Case c;
    c.dtype = DType::kBFloat16;
    c.head_dim = 128;
    c.rotary_dim = 96;
    c.max_position = 4096;
    c.interleave = interleave;
    c.nnz = 33;
    Data data(c, rng);
    for (int p = 0; p < c.max_position; ++p) {
      for (int i = 0; i < c.rotary_dim / 2; ++i) {
        const float frequency = static_cast<float>(std::pow(1e4, -2.0 * i / c.rotary_dim));
        const float angle = static_cast<float>(p) * frequency;
        data.table[p * c.rotary_dim + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
        data.table[p * c.rotary_dim + c.rotary_dim / 2 + i] =
            static_cast<float>(std::sin(static_cast<double>(angle)));
      }
    }
    std::vector<uint8_t> other = data.x;
    RopeOptions options;
    options.rotary_dim = c.rotary_dim;
    options.interleave = interleave;
    apply_rope_inplace(make_view(other.data(), c.dtype, {c.nnz, c.heads, c.head_dim},
                                 {data.token_stride, c.head_dim, 1}),
                       {}, data.positions(), options);
    apply_rope_with_cos_sin_cache_inplace({}, data.view(), data.positions(), data.table_view(),
                                          interleave);
    EXPECT_EQ(other, data.x) << (interleave ? "gptj" : "neox");
  }
}

TEST(RopeCosSinCache, RejectsBadInputByName) {
  std::mt19937_64 rng(33);
  Case c;
  Data data(c, rng);
  const std::vector<uint8_t> before = data.x;
  auto expect = [&](const std::function<void()>& call, const std::string& argument) {
    EXPECT_TRUE(test::fails_with(call, Error::Kind::kInvalidArgument, "'" + argument + "'"));
    EXPECT_EQ(data.x, before) << "a rejected call wrote to q";
  };
  std::vector<int32_t> bad = data.positions32;
  bad[3] = c.max_position;  // one past the table
  expect(
      [&] {
        apply_rope_with_cos_sin_cache_inplace(
            data.view(), {}, make_view(bad.data(), DType::kInt32, {c.nnz}), data.table_view());
      },
      "positions");
  bad[3] = -1;
  expect(
      [&] {
        apply_rope_with_cos_sin_cache_inplace(
            data.view(), {}, make_view(bad.data(), DType::kInt32, {c.nnz}), data.table_view());
      },
      "positions");
  expect(
      [&] {
        apply_rope_with_cos_sin_cache_inplace(
            data.view(), {}, make_view(data.positions32.data(), DType::kInt32, {c.nnz - 1}),
            data.table_view());
      },
      "positions");
  std::vector<float> float_positions(c.nnz, 0.0f);
  expect(
      [&] {
        apply_rope_with_cos_sin_cache_inplace(
            data.view(), {}, make_view(float_positions.data(), DType::kFloat32, {c.nnz}),
            data.table_view());
      },
      "positions");
  expect(
      [&] {  // odd rotary_dim
        apply_rope_with_cos_sin_cache_inplace(
            data.view(), {}, data.positions(),
            make_view(data.table.data(), DType::kFloat32, {c.max_position / 2, 63}));
      },
      "cos_sin_cache");
  std::vector<float> wide_table(static_cast<size_t>(4) * 2 * c.head_dim);
  expect(
      [&] {  // rotary_dim > head_dim
        apply_rope_with_cos_sin_cache_inplace(
            data.view(), {}, data.positions(),
            make_view(wide_table.data(), DType::kFloat32, {4, 2 * c.head_dim}));
      },
      "cos_sin_cache");
  std::vector<uint16_t> half_table(data.table.size());
  expect(
      [&] {
        apply_rope_with_cos_sin_cache_inplace(
            data.view(), {}, data.positions(),
            make_view(half_table.data(), DType::kFloat16, {c.max_position, c.rotary_dim}));
      },
      "cos_sin_cache");
  expect(
      [&] { apply_rope_with_cos_sin_cache_inplace({}, {}, data.positions(), data.table_view()); },
      "q");
}

}  // namespace
}  // namespace tessera
