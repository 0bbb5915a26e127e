// CPU rotary position embedding (RoPE), in place on q and k.
//
// Numerics follow FlashInfer: the rotation angle of pair i at position p is computed in float as
// float(p) * frequency_i, so results match a GPU kernel that does the same. The frequencies
// themselves (theta power, Llama 3.1 rescaling, linear position scaling) are computed in double
// and rounded once, and sin/cos of the float angle are evaluated in double, because a fast
// approximate sin/cos loses accuracy badly at the large angles that long contexts produce.
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "core/backends.hpp"
#include "core/half.hpp"

namespace tessera::detail {
namespace {

// Meta's Llama 3.1 frequency rescaling (apply_scaling in the reference model code, also what
// FlashInfer's apply_llama31_rope does): high frequencies are kept, low frequencies are divided
// by `factor`, and the band in between is interpolated smoothly in 1 / wavelength.
double llama31_rescale(double inv_freq, const RopeOptions& options) {
  const double factor = options.llama31_factor;
  const double low_freq_factor = options.llama31_low_freq_factor;
  const double high_freq_factor = options.llama31_high_freq_factor;
  const double original_max_position = options.llama31_original_max_position;
  const double low_freq_wavelen = original_max_position / low_freq_factor;
  const double high_freq_wavelen = original_max_position / high_freq_factor;
  const double wavelen = 2.0 * std::numbers::pi / inv_freq;
  if (wavelen < high_freq_wavelen) return inv_freq;
  if (wavelen > low_freq_wavelen) return inv_freq / factor;
  // Here high_freq_wavelen <= wavelen <= low_freq_wavelen. When the two factors are equal the
  // band is a single point and the smoothing ratio is 0/0; the upper end (keep) is used there.
  const double band = high_freq_factor - low_freq_factor;
  const double smooth =
      band > 0.0 ? (original_max_position / wavelen - low_freq_factor) / band : 1.0;
  return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq;
}

// Frequency (radians per position) of each of the rotary_dim / 2 pairs, position scaling folded
// in: theta^(-2i / rotary_dim), Llama 3.1-rescaled when asked, divided by rope_scale.
std::vector<float> rope_frequencies(int32_t rotary_dim, const RopeOptions& options) {
  const int32_t half = rotary_dim / 2;
  std::vector<float> frequencies(half);
  for (int32_t i = 0; i < half; ++i) {
    double inv_freq = std::pow(static_cast<double>(options.rope_theta),
                               -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
    if (options.llama31) inv_freq = llama31_rescale(inv_freq, options);
    frequencies[i] = static_cast<float>(inv_freq / static_cast<double>(options.rope_scale));
  }
  return frequencies;
}

// Rotates the first rotary_dim features of one head row held in float. Kept out of line so that
// every caller (each dtype here, and the fused RoPE of the paged-KV append, which rotates a float
// scratch buffer through cpu_apply_rope) runs the very same float arithmetic: a compiler that
// contracted multiply-adds differently per inlined copy would break bit-exact agreement between
// "rotate then append" and the fused append.
[[gnu::noinline]] void rotate_row(float* row, const float* cos_values, const float* sin_values,
                                  int32_t rotary_dim, bool interleave) {
  const int32_t half = rotary_dim / 2;
  if (interleave) {
    for (int32_t i = 0; i < half; ++i) {
      const float x = row[2 * i];
      const float y = row[2 * i + 1];
      row[2 * i] = x * cos_values[i] - y * sin_values[i];
      row[2 * i + 1] = y * cos_values[i] + x * sin_values[i];
    }
  } else {
    for (int32_t i = 0; i < half; ++i) {
      const float x = row[i];
      const float y = row[i + half];
      row[i] = x * cos_values[i] - y * sin_values[i];
      row[i + half] = y * cos_values[i] + x * sin_values[i];
    }
  }
}

// Rotates every head of token `token` of `view` ([nnz, heads, head_dim]). `scratch` holds at
// least rotary_dim floats.
template <DType kDType>
void rotate_token(const TensorView& view, int32_t rotary_dim, int64_t token,
                  const float* cos_values, const float* sin_values, bool interleave,
                  float* scratch) {
  for (int64_t head = 0; head < view.shape[1]; ++head) {
    const int64_t base = token * view.stride[0] + head * view.stride[1];
    for (int32_t d = 0; d < rotary_dim; ++d)
      scratch[d] = load_as_float(view.data, kDType, base + d);
    rotate_row(scratch, cos_values, sin_values, rotary_dim, interleave);
    for (int32_t d = 0; d < rotary_dim; ++d)
      store_from_float(view.data, kDType, base + d, scratch[d]);
  }
}

// The angles of one rotary dimension: frequencies once, sin/cos per position.
struct AngleTable {
  AngleTable(int32_t rotary_dim, const RopeOptions& options)
      : frequencies(rope_frequencies(rotary_dim, options)),
        cos_values(frequencies.size()),
        sin_values(frequencies.size()) {}

  void set_position(int32_t position) {
    // The position is converted to float before the multiply, as FlashInfer does: the angle is
    // float(position) * frequency rounded to float, then sin/cos are evaluated accurately.
    const float position_float = static_cast<float>(position);
    for (size_t i = 0; i < frequencies.size(); ++i) {
      const float angle = position_float * frequencies[i];
      cos_values[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin_values[i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }

  std::vector<float> frequencies;
  std::vector<float> cos_values;
  std::vector<float> sin_values;
};

}  // namespace

void cpu_apply_rope_cos_sin_cache(const TensorView& q, const TensorView& k,
                                  const TensorView& positions, const TensorView& cos_sin_cache,
                                  bool interleave) {
  std::vector<const TensorView*> targets;
  for (const TensorView* view : {&q, &k}) {
    if (has_value(*view) && view->numel() > 0) targets.push_back(view);
  }
  if (targets.empty()) return;
  const int64_t nnz = targets[0]->shape[0];
  const int32_t rotary_dim = static_cast<int32_t>(cos_sin_cache.shape[1]);
  const int32_t half = rotary_dim / 2;
  const float* table = cos_sin_cache.ptr<const float>();
  const bool wide = positions.dtype == DType::kInt64;
  std::vector<float> scratch(static_cast<size_t>(rotary_dim));
  for (int64_t token = 0; token < nnz; ++token) {
    const int64_t position =
        wide ? positions.ptr<const int64_t>()[token] : positions.ptr<const int32_t>()[token];
    const float* cos_values = table + position * cos_sin_cache.stride[0];
    const float* sin_values = cos_values + half;
    for (const TensorView* view : targets) {
      switch (view->dtype) {
        case DType::kFloat32:
          rotate_token<DType::kFloat32>(*view, rotary_dim, token, cos_values, sin_values,
                                        interleave, scratch.data());
          break;
        case DType::kFloat16:
          rotate_token<DType::kFloat16>(*view, rotary_dim, token, cos_values, sin_values,
                                        interleave, scratch.data());
          break;
        case DType::kBFloat16:
          rotate_token<DType::kBFloat16>(*view, rotary_dim, token, cos_values, sin_values,
                                         interleave, scratch.data());
          break;
        default:  // the core lets only fp32 / fp16 / bf16 q and k through
          break;
      }
    }
  }
}

void cpu_apply_rope(const TensorView& q, const TensorView& k, const int32_t* positions,
                    const RopeOptions& options) {
  // The core guarantees that q and k, when both are given, share nnz and head_dim, and that
  // rotary_dim is even and at most head_dim.
  std::vector<const TensorView*> targets;
  for (const TensorView* view : {&q, &k}) {
    if (has_value(*view) && view->numel() > 0) targets.push_back(view);
  }
  if (targets.empty()) return;
  const int64_t nnz = targets[0]->shape[0];
  const int32_t head_dim = static_cast<int32_t>(targets[0]->shape[2]);
  const int32_t rotary_dim = options.rotary_dim == 0 ? head_dim : options.rotary_dim;

  AngleTable table(rotary_dim, options);
  std::vector<float> scratch(static_cast<size_t>(rotary_dim));
  for (int64_t token = 0; token < nnz; ++token) {
    table.set_position(positions[token]);
    const float* cos_values = table.cos_values.data();
    const float* sin_values = table.sin_values.data();
    for (const TensorView* view : targets) {
      switch (view->dtype) {
        case DType::kFloat32:
          rotate_token<DType::kFloat32>(*view, rotary_dim, token, cos_values, sin_values,
                                        options.interleave, scratch.data());
          break;
        case DType::kFloat16:
          rotate_token<DType::kFloat16>(*view, rotary_dim, token, cos_values, sin_values,
                                        options.interleave, scratch.data());
          break;
        case DType::kBFloat16:
          rotate_token<DType::kBFloat16>(*view, rotary_dim, token, cos_values, sin_values,
                                         options.interleave, scratch.data());
          break;
        default:  // the core lets only fp32 / fp16 / bf16 q and k through
          break;
      }
    }
  }
}

}  // namespace tessera::detail
