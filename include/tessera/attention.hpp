// Tessera attention API: ragged (varlen) prefill, paged prefill (chunked prefill / append) and
// batch decode, each as a plan/run pair, plus one-shot convenience calls.
//
// Semantics (FlashInfer / FlashAttention conventions):
//  * q [total_q, num_qo_heads, head_dim], ragged by qo_indptr[B+1] (int32, = cu_seqlens_q).
//  * Ragged K/V: k [total_kv, num_kv_heads, head_dim], v [total_kv, num_kv_heads, head_dim_vo],
//    ragged by kv_indptr[B+1].
//  * head_dim is the query/key width (head_dim_qk); head_dim_vo (AttentionOptions, 0 = head_dim)
//    the value/output width: v, v_cache and o have head_dim_vo as their last dimension (DeepSeek
//    prefill 192/128, MLA-style 64/512). sm_scale defaults to 1/sqrt(head_dim) (the qk width).
//  * Paged K/V: see PagedKVCache. Strides of every tensor are honoured except the last dim,
//    which must be contiguous.
//  * GQA/MQA: num_qo_heads (at most 65536) must be an integer multiple of num_kv_heads; query
//    head h reads kv head h / (num_qo_heads / num_kv_heads).
//  * Causal masks are aligned bottom-right: query i of a request with q_len queries and kv_len
//    keys sees key j iff j <= i + kv_len - q_len. A sliding window (left, right) further limits
//    keys to [i + off - left, i + off + right] with off = kv_len - q_len; -1 = unbounded.
//  * Custom masks (prefill) and tree masks (speculative decoding), RunOptions::custom_mask /
//    tree_mask: per-call bit masks that further limit the keys a row sees (AND with the causal
//    and window masks). See RunOptions. CPU backend only for now.
//  * Soft-cap: s = cap * tanh(s / cap) applied to the scaled logits (cap = 0: off).
//  * o has q's dtype; lse (optional) is float32 [total_q, num_qo_heads], natural log.
//  * A query row that sees no key gives o = 0 and lse = -inf, never NaN.
//  * Attention sinks (optional, RunOptions::sinks): float32 [num_qo_heads] on q's device, one
//    logit z_h per query head in the units of the scaled (and soft-capped) scores (gpt-oss's
//    s_aux, FA4's learnable_sink). Each row's softmax runs over its visible scores plus z_h; the
//    sink has no value row:
//      o = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{z_h}),  lse = log(sum_j e^{s_j} + e^{z_h}).
//    A row without visible keys (or whose visible scores are all -inf) gets o = 0, lse = z_h.
//    A sink of -inf is no sink; a NaN or +inf sink makes every row of its head NaN (o and lse),
//    as a NaN or +inf score does. Sinks combine with causal and window masks, soft-cap, GQA,
//    split-KV (the pieces never include the sink; the merge adds it once) and the lse output.
//    merge_state / merge_states stay sink-free: merging states that each folded a sink would
//    count it twice, so merge sink-free states and fold the sink into the result.
//
// Non-finite inputs (NaN, +-inf): one definition for every backend (CPU reference, CPU fast
// path, CUDA sm80 and sm90, and their split-KV merges). Per output row (query token, query head)
// with visible key set V (causal / window / request bounds):
//  * V empty: o = 0, lse = -inf (z_h with a finite sink), whatever q holds.
//  * Otherwise the scores s_j = sm_scale * k_scale * (q . k_j) for j in V (soft-capped when the
//    cap is set: cap * tanh(+-inf / cap) = +-cap is finite) are taken per IEEE. If any s_j is NaN
//    or +inf (NaN or inf in q, NaN in k_j, inf * 0, inf - inf, ...), the whole row is NaN:
//    o = NaN in every feature, lse = NaN. This is what torch SDPA returns.
//  * A score of -inf (finite q against an infinite k_j) is weight 0, like a masked key. A row
//    whose visible scores are all -inf gives o = 0, lse = -inf, whatever v holds (a documented
//    deviation from torch, which returns NaN there).
//  * NaN / inf in v_j reaches o through p_j * v_j per IEEE, in the features that hold it: NaN
//    gives NaN; inf with p_j > 0 gives inf, or NaN (inf - inf, or a split-KV piece or key tile
//    that also multiplied it by P = 0); a visible key of weight exactly 0 (score -inf) with an
//    infinite v gives NaN (0 * inf, as in torch), or the value without that key where a
//    split-KV piece saw no other key and finished empty (o = 0). lse is unchanged.
//    A key outside V never changes a row through its k, and a key of another request or past
//    the request's end is never read at all. A NaN / inf in v_j of a key that a row's causal or
//    window mask excludes may still turn o[feature] of that row NaN (lse unchanged, the other
//    features as without it) when j shares the row's key tile, since the tile's P V product
//    multiplies P = 0 by it, as FlashAttention does (torch's math path turns every row of the
//    request NaN); the CPU backends never read it. Checked mode reports it either way.
//  * merge_state / merge_states: a NaN state (lse NaN, or +inf) makes the merged row NaN; an
//    empty state (lse = -inf) contributes nothing (its o is never read). Split-KV pieces combine
//    as one pass over all the keys would: a NaN piece makes the row NaN, and an empty piece has
//    weight 0 and adds nothing.
//  * Rows the non-finite value does not touch (other requests, other kv heads, rows whose mask
//    excludes the key, except for that feature as above) are exactly as without it.
// Checked mode (set_index_checking, TESSERA_CHECK=1; tessera/backend.hpp) rejects a non-finite
// q, k or v element that the call reads, and a NaN or +inf sink (a -inf sink is valid: no sink),
// naming the tensor and its first index, before running.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/types.hpp"

