// libFuzzer target for the C ABI (include/tessera/tessera.h) on CPU tensors.
//
// The input decodes into one call: an attention op (plan + run, or one-shot; ragged, paged,
// decode; through the plain calls or the *_v2 ones with fuzzed run options: sinks, PDL, custom
// and tree masks, struct_size), a multi-level cascade (plan + run) or an aux op (RoPE, paged-KV append, block_table -> CSR, merge_state(s)), with random
// shapes, dtypes, strides, index arrays, page tables and options. Arguments start out mostly
// valid (so kernels run on random shapes) and then get a few random mutations (dims, strides,
// dtypes, devices, NULLs, index contents). Every tensor lives in its own heap block with guard
// bytes on both sides. After the call:
//  - the status is OK with tessera_last_error() == "", or an error with a non-empty text;
//  - a failed call changed no byte of any buffer (arguments are validated before any write);
//  - a successful call changed no byte of a read-only tensor, and no byte of an output's block
//    outside the output's elements (stride padding and guards included);
//  - ASan / UBSan see no invalid access (a NULL data pointer stands for "too large to allocate":
//    the library must reject it before reading).
// Build and run: tools/fuzz.sh.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuzz/capi_arena.hpp"
#include "tessera/tessera.h"

namespace {

void attention(Arena& arena, FuzzedDataProvider& fdp) {
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 5);  // ragged/paged/decode x plan/oneshot
  const int op = mode % 3;
  const bool one_shot = mode >= 3;
  const int batch = small(fdp, 0, 4);
  const int hkv = small(fdp, 1, 3), group = small(fdp, 1, 4), dim = head_dim(fdp);
  // head_dim_vo (the *_v2 plan calls' tessera_plan_options): mostly the qk width; sometimes
  // another (valid, or not a multiple of 8, or past 512), given to the plan or not.
  const bool other_vo = fdp.ConsumeIntegralInRange<int>(0, 5) == 0;
  const int dim_v = other_vo ? (fdp.ConsumeBool() ? 8 * small(fdp, 0, 66) : head_dim(fdp)) : dim;
  const bool plan_v2 = other_vo ? fdp.ConsumeIntegralInRange<int>(0, 7) != 0 : fdp.ConsumeBool();
  int hqo = hkv * group;
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) hqo = small(fdp, -1, 7);
  const int q_per_request = small(fdp, op == 2 ? 1 : 0, 4);
  const int page_size = fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? small(fdp, -1, 0)
                                                                     : small(fdp, 1, 8);
  std::vector<int32_t> q_lens, kv_lens;
  for (int b = 0; b < batch; ++b) {
    q_lens.push_back(op == 2 ? q_per_request : small(fdp, 0, 7));
    kv_lens.push_back(small(fdp, 0, 20));
  }
  const std::vector<int32_t> qo_indptr = indptr_of(q_lens);
  const std::vector<int32_t> kv_indptr = indptr_of(kv_lens);
  const int64_t total_q = qo_indptr.back(), total_kv = kv_indptr.back();
  const ElemKind qk = q_kind(fdp), kvk = kv_kind(fdp, qk);
  tessera_attention_options options = attention_options(fdp);
  const bool null_options = fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
  const tessera_attention_options* opts = null_options ? nullptr : &options;

  Tensor* q = arena.make(qk, {total_q, hqo, dim}, false, small(fdp, 0, 2) * 8, small(fdp, 0, 1) * 8);
  Tensor* o = arena.make(qk, {total_q, hqo, dim_v}, true, small(fdp, 0, 2) * 8, small(fdp, 0, 1) * 8);
  Tensor* lse = fdp.ConsumeBool() ? arena.make(kF32, {total_q, hqo}, true, small(fdp, 0, 3), 0)
                                  : nullptr;
  // The *_v2 calls' per-call options: sinks of a fuzzed dtype and length (their values are the
  // arena's fill: NaN and inf included, which checked mode and the kernels define), PDL, and a
  // struct_size from 0 (no field read) up to the struct's.
  const bool v2 = fdp.ConsumeBool();
  tessera_run_options run_options;
  tessera_run_options_default(&run_options);
  Tensor* sinks = nullptr;
  if (v2) {
    if (fdp.ConsumeBool()) {
      const ElemKind sink_kind = fdp.ConsumeIntegralInRange<int>(0, 7) == 0 ? q_kind(fdp) : kF32;
      const int64_t heads = fdp.ConsumeIntegralInRange<int>(0, 7) == 0
                                ? small(fdp, 0, std::max(hqo, 0) + 2)
                                : hqo;
      sinks = arena.make(sink_kind, {heads}, false);
    }
    run_options.enable_pdl = fdp.ConsumeBool();
    if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) {
      run_options.struct_size = fdp.ConsumeIntegralInRange<size_t>(0, sizeof run_options);
    }
  }
  // Masks (the v2 calls): a custom mask + mask_indptr for prefill or a tree mask for decode,
  // sometimes for the other op (rejected), sized right or a byte off, with random bits; the
  // mutations below may hit them too.
  Tensor *custom_mask = nullptr, *mask_indptr = nullptr, *tree_mask = nullptr;
  if (v2 && fdp.ConsumeBool()) {
    const bool tree = (op == 2) != (fdp.ConsumeIntegralInRange<int>(0, 7) == 0);
    if (tree) {
      const int64_t bytes = (q_per_request * q_per_request + 7) / 8 + small(fdp, -1, 2);
      const int64_t rows = fdp.ConsumeIntegralInRange<int>(0, 7) == 0 ? small(fdp, 0, 5) : batch;
      tree_mask = arena.make(kU8, {rows, bytes}, false, small(fdp, 0, 2), 0);
    } else {
      std::vector<int32_t> segments;
      for (int b = 0; b < batch; ++b) {
        segments.push_back((q_lens[b] * kv_lens[b] + 7) / 8 + small(fdp, 0, 1) -
                           (fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? 1 : 0));
      }
      std::vector<int32_t> offsets = indptr_of(segments);
      const int32_t first = small(fdp, 0, 2);
      for (int32_t& offset : offsets) offset += first;
      if (fdp.ConsumeIntegralInRange<int>(0, 7) != 0) {
        custom_mask = arena.make(kU8, {offsets.back() + small(fdp, -1, 2)}, false);
      }
      if (fdp.ConsumeIntegralInRange<int>(0, 7) != 0) mask_indptr = arena.ints(offsets);
    }
  }
  Tensor *k = nullptr, *v = nullptr, *qo = nullptr, *kvp = nullptr;
  Paged paged{};
  if (op == 0) {
    const int64_t extra = small(fdp, 0, 2);
    k = arena.make(kvk, {total_kv + extra, hkv, dim}, false, small(fdp, 0, 2) * 8, 0);
    v = arena.make(kvk, {total_kv + extra, hkv, dim_v}, false, 0, small(fdp, 0, 2) * 8);
    qo = arena.ints(qo_indptr);
    kvp = arena.ints(kv_indptr);
  } else {
    paged = make_paged(arena, fdp, kv_lens, std::max(page_size, 1), hkv, dim, kvk, false, dim_v);
    if (op == 1) qo = arena.ints(qo_indptr);
  }

  tessera_plan* plan = nullptr;
  tessera_status status = TESSERA_OK;
  // Host arrays for the planner (possibly perturbed independently of the tensors).
  std::vector<int32_t> plan_qo = qo_indptr, plan_kv = kv_indptr;
  std::vector<int32_t> plan_pages = paged.page_indptr, plan_last = paged.last_page_len;
  if (!one_shot && fdp.ConsumeIntegralInRange<int>(0, 7) == 0) {
    std::vector<int32_t>* arrays[] = {&plan_qo, &plan_kv, &plan_pages, &plan_last};
    std::vector<int32_t>& a = *arrays[fdp.ConsumeIntegralInRange<int>(0, 3)];
    if (!a.empty()) a[fdp.ConsumeIntegralInRange<size_t>(0, a.size() - 1)] += small(fdp, -3, 3);
  }
  const int device_type = fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? small(fdp, 0, 16) : kDLCPU;
  tessera_plan_options plan_options;
  tessera_plan_options_default(&plan_options);
  plan_options.head_dim_vo = dim_v == dim && fdp.ConsumeBool() ? 0 : dim_v;
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) {
    plan_options.struct_size = fdp.ConsumeIntegralInRange<size_t>(0, sizeof plan_options);
  }
  const tessera_plan_options* po =
      fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? nullptr : &plan_options;
  if (!one_shot && plan_v2) {
    if (op == 0) {
      status = tessera_plan_ragged_prefill_v2(plan_qo.data(), plan_kv.data(), batch, hqo, hkv,
                                              dim, opts, po, device_type, 0, &plan);
    } else if (op == 1) {
      status = tessera_plan_paged_prefill_v2(plan_qo.data(), plan_pages.data(), plan_last.data(),
                                             batch, page_size, hqo, hkv, dim, opts, po,
                                             device_type, 0, &plan);
    } else {
      status = tessera_plan_decode_v2(plan_pages.data(), plan_last.data(), batch, page_size, hqo,
                                      hkv, dim, q_per_request, opts, po, device_type, 0, &plan);
    }
  } else if (!one_shot) {
    if (op == 0) {
      status = tessera_plan_ragged_prefill(plan_qo.data(), plan_kv.data(), batch, hqo, hkv, dim,
                                           opts, device_type, 0, &plan);
    } else if (op == 1) {
      status = tessera_plan_paged_prefill(plan_qo.data(), plan_pages.data(), plan_last.data(),
                                          batch, page_size, hqo, hkv, dim, opts, device_type, 0,
                                          &plan);
    } else {
      status = tessera_plan_decode(plan_pages.data(), plan_last.data(), batch, page_size, hqo,
                                   hkv, dim, q_per_request, opts, device_type, 0, &plan);
    }
  }
  if (!one_shot) {
    arena.check(status);
    if (status != TESSERA_OK) {
      if (plan != nullptr) die("failed plan call returned a plan");
      return;
    }
    if (plan == nullptr) die("successful plan call returned NULL");
    const int32_t planned_vo = tessera_plan_head_dim_vo(plan);
    if (planned_vo != dim && planned_vo != plan_options.head_dim_vo) die("plan_head_dim_vo");
    size_t needed = 0;
    char text[64];
    const tessera_status explain = tessera_plan_explain(plan, text, sizeof text, &needed);
    if (needed == 0 || (explain == TESSERA_OK) != (needed <= sizeof text)) die("plan_explain");
    if (std::strlen(text) + 1 > sizeof text) die("plan_explain: not NUL-terminated");
  }
  Workspace workspace;
  if (plan != nullptr) workspace = make_workspace(arena, fdp, plan);

  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  const tessera_paged_kv kv = op == 0 ? tessera_paged_kv{} : paged.kv();
  const DLTensor* lse_t = lse ? lse->get() : nullptr;
  void* ws = workspace.tensor ? workspace.data() : nullptr;
  const bool null_kv = fdp.ConsumeIntegralInRange<int>(0, 31) == 0;
  run_options.sinks = sinks != nullptr ? sinks->get() : nullptr;
  run_options.custom_mask = custom_mask != nullptr ? custom_mask->get() : nullptr;
  run_options.mask_indptr = mask_indptr != nullptr ? mask_indptr->get() : nullptr;
  run_options.tree_mask = tree_mask != nullptr ? tree_mask->get() : nullptr;
  const tessera_run_options* ro =
      v2 && fdp.ConsumeIntegralInRange<int>(0, 15) != 0 ? &run_options : nullptr;
  if (v2 && one_shot) {
    if (op == 0) {
      status = tessera_ragged_prefill_v2(q->get(), k->get(), v->get(), qo->get(), kvp->get(),
                                         o->get(), lse_t, opts, nullptr, ro);
    } else if (op == 1) {
      status = tessera_paged_prefill_v2(q->get(), null_kv ? nullptr : &kv, qo->get(), o->get(),
                                        lse_t, opts, nullptr, ro);
    } else {
      status = tessera_decode_v2(q->get(), null_kv ? nullptr : &kv, o->get(), lse_t, opts,
                                 nullptr, ro);
    }
  } else if (v2) {
    const tessera_plan* run_plan = fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? nullptr : plan;
    if (op == 0) {
      status = tessera_run_ragged_prefill_v2(run_plan, q->get(), k->get(), v->get(), qo->get(),
                                             kvp->get(), o->get(), lse_t, ws, workspace.bytes,
                                             nullptr, ro);
    } else if (op == 1) {
      status = tessera_run_paged_prefill_v2(run_plan, q->get(), null_kv ? nullptr : &kv,
                                            qo->get(), o->get(), lse_t, ws, workspace.bytes,
                                            nullptr, ro);
    } else {
      status = tessera_run_decode_v2(run_plan, q->get(), null_kv ? nullptr : &kv, o->get(),
                                     lse_t, ws, workspace.bytes, nullptr, ro);
    }
  } else if (one_shot) {
    if (op == 0) {
      status = tessera_ragged_prefill(q->get(), k->get(), v->get(), qo->get(), kvp->get(),
                                      o->get(), lse_t, opts, nullptr);
    } else if (op == 1) {
      status = tessera_paged_prefill(q->get(), null_kv ? nullptr : &kv, qo->get(), o->get(),
                                     lse_t, opts, nullptr);
    } else {
      status = tessera_decode(q->get(), null_kv ? nullptr : &kv, o->get(), lse_t, opts, nullptr);
    }
  } else {
    const tessera_plan* run_plan = fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? nullptr : plan;
    if (op == 0) {
      status = tessera_run_ragged_prefill(run_plan, q->get(), k->get(), v->get(), qo->get(),
                                          kvp->get(), o->get(), lse_t, ws, workspace.bytes,
                                          nullptr);
    } else if (op == 1) {
      status = tessera_run_paged_prefill(run_plan, q->get(), null_kv ? nullptr : &kv, qo->get(),
                                         o->get(), lse_t, ws, workspace.bytes, nullptr);
    } else {
      status = tessera_run_decode(run_plan, q->get(), null_kv ? nullptr : &kv, o->get(), lse_t,
                                  ws, workspace.bytes, nullptr);
    }
  }
  arena.check(status);
  tessera_plan_destroy(plan);
}

