// The cases of `tessera bench --suite quick|standard|serving` per device, and the backend choice.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cli/bench.hpp"
#include "cli/bench_internal.hpp"
#include "core/settings.hpp"
#include "tessera/backend.hpp"

namespace tessera::cli {

BenchCase prefill_case(int head_dim, int seq, bool causal, int tokens, int hidden) {
  BenchCase c;
  c.op = AttentionOp::kRaggedPrefill;
  c.batch = std::max(1, tokens / seq);
  c.q_len = c.kv_len = seq;
  c.num_qo_heads = c.num_kv_heads = hidden / head_dim;
  c.head_dim = head_dim;
  c.causal = causal;
  c.name = "prefill d" + std::to_string(head_dim) + (causal ? " causal" : "") + " " +
           std::to_string(c.batch) + "x" + std::to_string(seq) + " h" +
           std::to_string(c.num_qo_heads);
  return c;
}

// The decode cases of the standard CUDA suite (GQA 32/8, d128, page 16; `--suite roofline` reads
// the same shapes): batch x kv_len from one request to 256, and a skewed batch of one long
// request beside many short ones.
std::vector<BenchCase> decode_suite_cases() {
  std::vector<BenchCase> cases;
  for (auto [batch, len] : {std::pair{1, 1024},
                            {1, 32768},
                            {16, 4096},
                            {16, 32768},
                            {64, 4096},
                            {64, 32768},
                            {256, 16384}}) {
    cases.push_back(gqa_case(AttentionOp::kDecode, batch, 1, len, false, 16));
  }
  BenchCase skewed = gqa_case(AttentionOp::kDecode, 256, 1, 512, false, 16);
  skewed.first_kv_len = 32768;
  skewed.name = "decode gqa32/8 d128 p16 skewed 1x32k+255x512";
  cases.push_back(skewed);
  return cases;
}

BenchCase gqa_case(AttentionOp op, int batch, int q_len, int kv_len, bool causal, int page) {
  BenchCase c;
  c.op = op;
  c.batch = batch;
  c.q_len = q_len;
  c.kv_len = kv_len;
  c.num_qo_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.page_size = page;
  c.causal = causal;
  const std::string shape = std::to_string(batch) + "x" + std::to_string(kv_len);
  if (op == AttentionOp::kDecode) {
    c.name = "decode gqa32/8 d128 p" + std::to_string(page) + " " + shape;
  } else {
    c.name = std::string(op == AttentionOp::kPagedPrefill
                             ? "paged prefill p" + std::to_string(page) + " "
                             : "prefill ") +
             "gqa32/8 d128" + (causal ? " causal " : " ") + shape;
  }
  return c;
}

namespace {

// TESSERA_BENCH_SEQS=4096,6000,8192,...: comma-separated lengths in 1..1048576.
std::vector<int> bench_seqs(const std::string& text) {
  std::vector<int> seqs;
  for (const char* at = text.c_str(); *at != '\0';) {
    char* end = nullptr;
    const long value = std::strtol(at, &end, 10);
    if (end == at || value < 1 || value > (1 << 20)) {
      throw Error(
          Error::Kind::kInvalidArgument,
          "TESSERA_BENCH_SEQS: expected comma-separated lengths in 1..1048576, got '" + text + "'");
    }
    if (*end != ',' && *end != '\0') {
      throw Error(Error::Kind::kInvalidArgument,
                  "TESSERA_BENCH_SEQS: expected comma-separated lengths, got '" + text + "'");
    }
    seqs.push_back(static_cast<int>(value));
    at = *end == ',' ? end + 1 : end;
  }
  return seqs;
}

}  // namespace

Device resolve_backend(const std::string& requested, bool* reference) {
  // TESSERA_BACKEND picks the backend when the command line leaves it at auto.
  const std::string& env = detail::settings().backend;
  const std::string backend = requested == "auto" && !env.empty() ? env : requested;
  if (reference) *reference = backend == "cpu-reference";
  if (backend == "cpu" || backend == "cpu-reference") return Device{DeviceType::kCPU, 0};
  if (backend == "cuda") return Device{DeviceType::kCUDA, 0};
  if (backend != "auto") {
    throw Error(Error::Kind::kInvalidArgument,
                "--backend / TESSERA_BACKEND: expected auto, cpu, cpu-reference or cuda, got '" +
                    backend + "'");
  }
  return cuda_available() ? Device{DeviceType::kCUDA, 0} : Device{DeviceType::kCPU, 0};
}

namespace {

// Decode of `batch` x 4096 keys, d128, page 16, with qo_heads / kv_heads query / kv heads.
BenchCase group_decode_case(int qo_heads, int kv_heads, int batch) {
  BenchCase c = gqa_case(AttentionOp::kDecode, batch, 1, 4096, false, 16);
  c.num_qo_heads = qo_heads;
  c.num_kv_heads = kv_heads;
  c.name = "decode gqa" + std::to_string(qo_heads) + "/" + std::to_string(kv_heads) + " d128 p16 " +
           std::to_string(batch) + "x4096";
  return c;
}

// A mixed batch in one plan (issue 5): 4 requests prefilling 2048 tokens beside 252 decoding
// one token, all over 2048 cached keys (paged prefill with ragged q lengths).
BenchCase mixed_step_case() {
  BenchCase c = gqa_case(AttentionOp::kPagedPrefill, 256, 1, 2048, true, 16);
  c.first_q_len = 2048;
  c.first_count = 4;
  c.name = "prefill gqa32/8 d128 p16 causal mixed 4x2048+252x1";
  return c;
}

}  // namespace

// `--suite serving` (issue 33): the shapes a serving engine spends its steps on, on the GPU.
//  * decode, GQA 32/8 d128 p16, batch 1 / 16 / 64 x 1k / 4k / 32k keys, and 256 x 16k (the
//    read-ceiling case); page sizes 1 and 128 and GQA ratios 1 and 16 at 16 x 4k;
//  * short prefill, B x S = 16k tokens at S = 512, 1024, 2048, d64 / 128 / 256 (H x D = 2048),
//    causal and not;
//  * chunked prefill: 8 requests, each a 512-token chunk (causal, bottom-right) on a paged
//    prefix of 2k / 8k / 32k keys, page 16;
//  * the mixed step of the standard suite (4 x 2048 prefill rows beside 252 decode rows);
//  * 64 decode requests sharing a 16k prefix, plain and as a cascade, and the cascade's two
//    levels as their own cases;
//  * decode 1 x 1k replayed from a CUDA graph, with and without PDL.
// Decode of `batch` requests that share a `prefix`-key prefix, each with `own` keys after it:
// plain decode over every request's full page list, or cascade attention (issue 34 item 7).
BenchCase shared_prefix_case(int batch, int prefix, int own, bool cascade) {
  BenchCase c = gqa_case(AttentionOp::kDecode, batch, 1, prefix + own, false, 16);
  c.shared_prefix = prefix;
  c.cascade = cascade;
  c.name = "decode gqa32/8 d128 p16 " + std::to_string(batch) + "x(" +
           std::to_string(prefix / 1024) + "k shared+" + std::to_string(own) + ")" +
           (cascade ? " cascade" : " plain");
  return c;
}

std::vector<BenchCase> serving_cases() {
  std::vector<BenchCase> cases;
  for (int batch : {1, 16, 64}) {
    for (int len : {1024, 4096, 32768}) {
      cases.push_back(gqa_case(AttentionOp::kDecode, batch, 1, len, false, 16));
    }
  }
  cases.push_back(gqa_case(AttentionOp::kDecode, 256, 1, 16384, false, 16));
  for (int page : {1, 128})
    cases.push_back(gqa_case(AttentionOp::kDecode, 16, 1, 4096, false, page));
  for (auto [qo_heads, kv_heads] : {std::pair{32, 32}, {64, 4}}) {
    cases.push_back(group_decode_case(qo_heads, kv_heads, 16));
  }
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (int seq : {512, 1024, 2048}) cases.push_back(prefill_case(d, seq, causal, 16384, 2048));
    }
  }
  for (int prefix : {2048, 8192, 32768}) {
    BenchCase chunk = gqa_case(AttentionOp::kPagedPrefill, 8, 512, prefix + 512, true, 16);
    chunk.name = "chunked prefill gqa32/8 d128 p16 8x512 on " + std::to_string(prefix / 1024) + "k";
    cases.push_back(chunk);
  }
  cases.push_back(mixed_step_case());
  for (bool cascade : {false, true}) cases.push_back(shared_prefix_case(64, 16384, 512, cascade));
  // The cascade's two levels alone (where its time goes): the 64 requests' query rows as one
  // request over the 16k prefix, and plain decode of their own 512 keys.
  BenchCase level0 = gqa_case(AttentionOp::kPagedPrefill, 1, 64, 16384, false, 16);
  level0.name = "cascade level 0: prefill gqa32/8 d128 p16 1x64 on 16k";
  cases.push_back(level0);
  BenchCase level1 = gqa_case(AttentionOp::kDecode, 64, 1, 512, false, 16);
  level1.name = "cascade level 1: decode gqa32/8 d128 p16 64x512";
  cases.push_back(level1);
  for (bool pdl : {false, true}) {
    BenchCase graph = gqa_case(AttentionOp::kDecode, 1, 1, 1024, false, 16);
    graph.graph = true;
    graph.pdl = pdl;
    graph.name += pdl ? " (graph, pdl)" : " (graph)";
    cases.push_back(graph);
  }
  return cases;
}