namespace tessera {

enum class KVLayout : int32_t { kNHD = 0, kHND = 1 };

struct AttentionOptions {
  bool causal = false;
  int32_t window_left = -1;   // -1: unbounded
  int32_t window_right = -1;  // -1: unbounded
  float logits_soft_cap = 0.0f;
  float sm_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  // Dequantisation scales for an fp8 KV cache (per tensor). Ignored for fp16/bf16 K/V.
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  // Width of v and o rows when it differs from head_dim (the q/k width); 0: head_dim. A multiple
  // of 8 in [8, 512]. The CPU backend serves every pair; the CUDA backend only the equal case
  // (another pair is Error(kUnsupported) naming head_dim_vo at plan time).
  int32_t head_dim_vo = 0;
};

// A paged KV cache with a CSR page table.
//  k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim] (NHD)
//                 or [num_pages, num_kv_heads, page_size, head_dim] (HND);
//                 v_cache's last dimension is head_dim_vo.
//  page_indptr [B+1] int32, page_indices [page_indptr[B]] int32,
//  last_page_len [B] int32 in [1, page_size] for a request with pages (ignored otherwise).
//  kv_len of request b = (pages_b - 1) * page_size + last_page_len[b], 0 if it has no page.
struct PagedKVCache {
  TensorView k_cache;
  TensorView v_cache;
  KVLayout layout = KVLayout::kNHD;
  TensorView page_indptr;
  TensorView page_indices;
  TensorView last_page_len;
};

enum class AttentionOp : int32_t { kRaggedPrefill = 0, kPagedPrefill = 1, kDecode = 2 };
const char* op_name(AttentionOp op);

// One unit of work: query rows [q_start, q_start + q_len) of `request` for every query head of
// kv head `kv_head`'s group, against keys [kv_start, kv_end) of that request. When the key range
// of a (request, kv_head, q tile) is split, each piece writes a float32 partial (o, lse) at row
// `partial_row` of the workspace and the MergeItem at index `merge_index` of Plan::merges
// combines them (the CUDA decode kernels merge through that index: a hand-built plan must set
// it); otherwise partial_row = merge_index = -1.
struct WorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t q_start;
  int32_t q_len;
  int32_t kv_start;
  int32_t kv_end;
  int32_t partial_row;
  int32_t merge_index = -1;
};