tessera_rope_options rope_options(FuzzedDataProvider& fdp, int dim) {
  tessera_rope_options r;
  tessera_rope_options_default(&r);
  if (fdp.ConsumeBool()) r.rotary_dim = small(fdp, -2, dim + 2);
  r.interleave = fdp.ConsumeBool();
  if (fdp.ConsumeBool()) r.rope_theta = fdp.ConsumeFloatingPoint<float>();
  if (fdp.ConsumeBool()) r.rope_scale = fdp.ConsumeFloatingPoint<float>();
  r.llama31 = fdp.ConsumeBool();
  if (fdp.ConsumeBool()) {
    r.llama31_factor = fdp.ConsumeFloatingPoint<float>();
    r.llama31_low_freq_factor = fdp.ConsumeFloatingPoint<float>();
    r.llama31_high_freq_factor = fdp.ConsumeFloatingPoint<float>();
    r.llama31_original_max_position = fdp.ConsumeIntegral<int32_t>();
  }
  return r;
}

void rope(Arena& arena, FuzzedDataProvider& fdp) {
  const int64_t nnz = small(fdp, 0, 6);
  const int dim = head_dim(fdp);
  const ElemKind kind = q_kind(fdp);
  Tensor* q = fdp.ConsumeBool() ? arena.make(kind, {nnz, small(fdp, 1, 4), dim}, true, small(fdp, 0, 2) * 8, 0) : nullptr;
  Tensor* k = fdp.ConsumeBool() ? arena.make(kind, {nnz, small(fdp, 1, 4), dim}, true, 0, small(fdp, 0, 2) * 8) : nullptr;
  std::vector<int32_t> pos(nnz);
  for (auto& p : pos) p = fdp.ConsumeIntegralInRange<int32_t>(-2, 100000);
  Tensor* positions = arena.ints(pos);
  const tessera_rope_options options = rope_options(fdp, dim);
  const bool null_options = fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  arena.check(tessera_apply_rope_inplace(q ? q->get() : nullptr, k ? k->get() : nullptr,
                                         positions->get(), null_options ? nullptr : &options,
                                         nullptr));
}

