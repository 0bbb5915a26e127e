#include "common/api_runner.hpp"

#include <cstring>
#include <memory>
#include <tuple>

#include "core/backends.hpp"
#if defined(TESSERA_HAVE_CUDA)
#include "cuda/cuda_backend.hpp"
#endif

namespace tessera::test {
namespace {

// A copy of one host vector on the target device (the host vector itself on the CPU).
class Mirror {
 public:
  Mirror(Device device, void* host, size_t bytes) : device_(device), bytes_(bytes) {
    if (device.type == DeviceType::kCPU) {
      data_ = host;
      return;
    }
#if defined(TESSERA_HAVE_CUDA)
    data_ = detail::cuda_alloc(bytes);
    detail::cuda_copy_to_device(data_, host, bytes, nullptr);
#endif
  }
  ~Mirror() {
#if defined(TESSERA_HAVE_CUDA)
    if (device_.type == DeviceType::kCUDA) detail::cuda_free(data_);
#endif
  }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  void* data() const { return data_; }
  void download(void* host) const {
    if (device_.type == DeviceType::kCPU) return;
#if defined(TESSERA_HAVE_CUDA)
    detail::cuda_copy_to_host(host, data_, bytes_, nullptr);
#endif
  }

 private:
  Device device_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
std::unique_ptr<Mirror> mirror(Device device, std::vector<T>& host) {
  return std::make_unique<Mirror>(device, host.data(), host.size() * sizeof(T));
}

TensorView index_view(const Mirror& buffer, size_t count, Device device) {
  return make_view(buffer.data(), DType::kInt32, {static_cast<int64_t>(count)}, device);
}

}  // namespace

AttentionOptions options_of(const AttentionCase& c) {
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.window_right = c.window_right;
  options.logits_soft_cap = c.soft_cap;
  options.sm_scale = c.sm_scale;
  options.k_scale = c.k_scale;
  options.v_scale = c.v_scale;
  options.head_dim_vo = c.head_dim_vo;
  return options;
}

AttentionOp op_of(const AttentionCase& c) {
  // Decode-style queries over ragged K/V are a ragged prefill with equal q lengths.
  if (c.uniform_q && c.paged) return AttentionOp::kDecode;
  return c.paged ? AttentionOp::kPagedPrefill : AttentionOp::kRaggedPrefill;
}

Plan plan_for(const AttentionBuffers& buffers, Device device) {
  const AttentionCase& c = buffers.test_case;
  switch (op_of(c)) {
    case AttentionOp::kRaggedPrefill:
      return plan_ragged_prefill(buffers.qo_indptr, buffers.kv_indptr, c.num_qo_heads,
                                 c.num_kv_heads, c.head_dim, options_of(c), device);
    case AttentionOp::kPagedPrefill:
      return plan_paged_prefill(buffers.qo_indptr, buffers.page_indptr, buffers.last_page_len,
                                c.page_size, c.num_qo_heads, c.num_kv_heads, c.head_dim,
                                options_of(c), device);
    case AttentionOp::kDecode:
      return plan_decode(buffers.page_indptr, buffers.last_page_len, c.page_size,
                         c.num_qo_heads, c.num_kv_heads, c.head_dim, options_of(c), device,
                         c.q_lens.empty() ? 1 : c.q_lens[0]);
  }
  return {};
}

Outputs run_through_api(AttentionBuffers& buffers, Device device, const Plan* given_plan,
                        const RunOptions* masks) {
  const AttentionCase& c = buffers.test_case;
  const Plan plan = given_plan ? *given_plan : plan_for(buffers, device);
  poison_outputs(buffers);
  std::vector<uint8_t> workspace(plan.workspace_bytes, 0xff);
  auto q = mirror(device, buffers.q), k = mirror(device, buffers.k), v = mirror(device, buffers.v);
  auto o = mirror(device, buffers.o), lse = mirror(device, buffers.lse);
  auto qo_indptr = mirror(device, buffers.qo_indptr), kv_indptr = mirror(device, buffers.kv_indptr);
  auto page_indptr = mirror(device, buffers.page_indptr);
  auto page_indices = mirror(device, buffers.page_indices);
  auto last_page_len = mirror(device, buffers.last_page_len);
  auto space = mirror(device, workspace);
  auto sinks = mirror(device, buffers.sinks);
  RunOptions run_options;
  if (c.with_sinks) {
    run_options.sinks = make_view(sinks->data(), DType::kFloat32, {c.num_qo_heads}, device);
  }
  if (masks != nullptr) {
    run_options.custom_mask = masks->custom_mask;
    run_options.mask_indptr = masks->mask_indptr;
    run_options.tree_mask = masks->tree_mask;
  }

  const TensorView q_view =
      make_view(q->data(), c.q_dtype, {c.total_q(), c.num_qo_heads, c.head_dim},
                {buffers.q_stride_token, buffers.q_stride_head, 1}, device);
  const TensorView o_view =
      make_view(o->data(), c.q_dtype, {c.total_q(), c.num_qo_heads, c.head_dim_v()},
                {buffers.o_stride_token, buffers.o_stride_head, 1}, device);
  const TensorView lse_view =
      c.with_lse ? make_view(lse->data(), DType::kFloat32, {c.total_q(), c.num_qo_heads},
                             {buffers.lse_stride_token, 1}, device)
                 : TensorView{};
  const Workspace ws{space->data(), workspace.size()};
  PagedKVCache cache;
  if (c.paged) {
    cache.layout = c.layout;
    const bool nhd = c.layout == KVLayout::kNHD;
    for (auto [target, buffer, width] : {std::tuple{&cache.k_cache, k.get(), c.head_dim},
                                         {&cache.v_cache, v.get(), c.head_dim_v()}}) {
      *target = nhd ? make_view(buffer->data(), c.kv_dtype,
                                {buffers.num_pages, c.page_size, c.num_kv_heads, width},
                                {buffers.kv_stride_page, buffers.kv_stride_token,
                                 buffers.kv_stride_head, 1},
                                device)
                    : make_view(buffer->data(), c.kv_dtype,
                                {buffers.num_pages, c.num_kv_heads, c.page_size, width},
                                {buffers.kv_stride_page, buffers.kv_stride_head,
                                 buffers.kv_stride_token, 1},
                                device);
    }
    cache.page_indptr = index_view(*page_indptr, buffers.page_indptr.size(), device);
    cache.page_indices = index_view(*page_indices, buffers.page_indices.size(), device);
    cache.last_page_len = index_view(*last_page_len, buffers.last_page_len.size(), device);
  }
  switch (op_of(c)) {
    case AttentionOp::kRaggedPrefill: {
      const TensorView k_view =
          make_view(k->data(), c.kv_dtype, {c.total_kv(), c.num_kv_heads, c.head_dim},
                    {buffers.kv_stride_token, buffers.kv_stride_head, 1}, device);
      const TensorView v_view =
          make_view(v->data(), c.kv_dtype, {c.total_kv(), c.num_kv_heads, c.head_dim_v()},
                    {buffers.kv_stride_token, buffers.kv_stride_head, 1}, device);
      run_ragged_prefill(plan, q_view, k_view, v_view,
                         index_view(*qo_indptr, buffers.qo_indptr.size(), device),
                         index_view(*kv_indptr, buffers.kv_indptr.size(), device), o_view,
                         lse_view, ws, nullptr, run_options);
      break;
    }
    case AttentionOp::kPagedPrefill:
      run_paged_prefill(plan, q_view, cache,
                        index_view(*qo_indptr, buffers.qo_indptr.size(), device), o_view,
                        lse_view, ws, nullptr, run_options);
      break;
    case AttentionOp::kDecode:
      run_decode(plan, q_view, cache, o_view, lse_view, ws, nullptr, run_options);
      break;
  }
  o->download(buffers.o.data());
  lse->download(buffers.lse.data());
  return copy_outputs(buffers);
}

Outputs run_reference(AttentionBuffers& buffers) {
  poison_outputs(buffers);
  detail::cpu_reference_attention(make_problem(buffers));
  return copy_outputs(buffers);
}

}  // namespace tessera::test