// Combines `num_splits` partials of a (request, kv_head, q tile) into the output. The partial
// rows of split s start at first_partial_row + s * q_len * group_size.
struct MergeItem {
  int32_t request;
  int32_t kv_head;
  int32_t q_start;
  int32_t q_len;
  int32_t first_partial_row;
  int32_t num_splits;
};

// Knobs a backend hands the planner (dispatch fills them per device; tests set them directly).
struct PlanConfig {
  int32_t q_tile_rows = 64;   // packed rows (tokens x group heads) per work item, at most
  int32_t num_workers = 1;    // persistent CTAs (GPU) or threads (CPU)
  bool split_kv = true;       // allow splitting long key ranges across workers
  int32_t min_kv_chunk = 256; // never split a key range into pieces shorter than this
  bool deterministic = false; // fixed split sizes, independent of the batch composition
  // The fixed piece size in deterministic mode, when larger pieces than min_kv_chunk are wanted
  // there (0: min_kv_chunk). Deterministic plans cut every long range into such pieces, so
  // their count, and a graph capacity's workspace, scale with kv_len / this.
  int32_t deterministic_kv_chunk = 0;
  // CUDA decode: the built-in default's batch rule chose the small-CTA kernel variant for this
  // batch (enough (request, kv head) tiles; decided at plan time, never for plans with a fixed
  // capacity).
  bool heavy_batch = false;
  // CUDA decode: the kernel variant (core/tuning.hpp) num_workers was sized for, resolved for
  // bf16 K/V (-1: not a CUDA decode plan). run() launches it unless the K/V dtype's own variant
  // keeps the same number of resident CTAs per SM.
  int32_t decode_variant = -1;
};

// Planning knobs that are not attention maths (so not AttentionOptions): the fixed capacity a
// plan must fit, for CUDA graphs, and the deterministic split mode.
//
// Capacity (max_work_items > 0): the workspace layout is fixed by these maxima instead of by
// the plan's actual sizes, so every plan made with the same PlanCapacity (and the same shape:
// op, device, heads, head_dim, page size, options, q_per_request) needs the same
// workspace_bytes and places its lists at the same offsets. plan_* throws
// tessera::Error(kInvalidArgument) when the plan does not fit. With a fixed capacity,
// max_merges == 0 or max_partial_rows == 0 turns split-KV off. plan_capacity() gives bounds that
// every batch up to a size fits. Graph use (see upload_plan):
//   1. size every device buffer for the largest batch (q, o, lse, indptr arrays, page table);
//   2. plan the largest batch with a capacity, upload_plan(), capture run_*() on a stream with
//      views of the full buffers (the captured launches keep those pointers and strides);
//   3. per step: write the batch's indices / q into the same buffers, plan with the same
//      capacity, upload_plan() on the stream (outside the graph), launch the graph.
//   Rows of requests beyond the current batch are neither read nor written. What the graph
//   keeps from capture time, and so must not change between its plans: the tensors (pointers,
//   strides, dtypes, lse present or not), options, heads, head_dim, page size, q_per_request
//   (decode) and the capacity. The index arrays the kernels read (qo/kv/page indptr,
//   last_page_len, page_indices) are read only for requests < the current batch size, so
//   buffers sized for the largest batch serve every smaller one.
//
// deterministic: split-KV cuts key ranges at fixed absolute positions (multiples of the
// backend's minimum chunk), so a query row's arithmetic, and so its bits, never depend on the
// rest of the batch. Costs some balance on skewed batches.
struct PlanCapacity {
  int32_t max_work_items = 0;    // 0: no fixed capacity (layout sized by the plan itself)
  int32_t max_merges = 0;
  int64_t max_partial_rows = 0;  // float32 (o, lse) rows of split-KV partials
  bool deterministic = false;

  bool fixed() const { return max_work_items > 0; }
};