// apply_rope_with_cos_sin_cache_inplace: a table of fuzzed shape and dtype, int32 or int64
// positions in and around its rows.
void rope_table(Arena& arena, FuzzedDataProvider& fdp) {
  const int64_t nnz = small(fdp, 0, 6);
  const int dim = head_dim(fdp);
  const ElemKind kind = q_kind(fdp);
  Tensor* q = fdp.ConsumeBool() ? arena.make(kind, {nnz, small(fdp, 1, 4), dim}, true, small(fdp, 0, 2) * 8, 0) : nullptr;
  Tensor* k = fdp.ConsumeBool() ? arena.make(kind, {nnz, small(fdp, 1, 4), dim}, true, 0, small(fdp, 0, 2) * 8) : nullptr;
  const int64_t rows = small(fdp, 0, 9), rotary = fdp.ConsumeBool() ? dim : small(fdp, -1, dim + 3);
  Tensor* table = arena.make(fdp.ConsumeIntegralInRange<int>(0, 7) == 0 ? q_kind(fdp) : kF32,
                             {rows, rotary}, false);
  std::vector<int32_t> pos(nnz);
  for (auto& p : pos) p = fdp.ConsumeIntegralInRange<int32_t>(-1, static_cast<int32_t>(rows));
  Tensor* positions = fdp.ConsumeBool() ? arena.ints64(pos) : arena.ints(pos);
  const int interleave = fdp.ConsumeBool();
  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  arena.check(tessera_apply_rope_with_cos_sin_cache_inplace(
      q ? q->get() : nullptr, k ? k->get() : nullptr, positions->get(), table->get(), interleave,
      nullptr));
}

