#include "cli/plan.hpp"

#include <iostream>
#include <sstream>
#include <vector>

#include "cli/bench.hpp"

namespace tessera::cli {
namespace {

std::vector<int32_t> parse_lengths(const std::string& text, const char* flag) {
  std::vector<int32_t> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    // "4x512" repeats 512 four times.
    const size_t x = item.find('x');
    try {
      if (x == std::string::npos) {
        values.push_back(std::stoi(item));
      } else {
        const int count = std::stoi(item.substr(0, x));
        values.insert(values.end(), count, std::stoi(item.substr(x + 1)));
      }
    } catch (const std::exception&) {
      throw Error(Error::Kind::kInvalidArgument,
                  std::string(flag) + ": expected comma-separated lengths like 4x512,16384, got '" +
                      text + "'");
    }
  }
  return values;
}

std::vector<int32_t> indptr_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> indptr(1, 0);
  for (int32_t len : lengths) indptr.push_back(indptr.back() + len);
  return indptr;
}

}  // namespace

int run_plan(const PlanOptions& o) {
  const Device device = resolve_backend(o.backend);
  AttentionOptions attention = o.attention;
  attention.causal = o.causal;
  std::vector<int32_t> q_lens = parse_lengths(o.q_lens, "--q-lens");
  const std::vector<int32_t> kv_lens =
      o.kv_lens.empty() ? q_lens : parse_lengths(o.kv_lens, "--kv-lens");
  if (kv_lens.empty()) {
    throw Error(Error::Kind::kInvalidArgument, "--q-lens / --kv-lens: expected lengths");
  }
  if (o.op == "decode") q_lens.assign(kv_lens.size(), q_lens.empty() ? 1 : q_lens[0]);
  if (kv_lens.size() != q_lens.size()) {
    throw Error(Error::Kind::kInvalidArgument, "--kv-lens: expected as many lengths as --q-lens (" +
                                                   std::to_string(q_lens.size()) + "), got " +
                                                   std::to_string(kv_lens.size()));
  }
  Plan plan;
  if (o.op == "prefill") {
    plan = plan_ragged_prefill(indptr_of(q_lens), indptr_of(kv_lens), o.num_qo_heads,
                               o.num_kv_heads, o.head_dim, attention, device);
  } else if (o.op == "paged" || o.op == "decode") {
    std::vector<int32_t> pages, last;
    for (int32_t len : kv_lens) {
      const int32_t count = (len + o.page_size - 1) / o.page_size;
      pages.push_back(count);
      last.push_back(count ? len - (count - 1) * o.page_size : 0);
    }
    if (o.op == "paged") {
      plan = plan_paged_prefill(indptr_of(q_lens), indptr_of(pages), last, o.page_size,
                                o.num_qo_heads, o.num_kv_heads, o.head_dim, attention, device);
    } else {
      plan = plan_decode(indptr_of(pages), last, o.page_size, o.num_qo_heads, o.num_kv_heads,
                         o.head_dim, attention, device, q_lens.empty() ? 1 : q_lens[0]);
    }
  } else {
    throw Error(Error::Kind::kInvalidArgument,
                "--op: expected prefill, paged or decode, got '" + o.op + "'");
  }
  std::cout << plan.explain();
  return 0;
}

}  // namespace tessera::cli