// The plan of one batch: backend-neutral, built on the host from host lengths. Kernels walk
// `work` in the order of `worker_indptr` (worker w runs work[worker_indptr[w] .. [w+1])).
struct Plan {
  AttentionOp op = AttentionOp::kRaggedPrefill;
  Device device{};
  int32_t batch_size = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;    // q / k width
  int32_t page_size = 0;  // paged ops only
  AttentionOptions options{};  // options.head_dim_vo: resolved (never 0)
  PlanConfig config{};
  int64_t total_q = 0;
  std::vector<int32_t> q_lens;   // per request
  std::vector<int32_t> kv_lens;  // per request
  std::vector<WorkItem> work;
  std::vector<int32_t> worker_indptr;  // [num_workers + 1]
  std::vector<MergeItem> merges;
  int64_t num_partial_rows = 0;
  size_t workspace_bytes = 0;  // what run() needs from the caller
  PlanCapacity capacity{};     // as passed to plan_*
  double max_worker_cost = 0;  // cost model units (see planner.hpp)
  double total_cost = 0;
  // The kernel chosen once, at plan time: a row of the CUDA backend's kernel registry (-1 on
  // the CPU, or for a plan built by hand: run() then chooses by the same rule), that backend's
  // launch options for it, and which row and why (printed by explain()).
  int32_t kernel_id = -1;
  uint32_t kernel_options = 0;
  std::string kernel;

  // Set by upload_plan(): the workspace the lists were copied into and the upload's (process
  // wide, never 0) generation. run_*() with that workspace skips its own upload while no later
  // upload or run of another plan has overwritten it; otherwise it uploads the lists itself.
  const void* uploaded_workspace = nullptr;
  uint64_t upload_generation = 0;

  int32_t group_size() const { return num_qo_heads / num_kv_heads; }
  // Width of v and o rows (options.head_dim_vo, or head_dim for a plan built by hand without it).
  int32_t head_dim_v() const { return options.head_dim_vo > 0 ? options.head_dim_vo : head_dim; }
  // Human-readable description of the partition (`tessera plan --explain`).
  std::string explain() const;
};

// Caller-owned scratch memory on the plan's device.
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// ---- plan (host lengths in, Plan out; pure, deterministic) ----
Plan plan_ragged_prefill(std::span<const int32_t> qo_indptr, std::span<const int32_t> kv_indptr,
                         int num_qo_heads, int num_kv_heads, int head_dim,
                         const AttentionOptions& options, Device device = {},
                         const PlanCapacity& capacity = {});
Plan plan_paged_prefill(std::span<const int32_t> qo_indptr, std::span<const int32_t> page_indptr,
                        std::span<const int32_t> last_page_len, int page_size, int num_qo_heads,
                        int num_kv_heads, int head_dim, const AttentionOptions& options,
                        Device device = {}, const PlanCapacity& capacity = {});
// Decode: q_per_request query tokens per request (1, or a few for speculative decoding).
Plan plan_decode(std::span<const int32_t> page_indptr, std::span<const int32_t> last_page_len,
                 int page_size, int num_qo_heads, int num_kv_heads, int head_dim,
                 const AttentionOptions& options, Device device = {}, int q_per_request = 1,
                 const PlanCapacity& capacity = {});

// Capacity that every plan of `op` fits whose batch has at most max_batch requests, at most
// max_total_q query tokens in all (decode: max_batch x q_per_request) and at most max_kv_len keys
// per request, for these heads on `device` (an upper bound from the planner's rules: it may
// overestimate, never underestimate; saturated at 2^31 - 1 work items, merges and partial rows,
// the most a plan may have). max_total_q <= 2^31 - 1. `deterministic` is copied into the result.
PlanCapacity plan_capacity(AttentionOp op, int max_batch, int64_t max_total_q, int max_kv_len,
                           int num_qo_heads, int num_kv_heads, int head_dim, Device device = {},
                           bool deterministic = false);