void append(Arena& arena, FuzzedDataProvider& fdp) {
  const int batch = small(fdp, 0, 4);
  const int hkv = small(fdp, 1, 3), dim = head_dim(fdp), page_size = small(fdp, 1, 8);
  std::vector<int32_t> kv_lens, append_lens;
  for (int b = 0; b < batch; ++b) {
    kv_lens.push_back(small(fdp, 0, 20));
    append_lens.push_back(small(fdp, 0, kv_lens.back()));
  }
  const std::vector<int32_t> append_indptr = indptr_of(append_lens);
  const int64_t nnz = append_indptr.back();
  const ElemKind kind = q_kind(fdp);
  const ElemKind cache_kind = kv_kind(fdp, kind);
  Tensor* k_new = arena.make(kind, {nnz, hkv, dim}, false, small(fdp, 0, 2) * 8, 0);
  Tensor* v_new = arena.make(kind, {nnz, hkv, dim}, false, 0, small(fdp, 0, 2) * 8);
  Tensor* indptr = arena.ints(append_indptr);
  Paged paged = make_paged(arena, fdp, kv_lens, page_size, hkv, dim, cache_kind, true);
  const tessera_rope_options r = rope_options(fdp, dim);
  const bool with_rope = fdp.ConsumeBool();
  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  const tessera_paged_kv kv = paged.kv();
  arena.check(tessera_append_paged_kv_cache(k_new->get(), v_new->get(), indptr->get(), &kv,
                                            with_rope ? &r : nullptr, nullptr));
}

