// Special-function-unit math used by online softmax and logits soft-capping.
#pragma once

namespace tessera::detail::ptx {

// Emits ex2.approx.ftz.f32 (PTX ISA, "Floating Point Instructions: ex2"): 2^x on the SFU,
// max relative error 2^-22 over the normal range; ex2(-inf) = +0, which is what masked logits
// rely on. Softmax is computed in base 2 with the scale folded as sm_scale * log2(e), so this
// single instruction replaces expf.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Emits rcp.approx.ftz.f32 (PTX ISA, "Floating Point Instructions: rcp"): 1/x on the SFU,
// max error about 1 ulp; rcp(+-inf) = +-0.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Emits tanh.approx.f32 (PTX ISA, "Floating Point Instructions: tanh", sm_75+): one SFU op, but
// max relative error 2^-11. Multiplied by a soft-cap of 50 that is a logit error of up to
// ~0.02 - too coarse for attention logits, which is why the prefill kernel builds its tanh from
// ex2 and rcp instead; kept for callers that tolerate it.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Emits max.NaN.f32 (PTX ISA, "Floating Point Instructions: max", sm_80+): the larger of a and b,
// NaN when either is NaN (fmaxf returns the other operand). Row maxima of scores use it, so a NaN
// score poisons its row (o = NaN, lse = NaN, as torch SDPA) instead of being skipped; one FMNMX
// like fmaxf.
__device__ __forceinline__ float max_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// min.NaN.f32, the same for the smaller value.
__device__ __forceinline__ float min_nan(float a, float b) {
  float y;
  asm("min.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

}  // namespace tessera::detail::ptx