// ---- upload (GPU plans: the plan's work list into the workspace) ----
// Copies the plan's lists (work items, worker ranges, merges) and a small header (their counts,
// the partial row count) into `workspace` with one cudaMemcpyAsync on `stream` from a pinned
// staging buffer (a per-device pool; a buffer is reused only once its copy has completed), and
// returns without synchronising. Records the upload in the plan, so run_*() with this workspace
// does not upload again. Needed for CUDA graphs: the kernels read every per-plan count from the
// workspace, so a graph captured around run_*() replays any plan with the same capacity that
// was uploaded into the same workspace before the replay. Must not be called while `stream`
// is being captured. CPU plans: no-op. The workspace must be at least plan.workspace_bytes.
// Uploads are tracked per workspace address: after freeing a workspace and allocating another
// at the same address, upload again before running an already-uploaded plan with it, or call
// forget_uploads.
void upload_plan(Plan& plan, Workspace workspace, void* stream = nullptr);
// The memory at `workspace` no longer holds what upload_plan put there (it was freed, handed out
// again, or written by something else): the next run_*() of any plan with it uploads the lists
// itself (inside a CUDA-graph capture: records their copies from the plan's host memory).
// Host-only and cheap; a no-op without the CUDA backend.
void forget_uploads(const void* workspace);

// Per-call options of run_*() and the one-shot calls that are tensors rather than attention
// maths fixed at plan time (more per-call options may join this struct later; every field's
// default is "off").
//  * sinks: optional attention sinks (see the semantics above), float32 [num_qo_heads],
//    contiguous, on the plan's device; an empty view (the default) is none. Like q, the pointer
//    is captured into a CUDA graph: a graph captured with sinks reads that buffer at every
//    replay (write new values into it, never pass another one), and one captured without sinks
//    never folds any.
//  * custom_mask + mask_indptr: an optional custom mask for prefill (ragged and paged; FlashInfer's
//    packed_custom_mask and mask_indptr). custom_mask: uint8 [bytes], 1-D, contiguous, a bit
//    string packed little-endian (bit b is bit b % 8 of byte b / 8: numpy.packbits(...,
//    bitorder="little"), tessera.packbits / segment_packbits in Python). mask_indptr: int32
//    [batch_size + 1], contiguous: request r's bits start at byte mask_indptr[r], and bit
//    (i * kv_len_r + j) of them is 1 when query row i of r (0-based within the request) may see
//    key j (0-based within the request's keys). mask_indptr must be non-decreasing from a first
//    value >= 0, give each request at least ceil(q_len_r * kv_len_r / 8) bytes
//    (mask_indptr[r+1] - mask_indptr[r]) and end within custom_mask (mask_indptr[batch_size] <=
//    its length); bits past q_len_r * kv_len_r in a segment are ignored. The mask ANDs with the
//    plan's causal and window masks (a key is seen only where both allow it), and combines with
//    soft-cap, GQA (every query head of a row shares its bits), split-KV and sinks (a row that
//    the mask leaves without keys gives o = 0 and lse = -inf, or lse = z_h with a sink, which
//    still joins every row's denominator). Both or neither must be given; decode rejects them
//    (use tree_mask).
//  * tree_mask: an optional tree mask for decode with q_per_request query rows per request
//    (speculative decoding: each request's draft tokens form a tree). uint8 [batch_size,
//    bytes_per_request] with bytes_per_request >= ceil(q_per_request^2 / 8) and a contiguous last
//    dim (any row stride, 0 included: one tree for every request); row r is a bit string packed
//    little-endian as above. The draft keys of request r are its last q_per_request keys (draft
//    d is key kv_len_r - q_per_request + d: the keys of the draft tokens themselves, appended to
//    the cache before the call); the keys before them are its prefix. Draft token i (query row
//    i of r, 0-based) sees every prefix key and draft key d iff bit (i * q_per_request + d) of
//    row r is set (set bit i * q_per_request + i for a token to see itself). The tree takes the
//    place of the causal relation among the drafts: plan the decode with causal = false and the
//    tree alone decides which drafts each draft sees. Like custom_mask it ANDs with the plan's
//    masks, so a causal plan keeps only the tree's bits at or below the diagonal (a draft sees
//    no later draft: the topological order of the usual draft trees, where that changes
//    nothing), and a window still cuts old prefix keys. A chain (bit (i, d) for d <= i) is plain
//    causal decode. Prefill rejects it (use custom_mask).
//  Mask tensors are read on the host while the call runs; for now only CPU plans take them (a
//  CUDA plan throws Error(kUnsupported) naming the field before anything runs). Every mask
//  check happens before anything is written: an error names the field
//  ('run_options.custom_mask', 'run_options.mask_indptr', 'run_options.tree_mask') and what was
//  expected. Checked mode still scans the keys of each row's causal / window range (a mask
//  narrows what a row attends to, not what is scanned).
//  * enable_pdl: programmatic dependent launch (FlashInfer's enable_pdl; sm_90+ CUDA only,
//    ignored elsewhere). The attention kernel may start while the previous kernel in the stream
//    is still running (its launch and set-up overlap that kernel's tail) and waits for it
//    (griddepcontrol.wait) before it reads or writes any tensor; it lets the next
//    programmatically launched kernel start the same way. Works inside CUDA graphs.
struct RunOptions {
  TensorView sinks;
  bool enable_pdl = false;
  // Initialised here so that RunOptions{sinks} stays warning-free (-Wmissing-field-initializers).
  TensorView custom_mask = {};  // prefill: uint8 bit-packed, with mask_indptr
  TensorView mask_indptr = {};  // int32 [batch_size + 1]: byte offset of each request's bits
  TensorView tree_mask = {};    // decode: uint8 [batch_size, >= ceil(q_per_request^2 / 8)]
};