void block_table(Arena& arena, FuzzedDataProvider& fdp) {
  const int batch = small(fdp, 0, 4), max_pages = small(fdp, 0, 5), page_size = small(fdp, -1, 8);
  std::vector<int32_t> table(static_cast<size_t>(batch) * max_pages), seq(batch);
  for (auto& t : table) t = small(fdp, -1, 20);
  for (auto& s : seq) s = small(fdp, -1, max_pages * std::max(page_size, 1) + 1);
  Tensor* bt = arena.ints(table);
  bt->t.ndim = 2;
  bt->shape[0] = batch;
  bt->shape[1] = max_pages;
  bt->strides[0] = max_pages;
  bt->strides[1] = 1;
  bt->explicit_strides = false;
  Tensor* seq_lens = arena.ints(seq);
  Tensor* indptr = arena.make(kI32, {batch + 1}, true);
  Tensor* indices = arena.make(kI32, {static_cast<int64_t>(table.size()) + small(fdp, -2, 2)}, true);
  Tensor* last = arena.make(kI32, {batch}, true);
  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  arena.check(tessera_block_table_to_csr(bt->get(), seq_lens->get(), page_size, indptr->get(),
                                         indices->get(), last->get(), nullptr));
}

void merge(Arena& arena, FuzzedDataProvider& fdp) {
  const int64_t heads = small(fdp, 1, 3), dim = head_dim(fdp);
  const ElemKind kind = fdp.ConsumeBool() ? kF32 : q_kind(fdp);
  if (fdp.ConsumeBool()) {
    const int64_t n = small(fdp, 0, 5);
    Tensor* oa = arena.make(kind, {n, heads, dim}, false, small(fdp, 0, 1) * 8, 0);
    Tensor* la = arena.make(kF32, {n, heads}, false, small(fdp, 0, 2), 0);
    Tensor* ob = arena.make(kind, {n, heads, dim}, false, 0, small(fdp, 0, 1) * 8);
    Tensor* lb = arena.make(kF32, {n, heads}, false);
    Tensor* out = arena.make(q_kind(fdp), {n, heads, dim}, true, small(fdp, 0, 1) * 8, 0);
    Tensor* lout = fdp.ConsumeBool() ? arena.make(kF32, {n, heads}, true, small(fdp, 0, 2), 0) : nullptr;
    const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
    for (int i = 0; i < mutations; ++i) arena.mutate();
    arena.finalize();
    arena.check(tessera_merge_state(oa->get(), la->get(), ob->get(), lb->get(), out->get(),
                                    lout ? lout->get() : nullptr, nullptr));
  } else {
    const int n = small(fdp, 0, 4);
    std::vector<int32_t> counts(n);
    for (auto& c : counts) c = small(fdp, 0, 3);
    const std::vector<int32_t> indptr = indptr_of(counts);
    const int64_t s = indptr.back() + small(fdp, 0, 1);
    Tensor* states = arena.make(kind, {s, heads, dim}, false, small(fdp, 0, 1) * 8, 0);
    Tensor* lse = arena.make(kF32, {s, heads}, false);
    Tensor* ip = arena.ints(indptr);
    Tensor* out = arena.make(q_kind(fdp), {n, heads, dim}, true, 0, small(fdp, 0, 1) * 8);
    Tensor* lout = fdp.ConsumeBool() ? arena.make(kF32, {n, heads}, true) : nullptr;
    const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
    for (int i = 0; i < mutations; ++i) arena.mutate();
    arena.finalize();
    arena.check(tessera_merge_states(states->get(), lse->get(), ip->get(), out->get(),
                                     lout ? lout->get() : nullptr, nullptr));
  }
}