std::vector<BenchCase> bench_suite(const std::string& suite, Device device) {
  std::vector<BenchCase> cases;
  const bool quick = suite == "quick";
  if (suite != "quick" && suite != "standard" && suite != "serving") {
    throw Error(Error::Kind::kInvalidArgument,
                "--suite: expected quick, standard, serving, plan, overhead or roofline, got '" +
                    suite + "'");
  }
  if (suite == "serving") {
    if (device.type != DeviceType::kCUDA) {
      throw Error(Error::Kind::kInvalidArgument,
                  "--suite serving: needs a CUDA device (its shapes take minutes on a CPU); "
                  "use --suite quick or standard here");
    }
    return serving_cases();
  }
  if (device.type == DeviceType::kCUDA) {
    // The grid of ANCHORS.md: B x S = 16k tokens, H x D = 2048.
    std::vector<int> seqs = quick ? std::vector<int>{4096} : std::vector<int>{512, 4096, 16384};
    // TESSERA_BENCH_SEQS=4096,6000,8192,...: the grid's sequence lengths instead (batch =
    // 16384 / length requests, at least one), to time the kernel choice between lengths (the
    // wide-tile rule) without a separate suite.
    if (!detail::settings().bench_seqs.empty()) seqs = bench_seqs(detail::settings().bench_seqs);
    const std::vector<int> dims = quick ? std::vector<int>{128} : std::vector<int>{64, 128, 256};
    for (int d : dims) {
      for (bool causal : {false, true}) {
        for (int s : seqs) cases.push_back(prefill_case(d, s, causal, 16384, 2048));
      }
    }
    cases.push_back(gqa_case(AttentionOp::kRaggedPrefill, 4, 4096, 4096, true, 0));
    if (!quick) cases.push_back(gqa_case(AttentionOp::kRaggedPrefill, 1, 16384, 16384, true, 0));
    for (int page : quick ? std::vector<int>{16} : std::vector<int>{16, 64}) {
      cases.push_back(gqa_case(AttentionOp::kPagedPrefill, 4, 4096, 4096, true, page));
    }
    if (quick) {
      cases.push_back(gqa_case(AttentionOp::kDecode, 64, 1, 4096, false, 16));
    } else {
      // Decode of every batch shape, then a skewed batch (issue 5).
      for (const BenchCase& c : decode_suite_cases()) cases.push_back(c);
      // Decode on the CUDA-core kernel (head_dim 256 has no tensor-core rows).
      BenchCase d256 = gqa_case(AttentionOp::kDecode, 16, 1, 4096, false, 16);
      d256.head_dim = 256;
      d256.num_qo_heads = 16;
      d256.num_kv_heads = 4;
      d256.name = "decode gqa16/4 d256 p16 16x4096";
      cases.push_back(d256);
      // Wide groups (issue 39): 12:1, 16:1, 32:1 and 128:1 on the tensor-core row-tile rows.
      for (auto [qo_heads, kv_heads, batch] : {std::tuple{96, 8, 16},
                                               {96, 8, 64},
                                               {64, 4, 64},
                                               {32, 1, 1},
                                               {32, 1, 16},
                                               {32, 1, 64},
                                               {128, 1, 16},
                                               {128, 1, 64}}) {
        cases.push_back(group_decode_case(qo_heads, kv_heads, batch));
      }
      BenchCase skewed_prefill = gqa_case(AttentionOp::kRaggedPrefill, 64, 256, 256, true, 0);
      skewed_prefill.first_q_len = skewed_prefill.first_kv_len = 16384;
      skewed_prefill.name = "prefill gqa32/8 d128 causal skewed 1x16k+63x256";
      cases.push_back(skewed_prefill);
      BenchCase uniform_prefill = gqa_case(AttentionOp::kRaggedPrefill, 64, 2048, 2048, true, 0);
      uniform_prefill.name = "prefill gqa32/8 d128 causal uniform 64x2048";  // ~ equal work
      cases.push_back(uniform_prefill);
      cases.push_back(mixed_step_case());
      // Checked mode (issue 7): the same decode with index validation on.
      BenchCase checked = gqa_case(AttentionOp::kDecode, 64, 1, 4096, false, 16);
      checked.checked = true;
      checked.name += " (checked)";
      cases.push_back(checked);
      // Latency of one decode step replayed from a CUDA graph (issue 5: 1 x 1k <= 8 us).
      BenchCase graph = gqa_case(AttentionOp::kDecode, 1, 1, 1024, false, 16);
      graph.graph = true;
      graph.name += " (graph)";
      cases.push_back(graph);
    }
    return cases;
  }
  // CPU: the foundation's target shape first (D=128, S=2048, 8 heads), then the rest scaled to
  // what two to a few dozen cores finish in seconds.
  const int s = quick ? 512 : 2048;
  cases.push_back(prefill_case(128, s, false, s, 128 * 8));
  cases.push_back(prefill_case(128, s, true, s, 128 * 8));
  // The same prefill under a custom mask of random 64 x 64 blocks, half of them visible (issue
  // 34 item 4; CPU only: the CUDA backend rejects masks, so its suites have no such case).
  BenchCase masked = prefill_case(128, s, false, s, 128 * 8);
  masked.mask_block = 64;
  masked.name = "prefill d128 custom mask 50% block64 1x" + std::to_string(s);
  cases.push_back(masked);
  if (!quick) {
    cases.push_back(prefill_case(64, 2048, false, 2048, 64 * 8));
    cases.push_back(prefill_case(256, 1024, false, 1024, 256 * 4));
  }
  cases.push_back(gqa_case(AttentionOp::kRaggedPrefill, 1, s / 2, s / 2, true, 0));
  cases.push_back(gqa_case(AttentionOp::kPagedPrefill, 1, s / 2, s / 2, true, 16));
  cases.push_back(gqa_case(AttentionOp::kDecode, 8, 1, quick ? 1024 : 4096, false, 16));
  if (!quick) {
    cases.push_back(gqa_case(AttentionOp::kDecode, 1, 1, 32768, false, 16));
    for (bool cascade : {false, true}) cases.push_back(shared_prefix_case(16, 4096, 256, cascade));
  }
  // MLA decode at DeepSeek's widths (issue 37; CPU only: the CUDA backend refuses MLA, so its
  // suites have no such case).
  BenchCase mla;
  mla.op = AttentionOp::kDecode;
  mla.mla = true;
  mla.batch = 8;
  mla.q_len = 1;
  mla.kv_len = quick ? 256 : 1024;
  mla.num_qo_heads = 128;
  mla.num_kv_heads = 1;
  mla.head_dim = 512;
  mla.rope_dim = 64;
  mla.page_size = 64;
  mla.name = "mla decode h128 512+64 p64 8x" + std::to_string(mla.kv_len);
  cases.push_back(mla);
  return cases;
}

}  // namespace tessera::cli