// ---- run (never allocates, never synchronises the host on GPU) ----
// `stream` is a cudaStream_t for CUDA tensors and ignored on the CPU. A GPU plan not uploaded
// into `workspace` by upload_plan() is uploaded by run itself, from the plan's pageable vectors
// (as before upload_plan existed: a graph captured that way replays only that plan, and the plan
// must outlive the graph). For an uploaded plan run only launches; the launch shapes then depend
// only on the device, the shape and the capacity, and every per-plan count is read from the
// workspace, so a captured graph replays whichever plan of that capacity was uploaded last.
void run_ragged_prefill(const Plan& plan, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& qo_indptr,
                        const TensorView& kv_indptr, const TensorView& o, const TensorView& lse,
                        Workspace workspace, void* stream = nullptr,
                        const RunOptions& run_options = {});
void run_paged_prefill(const Plan& plan, const TensorView& q, const PagedKVCache& kv,
                       const TensorView& qo_indptr, const TensorView& o, const TensorView& lse,
                       Workspace workspace, void* stream = nullptr,
                       const RunOptions& run_options = {});
// q: [batch * q_per_request, num_qo_heads, head_dim].
void run_decode(const Plan& plan, const TensorView& q, const PagedKVCache& kv,
                const TensorView& o, const TensorView& lse, Workspace workspace,
                void* stream = nullptr, const RunOptions& run_options = {});

// ---- one-shot calls (plan + run with an internal workspace; indptr arrays read on the host,
// so for CUDA tensors these synchronise: use plan/run on a serving hot path) ----
// On a CUDA stream being captured into a graph they throw Error(kInvalidArgument) naming
// 'stream' before any CUDA call (the capture stays valid); when their workspace cannot be
// allocated, Error(kOutOfMemory) naming 'workspace' and its bytes. Nothing is written then.
void ragged_prefill(const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& qo_indptr, const TensorView& kv_indptr, const TensorView& o,
                    const TensorView& lse = {}, const AttentionOptions& options = {},
                    void* stream = nullptr, const RunOptions& run_options = {});
void paged_prefill(const TensorView& q, const PagedKVCache& kv, const TensorView& qo_indptr,
                   const TensorView& o, const TensorView& lse = {},
                   const AttentionOptions& options = {}, void* stream = nullptr,
                   const RunOptions& run_options = {});
void decode(const TensorView& q, const PagedKVCache& kv, const TensorView& o,
            const TensorView& lse = {}, const AttentionOptions& options = {},
            void* stream = nullptr, const RunOptions& run_options = {});

}  // namespace tessera
