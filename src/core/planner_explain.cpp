// Plan::explain: a plan described for people (`tessera plan --explain`, test failures).
#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include "tessera/attention.hpp"

namespace tessera {

std::string Plan::explain() const {
  std::ostringstream out;
  const int32_t group = num_kv_heads > 0 ? num_qo_heads / num_kv_heads : 0;
  int64_t total_kv = 0;
  for (int32_t len : kv_lens) total_kv += len;
  out << "plan: " << op_name(op) << " on " << device_name(device) << "\n"
      << "  batch " << batch_size << ", query tokens " << total_q << ", kv tokens " << total_kv
      << ", heads " << num_qo_heads << " qo / " << num_kv_heads << " kv (group " << group
      << "), head_dim " << head_dim;
  if (head_dim_v() != head_dim) out << ", head_dim_vo " << head_dim_v();
  if (page_size > 0) out << ", page_size " << page_size;
  out << "\n  mask: " << (options.causal ? "causal" : "full") << ", window ("
      << options.window_left << ", " << options.window_right << "), soft-cap "
      << options.logits_soft_cap << "\n";
  if (!kernel.empty()) out << "  kernel: " << kernel << "\n";
  out << "  tiling: " << config.q_tile_rows << " packed rows per tile ("
      << std::max(1, config.q_tile_rows / std::max(1, group)) << " tokens x " << group
      << " heads), " << config.num_workers << " workers, split-KV "
      << (config.split_kv ? "on" : "off") << " (min chunk " << config.min_kv_chunk << " keys"
      << (config.deterministic ? ", deterministic fixed chunks" : "") << ")\n";
  int64_t split_pieces = 0;
  for (const MergeItem& m : merges) split_pieces += m.num_splits;
  out << "  work items " << work.size() << " (" << merges.size() << " tiles split into "
      << split_pieces << " pieces), partial rows " << num_partial_rows << ", workspace "
      << workspace_bytes << " bytes\n";
  if (capacity.fixed()) {
    out << "  fixed capacity: " << capacity.max_work_items << " work items, "
        << capacity.max_merges << " merges, " << capacity.max_partial_rows << " partial rows\n";
  }
  const int32_t workers = static_cast<int32_t>(worker_indptr.size()) - 1;
  int32_t busy = 0;
  for (int32_t w = 0; w < workers; ++w) busy += worker_indptr[w + 1] > worker_indptr[w];
  const double mean = workers > 0 ? total_cost / workers : 0.0;
  out << "  cost: total " << total_cost << ", busiest worker " << max_worker_cost << ", mean "
      << mean << ", imbalance (max/mean) " << (mean > 0 ? max_worker_cost / mean : 1.0) << ", "
      << busy << "/" << workers << " workers busy\n";
  const size_t shown = std::min<size_t>(work.size(), 16);
  for (int32_t w = 0, printed = 0; w < workers && printed < static_cast<int32_t>(shown); ++w) {
    for (int32_t i = worker_indptr[w]; i < worker_indptr[w + 1] && printed < 16; ++i, ++printed) {
      const WorkItem& item = work[i];
      out << "    worker " << w << ": request " << item.request << " kv_head " << item.kv_head
          << " q [" << item.q_start << ", " << item.q_start + item.q_len << ") kv ["
          << item.kv_start << ", " << item.kv_end << ")";
      if (item.partial_row >= 0) out << " -> partial row " << item.partial_row;
      out << "\n";
    }
  }
  if (work.size() > shown) out << "    ... " << work.size() - shown << " more items\n";
  return out.str();
}

}  // namespace tessera