// Cascade attention: 1-3 levels of random groupings over one paged pool (make_paged's pages,
// re-split into levels), plan perturbed independently of the tensors, sinks sometimes.
void cascade(Arena& arena, FuzzedDataProvider& fdp) {
  const int hkv = small(fdp, 1, 2), group = small(fdp, 1, 3), dim = head_dim(fdp);
  const int hqo = hkv * group, page_size = small(fdp, 1, 5);
  const int num_levels = small(fdp, 1, 3), batch = small(fdp, 0, 3);
  std::vector<int32_t> q_lens;
  for (int b = 0; b < batch; ++b) q_lens.push_back(small(fdp, 0, 3));
  const std::vector<int32_t> qo_indptr = indptr_of(q_lens);
  const int64_t total_q = qo_indptr.back();
  std::vector<int32_t> all_kv;  // every level's groups' key counts, level by level
  std::vector<std::vector<int32_t>> level_qo;
  for (int l = 0; l < num_levels; ++l) {
    const bool last = l + 1 == num_levels;
    std::vector<int32_t> qo = last ? qo_indptr : std::vector<int32_t>{0};
    if (!last) {  // cut the rows into a few groups
      for (int64_t r = small(fdp, 0, 3); r < total_q; r += small(fdp, 1, 3)) qo.push_back(r);
      qo.push_back(static_cast<int32_t>(total_q));
    }
    if (fdp.ConsumeIntegralInRange<int>(0, 15) == 15) qo.back() += small(fdp, -1, 1);
    for (size_t g = 0; g + 1 < qo.size(); ++g) all_kv.push_back(small(fdp, 0, 12));
    level_qo.push_back(qo);
  }
  const ElemKind qk = q_kind(fdp);
  const Paged paged = make_paged(arena, fdp, all_kv, page_size, hkv, dim, qk, false);
  tessera_attention_options options = attention_options(fdp);
  if (fdp.ConsumeIntegralInRange<int>(0, 7) != 7) options.window_left = options.window_right = -1;
  Tensor* q = arena.make(qk, {total_q, hqo, dim}, false, small(fdp, 0, 1) * 8, 0);
  Tensor* o = arena.make(qk, {total_q, hqo, dim}, true, 0, small(fdp, 0, 1) * 8);
  Tensor* lse = fdp.ConsumeBool() ? arena.make(kF32, {total_q, hqo}, true) : nullptr;
  Tensor* sinks = fdp.ConsumeBool() ? arena.make(kF32, {hqo}, false) : nullptr;
  // Each level's slice of the pool's page table, re-based.
  std::vector<std::vector<int32_t>> host(4 * static_cast<size_t>(num_levels));
  std::vector<Tensor*> index_tensors;
  size_t slot = 0;  // the pool's request (level group) being sliced
  for (int l = 0; l < num_levels; ++l) {
    std::vector<int32_t>& qo = host[4 * l];
    std::vector<int32_t>& indptr = host[4 * l + 1];
    std::vector<int32_t>& last = host[4 * l + 3];
    qo = level_qo[l];
    indptr = {0};
    for (size_t g = 0; g + 1 < qo.size(); ++g, ++slot) {
      indptr.push_back(indptr.back() + paged.page_indptr[slot + 1] - paged.page_indptr[slot]);
      last.push_back(paged.last_page_len[slot]);
    }
    const int32_t first = paged.page_indptr[slot - (qo.size() - 1)];
    host[4 * l + 2] = std::vector<int32_t>(paged.indices->ints.begin() + first,
                                           paged.indices->ints.begin() + first + indptr.back());
    for (int i = 0; i < 4; ++i) index_tensors.push_back(arena.ints(host[4 * l + i]));
  }
  std::vector<tessera_cascade_level_lengths> lengths;
  for (int l = 0; l < num_levels; ++l) {
    lengths.push_back({host[4 * l].data(), host[4 * l + 1].data(), host[4 * l + 3].data(),
                       static_cast<int64_t>(host[4 * l + 3].size())});
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 7 && !host[1].empty()) host[1].back() += small(fdp, -2, 2);
  tessera_cascade_plan* plan = nullptr;
  const int planned_levels = fdp.ConsumeIntegralInRange<int>(0, 15) == 15 ? small(fdp, -1, 17) : num_levels;
  const tessera_status planned =
      tessera_plan_cascade(planned_levels > 0 && planned_levels <= num_levels ? lengths.data() : nullptr,
                           planned_levels, page_size, hqo, hkv, dim, &options, kDLCPU, 0, &plan);
  if ((planned == TESSERA_OK) != (plan != nullptr)) die("plan_cascade: status and plan disagree");
  if (plan == nullptr) return;
  size_t bytes = tessera_cascade_plan_workspace_bytes(plan);
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 15 && bytes > 0) bytes -= 1;
  Tensor* workspace = arena.make(kI64, {static_cast<int64_t>(bytes / 8 + 1)}, /*output=*/true);
  workspace->no_mutate = true;
  workspace->explicit_strides = false;
  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  std::vector<tessera_cascade_level> levels;
  for (int l = 0; l < num_levels; ++l) {
    levels.push_back({index_tensors[4 * l]->get(), index_tensors[4 * l + 1]->get(),
                      index_tensors[4 * l + 2]->get(), index_tensors[4 * l + 3]->get()});
  }
  tessera_run_options run_options;
  tessera_run_options_default(&run_options);
  run_options.sinks = sinks ? sinks->get() : nullptr;
  arena.check(tessera_run_cascade(plan, q->get(), paged.k->get(), paged.v->get(), paged.layout,
                                  levels.data(),
                                  fdp.ConsumeIntegralInRange<int>(0, 15) == 15 ? small(fdp, 0, num_levels)
                                                                              : num_levels,
                                  o->get(), lse ? lse->get() : nullptr, workspace->t.data, bytes,
                                  nullptr, &run_options));
  tessera_cascade_plan_destroy(plan);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  Arena arena;
  arena.fdp = &fdp;
  arena.seed = fdp.ConsumeIntegral<uint64_t>();
  const int threads = fdp.ConsumeIntegralInRange<int>(0, 7);
  // Mostly one thread (fast); sometimes 2, and the reference path.
  if (tessera_set_num_threads(threads == 7 ? 2 : 1) != TESSERA_OK) die("set_num_threads");
  if (tessera_set_cpu_reference(threads == 6) != TESSERA_OK) die("set_cpu_reference");
  switch (fdp.ConsumeIntegralInRange<int>(0, 10)) {
    case 0: rope(arena, fdp); break;
    case 10: rope_table(arena, fdp); break;
    case 1: append(arena, fdp); break;
    case 2: block_table(arena, fdp); break;
    case 3: merge(arena, fdp); break;
    case 4: cascade(arena, fdp); break;
    default: attention(arena, fdp); break;
  }
  return 0;
}
