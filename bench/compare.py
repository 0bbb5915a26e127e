#!/usr/bin/env python3
"""Side-by-side: the shapes `tessera bench --json` timed, run again through torch SDPA with the
FlashAttention-2 (FLASH) and cuDNN backends in the same device session, with ratios; and, when
`import flashinfer` works, through FlashInfer's wrappers on the same tensors.

Usage (on the GPU host, after `tessera bench --json tessera.json`):
    python3 bench/compare.py tessera.json [--out compare.json] [--iters 30]
        [--filter TEXT] [--flashinfer-only] [--no-flashinfer] [--flashinfer-out FILE]
        [--flashinfer-backend fa3|fa2] [--flashinfer-pdl] [--dry-run]

Prefill cases use q/k/v of shape [B, H, S, D] (enable_gqa for grouped heads); paged prefill is
compared with SDPA on the same shape with contiguous K/V (what cuDNN/FA2 would read); decode uses
one query token per request against contiguous K/V. Rates use the same FLOP / byte count as
tessera bench, so the ratio is a ratio of times.

FlashInfer (when it imports; --no-flashinfer leaves it out): the same q/k/v, laid out as its
wrappers take them: ragged prefill through BatchPrefillWithRaggedKVCacheWrapper, paged prefill
through BatchPrefillWithPagedKVCacheWrapper and decode through BatchDecodeWithPagedKVCacheWrapper
(tensor cores for grouped heads), the paged ones over an NHD cache [pages, page_size, H, D] with
shuffled page ids, as the bench lays out Tessera's. Prefill takes the fa3 backend on sm90 (fa2
elsewhere; --flashinfer-backend). It also times the skewed and mixed cases SDPA cannot take. Every
JIT module the cases need is compiled, and every wrapper configuration run once and checked,
before anything is timed; each case's output is then checked against an fp32 torch reference
(relative L2 error < 1e-2, else its time is dropped and the script exits 1). PDL stays off
(--flashinfer-pdl turns it on), as in Tessera's bench. The version and backends go into the
table's header, compare.json and --flashinfer-out (the FILE tools/perf-doc.py reads as
flashinfer.json). Without flashinfer the script prints one line saying so and runs as before.
--flashinfer-only skips the SDPA timings; --filter keeps the cases whose name contains TEXT;
--dry-run (no torch, no GPU) lists what each case would run.
"""
import argparse
import json
import math
import sys
import time

# Where the tensors live (tests run the FlashInfer plumbing on the CPU with a stand-in).
DEVICE = "cuda"


def time_ms(fn, iters):
    import torch

    # Flush L2 between runs like tessera bench does: a 256 MB scratch write, or a read of it with
    # TESSERA_BENCH_FLUSH=read (leaves L2 clean instead of dirty), nothing with =none.
    import os

    mode = os.environ.get("TESSERA_BENCH_FLUSH", "write") or "write"
    flush = torch.ones(256 << 20 >> 3, dtype=torch.int64, device="cuda")
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if mode == "write":
            flush.fill_(1)
        elif mode == "read":
            torch.sum(flush, dim=0, out=sink)
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def sdpa_tensors(case):
    """q, k, v of a uniform case in SDPA's layout [B, H, S, D], bf16."""
    import torch

    dtype = torch.bfloat16
    b, hq, hkv, d = case["batch"], case["num_qo_heads"], case["num_kv_heads"], case["head_dim"]
    sq, skv = case["q_len"], case["kv_len"]
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=DEVICE)
    k = torch.randn(b, hkv, skv, d, dtype=dtype, device=DEVICE)
    v = torch.randn(b, hkv, skv, d, dtype=dtype, device=DEVICE)
    return q, k, v


def sdpa_ms(case, backend, iters, tensors=None):
    """(median ms, "") of SDPA on one backend, or (None, why it did not run). tensors: the
    case's q, k, v (default: new random ones)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv = case["num_qo_heads"], case["num_kv_heads"]
    q, k, v = tensors if tensors is not None else sdpa_tensors(case)
    causal = bool(case["causal"]) and case["op"] != "decode"
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run():
        with sdpa_kernel([which]):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)

    try:
        run()
        torch.cuda.synchronize()
    except Exception as error:  # a backend may not support a shape
        return None, str(error).splitlines()[0][:80]
    return time_ms(run, iters), ""


# ---- FlashInfer -------------------------------------------------------------------------------

CHECK_LIMIT = 1e-2  # relative L2 error of FlashInfer's output against the fp32 reference


def first_line(error, limit=160):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:limit] if text else ''}".rstrip(": ")


def load_flashinfer():
    """(the flashinfer module, "") or (None, why it did not import)."""
    try:
        import flashinfer
    except Exception as error:  # ImportError, or a dependency failing while it imports
        return None, first_line(error)
    return flashinfer, ""


def is_skewed(case):
    return (case.get("first_q_len", case["q_len"]) != case["q_len"] or
            case.get("first_kv_len", case["kv_len"]) != case["kv_len"])


def request_groups(case):
    """The batch as runs of equal requests, in request order: [(count, q_len, kv_len)].
    Requests 0 .. first_count - 1 have first_q_len / first_kv_len (bench.json's skewed and
    mixed cases), the rest q_len / kv_len."""
    batch, q_len, kv_len = case["batch"], case["q_len"], case["kv_len"]
    first = min(max(int(case.get("first_count", 1)), 0), batch)
    first_q = case.get("first_q_len", q_len) or q_len
    first_kv = case.get("first_kv_len", kv_len) or kv_len
    groups = []
    for count, sq, skv in ((first, first_q, first_kv), (batch - first, q_len, kv_len)):
        if count <= 0:
            continue
        if groups and groups[-1][1:] == (sq, skv):
            groups[-1] = (groups[-1][0] + count, sq, skv)
        else:
            groups.append((count, sq, skv))
    return groups


def flashinfer_kind(case):
    """("ragged" | "paged" | "decode", "") for a case FlashInfer runs, else (None, why not)."""
    if case.get("checked", 0) or case.get("graph", 0):
        return None, "checked mode / graph replay: tessera only"
    if case.get("cascade", 0):
        # FlashInfer's plain decode of this batch is the row's "plain" twin; its
        # MultiLevelCascadeAttentionWrapper is not driven here.
        return None, "cascade: compare with the plain row of the same batch"
    op = case["op"]
    if op == "ragged_prefill":
        return "ragged", ""
    page = case.get("page_size", 0)
    if page <= 0:
        return None, f"{op} without a page size"
    if op == "paged_prefill":
        return "paged", ""
    if op == "decode":
        if any(sq != 1 for _, sq, _ in request_groups(case)):
            return None, "decode with several query tokens per request"
        return "decode", ""
    return None, f"unknown op {op}"


def flashinfer_config(case, kind):
    """What a wrapper and its JIT module depend on: (kind, hq, hkv, d, causal, page_size)."""
    causal = bool(case["causal"]) and kind != "decode"
    page = case.get("page_size", 0) if kind != "ragged" else 0
    return (kind, case["num_qo_heads"], case["num_kv_heads"], case["head_dim"], causal, page)


def flashinfer_modules(config, prefill_backend):
    """The JIT modules a configuration runs: ("prefill", backend, d), ("decode", d), and
    ("page",), the page-id-to-row-offset kernel fa3 runs before paged prefill."""
    kind, hq, hkv, d = config[:4]
    if kind != "decode":
        return [("prefill", prefill_backend, d)] + [("page",)] * (
            kind == "paged" and prefill_backend == "fa3")
    if hq != hkv:  # tensor-core decode: FlashInfer runs its fa2 prefill module
        return [("prefill", "fa2", d)]
    return [("decode", d)]


def backend_label(config, prefill_backend):
    kind, hq, hkv = config[:3]
    if kind != "decode":
        return prefill_backend
    return "fa2 tensor cores" if hq != hkv else "fa2 CUDA cores"


def prebuild_modules(modules):
    """Compiles every JIT module in one ninja run (all cores, across modules). Returns "" or why
    it failed (the wrappers then build each module when first planned)."""
    import torch

    bf16 = torch.bfloat16
    try:
        from flashinfer.jit import (build_jit_specs, gen_batch_decode_module,
                                    gen_batch_prefill_module)
        from flashinfer.jit.page import gen_page_module

        specs = []
        for module in sorted(modules, key=str):
            if module[0] == "page":
                specs.append(gen_page_module())
            elif module[0] == "prefill":
                _, backend, d = module
                # What get_batch_prefill_module receives from plan(): dtypes of q, kv, o and the
                # indices, head dims, no position encoding, sliding window, soft cap or fp16 QK.
                specs.append(gen_batch_prefill_module(backend, bf16, bf16, bf16, torch.int32, d, d,
                                                      0, False, False, False))
            else:
                _, d = module
                specs.append(gen_batch_decode_module(bf16, bf16, bf16, torch.int32, d, d, 0,
                                                     False, False))
    except Exception as error:  # another FlashInfer version's JIT API
        return first_line(error)
    try:
        build_jit_specs(specs, verbose=False)
    except Exception as error:
        lines = str(error).strip().splitlines()
        print("\n".join(["FlashInfer: the JIT pre-build failed; its last lines:"] + lines[-30:]))
        return first_line(error)
    return ""


def random_groups(config, groups):
    """Random bf16 q, k, v per request group, in SDPA's layout [b, H, S, D]."""
    import torch

    _, hq, hkv, d = config[:4]
    out = []
    for count, sq, skv in groups:
        out.append((torch.randn(count, hq, sq, d, dtype=torch.bfloat16, device=DEVICE),
                    torch.randn(count, hkv, skv, d, dtype=torch.bfloat16, device=DEVICE),
                    torch.randn(count, hkv, skv, d, dtype=torch.bfloat16, device=DEVICE)))
    return out


def paged_cache(tensors, index, page, page_ids):
    """K (index 1) or V (index 2) of every request in an NHD page cache [pages, page, H, D]:
    request r's logical page j at physical page page_ids[first page of r + j]."""
    import torch

    _, hkv, _, d = tensors[0][1].shape
    cache = torch.zeros(len(page_ids), page, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.tensor(page_ids, dtype=torch.int64, device=DEVICE)
    cursor = 0
    for group in tensors:
        x = group[index]
        count, _, skv, _ = x.shape
        pages = -(-skv // page)
        # About 1 GiB of staging at a time: a request's rows, padded to whole pages.
        step = max(1, (1 << 30) // max(1, pages * page * hkv * d * 2))
        for r0 in range(0, count, step):
            r1 = min(count, r0 + step)
            rows = torch.zeros(r1 - r0, pages * page, hkv, d, dtype=torch.bfloat16,
                               device=DEVICE)
            rows[:, :skv] = x[r0:r1].transpose(1, 2)
            cache[ids[cursor:cursor + (r1 - r0) * pages]] = rows.view(-1, page, hkv, d)
            cursor += (r1 - r0) * pages
    return cache


def flashinfer_inputs(config, tensors):
    """FlashInfer's view of the groups' q/k/v: q [tokens, H, D], ragged k/v [tokens, H, D] or
    the paged caches, the index arrays (int32, on the GPU), and the output buffer."""
    import torch

    kind, hq, hkv, d, causal, page = config
    dev = DEVICE
    q_lens, kv_lens = [], []
    for q, k, _ in tensors:
        q_lens += [q.shape[2]] * q.shape[0]
        kv_lens += [k.shape[2]] * k.shape[0]

    def indptr(lengths):
        values = [0]
        for n in lengths:
            values.append(values[-1] + n)
        return torch.tensor(values, dtype=torch.int32, device=dev)

    inputs = {"q": torch.cat([q.transpose(1, 2).reshape(-1, hq, d) for q, _, _ in tensors]),
              "qo_indptr": indptr(q_lens)}
    if kind == "decode":
        inputs["q"] = inputs["q"].view(len(q_lens), hq, d)
    if kind == "ragged":
        inputs["k"] = torch.cat([k.transpose(1, 2).reshape(-1, hkv, d) for _, k, _ in tensors])
        inputs["v"] = torch.cat([v.transpose(1, 2).reshape(-1, hkv, d) for _, _, v in tensors])
        inputs["kv_indptr"] = indptr(kv_lens)
    else:
        pages = [-(-n // page) for n in kv_lens]
        # Shuffled page ids, as the bench hands Tessera's out (TESSERA_BENCH_PAGES=shuffled).
        page_ids = torch.randperm(sum(pages)).tolist()
        inputs["k_cache"] = paged_cache(tensors, 1, page, page_ids)
        inputs["v_cache"] = paged_cache(tensors, 2, page, page_ids)
        inputs["page_indptr"] = indptr(pages)
        inputs["page_indices"] = torch.tensor(page_ids, dtype=torch.int32, device=dev)
        inputs["last_page_len"] = torch.tensor(
            [n - (p - 1) * page for n, p in zip(kv_lens, pages)], dtype=torch.int32, device=dev)
    inputs["out"] = torch.empty_like(inputs["q"])
    return inputs


def flashinfer_runner(flashinfer, config, inputs, workspace, prefill_backend, pdl):
    """Plans the wrapper of a configuration; returns (a function that runs it once, the backend
    the wrapper settled on)."""
    import torch

    kind, hq, hkv, d, causal, page = config
    bf16 = torch.bfloat16
    q, out = inputs["q"], inputs["out"]
    if kind == "ragged":
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD",
                                                                  backend=prefill_backend)
        wrapper.plan(inputs["qo_indptr"], inputs["kv_indptr"], hq, hkv, d, causal=causal,
                     q_data_type=bf16, kv_data_type=bf16)
        k, v = inputs["k"], inputs["v"]

        def run():
            return wrapper.run(q, k, v, out=out, enable_pdl=pdl)
    elif kind == "paged":
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD",
                                                                 backend=prefill_backend)
        wrapper.plan(inputs["qo_indptr"], inputs["page_indptr"], inputs["page_indices"],
                     inputs["last_page_len"], hq, hkv, d, page, causal=causal,
                     q_data_type=bf16, kv_data_type=bf16)
        cache = (inputs["k_cache"], inputs["v_cache"])

        def run():
            return wrapper.run(q, cache, out=out, enable_pdl=pdl)
    else:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                use_tensor_cores=hq != hkv)
        wrapper.plan(inputs["page_indptr"], inputs["page_indices"], inputs["last_page_len"],
                     hq, hkv, d, page, q_data_type=bf16, kv_data_type=bf16)
        cache = (inputs["k_cache"], inputs["v_cache"])

        def run():
            return wrapper.run(q, cache, out=out, enable_pdl=pdl)
    label = backend_label(config, prefill_backend)
    if kind != "decode":
        label = str(getattr(wrapper, "_backend", label))
    return run, label


def reference_rel_l2(tensors, out, causal):
    """Relative L2 error of out ([tokens, Hq, D], requests in order) against attention computed
    in fp32 from the groups' q/k/v (causal: bottom-right aligned, as FlashInfer's and Tessera's
    masks are when a request has more keys than queries)."""
    import torch

    err = torch.zeros((), dtype=torch.float64, device=DEVICE)
    ref = torch.zeros((), dtype=torch.float64, device=DEVICE)
    row = 0
    for q, k, v in tensors:
        count, hq, sq, d = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        group = hq // hkv
        scale = 1.0 / math.sqrt(d)
        chunk = max(1, (1 << 28) // (hq * skv))  # 1 GiB of fp32 scores at a time
        keys = torch.arange(skv, device=DEVICE)
        for r in range(count):
            kf = k[r].float().transpose(1, 2).unsqueeze(1)  # [hkv, 1, D, skv]
            vf = v[r].float().unsqueeze(1)  # [hkv, 1, skv, D]
            for r0 in range(0, sq, chunk):
                r1 = min(sq, r0 + chunk)
                qf = q[r, :, r0:r1].float().reshape(hkv, group, r1 - r0, d)
                s = torch.matmul(qf, kf) * scale  # [hkv, group, rows, skv]
                if causal:
                    last = torch.arange(r0, r1, device=DEVICE) + (skv - sq)
                    s.masked_fill_(keys[None, :] > last[:, None], float("-inf"))
                o = torch.matmul(torch.softmax(s, dim=-1), vf)
                o = o.reshape(hq, r1 - r0, d).transpose(0, 1)
                got = out[row + r0:row + r1].float()
                err += ((got - o) ** 2).sum(dtype=torch.float64)
                ref += (o ** 2).sum(dtype=torch.float64)
            row += sq
    return math.sqrt(err.item() / max(ref.item(), 1e-30))


class FlashInferAnchor:
    """FlashInfer's wrappers on the cases' tensors: warm-up (JIT) first, then one case at a time."""

    def __init__(self, flashinfer, prefill_backend, pdl):
        import torch

        self.fi = flashinfer
        self.version = getattr(flashinfer, "__version__", "?")
        self.prefill_backend = prefill_backend
        self.pdl = pdl
        # The float workspace of the split-KV partials (FlashInfer recommends 128 MB; zeroed
        # before its first use, as the decode wrapper asks).
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=DEVICE)
        self.backends = {}  # config -> backend label
        self.broken = {}  # config -> why its warm-up failed
        self.jit_s = 0.0
        self.prebuild_error = ""
        self.wrong = 0
        self.errors = 0
        self.timed = 0

    def warm_up(self, configs):
        """Compiles the modules of every configuration, then plans, runs and checks each one on
        a small batch, before any timing."""
        import torch

        start = time.time()
        modules = {m for c in configs for m in flashinfer_modules(c, self.prefill_backend)}
        if modules:
            self.prebuild_error = prebuild_modules(modules)
        for config in sorted(configs, key=str):
            kind, _, _, _, causal, page = config
            # Two requests of 37 queries on 75 keys (one token for decode): a partial last page,
            # and a causal mask that is not square.
            groups = [(2, 1 if kind == "decode" else 37, 75)]
            try:
                tensors = random_groups(config, groups)
                inputs = flashinfer_inputs(config, tensors)
                run, label = flashinfer_runner(self.fi, config, inputs, self.workspace,
                                               self.prefill_backend, self.pdl)
                run()
                torch.cuda.synchronize()
                error = reference_rel_l2(tensors, inputs["out"], causal)
                if not error < CHECK_LIMIT:
                    self.broken[config] = f"wrong output in the warm-up: rel L2 {error:.3g}"
                    continue
                self.backends[config] = label
            except Exception as error:
                self.broken[config] = "warm-up failed: " + first_line(error)
        torch.cuda.synchronize()
        self.jit_s = time.time() - start

    def describe(self):
        labels = {}
        for config, label in self.backends.items():
            labels.setdefault(config[0], set()).add(label)
        parts = [f"{kind} {'/'.join(sorted(labels[kind]))}"
                 for kind in ("ragged", "paged", "decode") if kind in labels]
        text = (f"FlashInfer {self.version}: " + (", ".join(parts) if parts else "no wrapper ran") +
                f"; PDL {'on' if self.pdl else 'off'}; JIT and warm-up {self.jit_s:.0f} s; "
                f"outputs checked against fp32 attention (rel L2 < {CHECK_LIMIT:g})")
        if self.prebuild_error:
            text += f"\nFlashInfer: JIT pre-build failed ({self.prebuild_error})"
        for config, why in sorted(self.broken.items(), key=str):
            text += f"\nFlashInfer: {config_text(config)}: {why}"
        return text

    def measure(self, case, config, tensors, iters):
        """{"flashinfer_ms", "flashinfer_backend", "flashinfer_rel_l2", "flashinfer_note"} for
        one case on its tensors: [(q, k, v)], the SDPA ones of a uniform case, or None (new
        random ones per request group)."""
        import torch

        result = {"flashinfer_ms": None, "flashinfer_backend": self.backends.get(config)}
        if config in self.broken:
            result["flashinfer_note"] = self.broken[config]
            if self.broken[config].startswith("wrong"):
                self.wrong += 1
            else:
                self.errors += 1
            return result
        inputs = None
        try:
            if tensors is None:
                tensors = random_groups(config, request_groups(case))
            inputs = flashinfer_inputs(config, tensors)
            run, label = flashinfer_runner(self.fi, config, inputs, self.workspace,
                                           self.prefill_backend, self.pdl)
            result["flashinfer_backend"] = label
            run()
            torch.cuda.synchronize()
            error = reference_rel_l2(tensors, inputs["out"], config[4])
            result["flashinfer_rel_l2"] = error
            if not error < CHECK_LIMIT:
                result["flashinfer_note"] = f"wrong output: rel L2 {error:.3g}"
                self.wrong += 1
                return result
            result["flashinfer_ms"] = time_ms(run, iters)
            self.timed += 1
        except Exception as error:  # a shape it does not take, or out of memory
            result["flashinfer_note"] = first_line(error, 80)
            self.errors += 1
        finally:
            del inputs, tensors
            torch.cuda.empty_cache()
        return result

    def summary(self):
        return {"version": self.version, "same_call": True, "prefill_backend": self.prefill_backend,
                "backends": {config_text(c): label for c, label in sorted(self.backends.items(),
                                                                          key=str)},
                "warm_up_failed": {config_text(c): why for c, why in sorted(self.broken.items(),
                                                                           key=str)},
                "enable_pdl": self.pdl, "jit_and_warm_up_s": round(self.jit_s, 1),
                "check": f"relative L2 error against fp32 attention < {CHECK_LIMIT:g}",
                "timed": self.timed, "wrong": self.wrong, "errors": self.errors}


def config_text(config):
    kind, hq, hkv, d, causal, page = config
    text = f"{kind} {hq}/{hkv} d{d}" + (" causal" if causal else "")
    return text + (f" p{page}" if page else "")


# ---- main -------------------------------------------------------------------------------------


def dry_run(cases, args):
    """What each case would run, without torch or a GPU (FlashInfer assumed present)."""
    backend = args.flashinfer_backend or "fa3 on sm90, else fa2"
    modules = set()
    for case in cases:
        if case["status"] != "ok":
            print(f"{case['name']:44s} tessera failed: skipped")
            continue
        skewed = is_skewed(case)
        sdpa = not (skewed or case.get("checked", 0) or case.get("graph", 0))
        kind, why = (None, "--no-flashinfer") if args.no_flashinfer else flashinfer_kind(case)
        parts = []
        if sdpa and not args.flashinfer_only:
            parts.append("SDPA FA2 + cuDNN")
        if kind:
            config = flashinfer_config(case, kind)
            modules.update(flashinfer_modules(config, args.flashinfer_backend or "fa3"))
            parts.append(f"FlashInfer {config_text(config)} "
                         f"[{backend_label(config, backend)}] groups {request_groups(case)}")
        else:
            parts.append(f"no FlashInfer ({why})")
        print(f"{case['name']:44s} " + "; ".join(parts))
    print(f"FlashInfer JIT modules: {sorted(modules, key=str)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tessera_json")
    parser.add_argument("--out", default="")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--png", default="", help="also draw the rates per case to this PNG")
    parser.add_argument("--filter", default="", help="only cases whose name contains this text")
    parser.add_argument("--flashinfer-only", action="store_true",
                        help="time FlashInfer (and list Tessera) only, no SDPA")
    parser.add_argument("--no-flashinfer", action="store_true",
                        help="leave FlashInfer out even when it imports")
    parser.add_argument("--flashinfer-out", default="",
                        help="also write FlashInfer's rows here, in the format tools/perf-doc.py "
                             "reads (flashinfer.json)")
    parser.add_argument("--flashinfer-backend", choices=["fa3", "fa2"], default="",
                        help="FlashInfer's prefill backend (default: fa3 on sm90, else fa2)")
    parser.add_argument("--flashinfer-pdl", action="store_true",
                        help="launch FlashInfer's kernels with PDL (default off)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list what each case would run (no torch, no GPU)")
    args = parser.parse_args()
    with open(args.tessera_json) as f:
        report = json.load(f)
    cases = [c for c in report["results"] if args.filter in c["name"]]
    if args.dry_run:
        return dry_run(cases, args)
    import torch

    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    anchor = None
    if args.no_flashinfer:
        if args.flashinfer_only:
            print("--flashinfer-only and --no-flashinfer: nothing to time")
            return 2
    else:
        flashinfer, why = load_flashinfer()
        if flashinfer is None:
            print(f"FlashInfer not found ({why}): torch SDPA anchors only")
            if args.flashinfer_only:
                return 2
        else:
            major = torch.cuda.get_device_capability()[0]
            backend = args.flashinfer_backend or ("fa3" if major == 9 else "fa2")
            anchor = FlashInferAnchor(flashinfer, backend, args.flashinfer_pdl)
            configs = set()
            for case in cases:
                kind, _ = flashinfer_kind(case)
                if case["status"] == "ok" and kind:
                    configs.add(flashinfer_config(case, kind))
            anchor.warm_up(configs)
            print(anchor.describe())
    rows = []
    header = (f"{'case':44s} {'tessera':>9s} {'FA2':>9s} {'cuDNN':>9s} "
              f"{'x FA2':>7s} {'x cuDNN':>8s}")
    if anchor:
        header = (f"{'case':44s} {'tessera':>9s} {'FA2':>9s} {'cuDNN':>9s} {'FlashInfer':>10s} "
                  f"{'x FA2':>7s} {'x cuDNN':>8s} {'x FlashInfer':>12s}")
    print(header)
    for case in cases:
        if case["status"] != "ok":
            print(f"{case['name']:44s} tessera failed: skipped")
            continue
        skewed = is_skewed(case)
        kind, _ = flashinfer_kind(case) if anchor else (None, "")
        # SDPA's is_causal is top-left aligned: a causal chunk with fewer queries than keys
        # (bottom-right, as Tessera and FlashInfer take it) is a different mask there.
        top_left = bool(case["causal"]) and case["op"] != "decode" and \
            case["q_len"] != case["kv_len"]
        sdpa = not (skewed or top_left or case.get("checked", 0) or case.get("graph", 0))
        if not kind and (not sdpa or args.flashinfer_only):
            # SDPA takes one length per batch (skewed), has no checked mode, and is not timed
            # in a graph here: tessera only.
            unit = 2 if case["op"] == "decode" else 1
            print(f"{case['name']:44s} {case['rate']:>9.{unit}f}   (tessera only)")
            continue
        decode = case["op"] == "decode"
        amount = case["bytes"] if decode else case["tflops"] * 1e12
        row = {"name": case["name"], "op": case["op"], "tessera_ms": case["ms"]}
        tensors = None
        if anchor and sdpa:
            tensors = sdpa_tensors(case)  # the same tensors for SDPA and FlashInfer
        for backend in ("flash", "cudnn"):
            if not sdpa:
                ms, note = None, ("SDPA's causal mask is top-left" if top_left
                                  else "SDPA takes one length per batch")
            elif anchor and args.flashinfer_only:
                ms, note = None, "not run (--flashinfer-only)"
            elif anchor:
                ms, note = sdpa_ms(case, backend, args.iters, tensors)
            else:
                ms, note = sdpa_ms(case, backend, args.iters)
            row[backend + "_ms"] = ms
            if note:
                row[backend + "_note"] = note

        def rate(ms):
            return amount / (ms * 1e-3) / 1e12 if ms else None
        row["tessera_rate"] = rate(case["ms"])
        row["flash_rate"] = rate(row["flash_ms"])
        row["cudnn_rate"] = rate(row["cudnn_ms"])
        row["ratio_flash"] = row["flash_ms"] / case["ms"] if row["flash_ms"] else None
        row["ratio_cudnn"] = row["cudnn_ms"] / case["ms"] if row["cudnn_ms"] else None
        if anchor:
            if kind:
                config = flashinfer_config(case, kind)
                groups = [tensors] if tensors is not None else None
                row.update(anchor.measure(case, config, groups, args.iters))
            else:
                row.update({"flashinfer_ms": None, "flashinfer_note": flashinfer_kind(case)[1]})
            row["flashinfer_rate"] = rate(row["flashinfer_ms"])
            row["ratio_flashinfer"] = (row["flashinfer_ms"] / case["ms"]
                                       if row["flashinfer_ms"] else None)
            del tensors
            torch.cuda.empty_cache()
        rows.append(row)
        fmt = lambda x, p=1: f"{x:.{p}f}" if x is not None else "-"
        unit = 2 if decode else 1
        line = (f"{case['name']:44s} {fmt(row['tessera_rate'], unit):>9s} "
                f"{fmt(row['flash_rate'], unit):>9s} {fmt(row['cudnn_rate'], unit):>9s} ")
        if anchor:
            note = row.get("flashinfer_note", "")
            fi = fmt(row["flashinfer_rate"], unit)
            if row["flashinfer_ms"] is None and kind:
                fi = "wrong" if note.startswith("wrong") else "error"
            line += (f"{fi:>10s} {fmt(row['ratio_flash'], 2):>7s} "
                     f"{fmt(row['ratio_cudnn'], 2):>8s} {fmt(row['ratio_flashinfer'], 2):>12s}")
            if row["flashinfer_ms"] is None and kind:
                line += f"  FlashInfer: {note}"
        else:
            line += f"{fmt(row['ratio_flash'], 2):>7s} {fmt(row['ratio_cudnn'], 2):>8s}"
        print(line)
    print("(rates: TFLOP/s for prefill, TB/s of K+V for decode; ratio > 1: tessera faster)")
    if anchor:
        print(f"FlashInfer {anchor.version}: {anchor.timed} timed, {anchor.wrong} with wrong "
              f"output (not timed), {anchor.errors} failed to run, of "
              f"{anchor.timed + anchor.wrong + anchor.errors} cases")
    if args.out:
        result = {"device": torch.cuda.get_device_name(), "rows": rows}
        if anchor:
            result["flashinfer"] = anchor.summary()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if anchor and args.flashinfer_out:
        write_flashinfer_json(args.flashinfer_out, anchor, rows, cases)
    if args.png:
        draw_chart(rows, args.png, torch.cuda.get_device_name())
    if anchor and anchor.wrong:
        return 1
    if anchor and args.flashinfer_only and (anchor.errors or anchor.broken):
        return 1
    return None


def write_flashinfer_json(path, anchor, rows, cases):
    """FlashInfer's rows in the format of tools/perf-doc.py's flashinfer.json (same call: the
    bench's Tessera times are the ones to compare with)."""
    import datetime

    by_name = {c["name"]: c for c in cases}
    out_rows = []
    for row in rows:
        if row.get("flashinfer_ms") is None:
            continue
        case = by_name[row["name"]]
        out_rows.append({"name": row["name"], "op": row["op"], "graph": case.get("graph", 0),
                         "flashinfer_ms": row["flashinfer_ms"],
                         "flashinfer_rate": row["flashinfer_rate"],
                         "backend": row.get("flashinfer_backend"),
                         "rel_l2": row.get("flashinfer_rel_l2")})
    data = dict(anchor.summary(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                rows=out_rows)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def draw_chart(rows, path, device):
    """Two panels: prefill TFLOP/s and decode TB/s, one group of bars per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("prefill", [r for r in rows if r["op"] != "decode"], "TFLOP/s"),
              ("decode", [r for r in rows if r["op"] == "decode"], "TB/s of K+V")]
    series = [("tessera_rate", "tessera"), ("flash_rate", "FA2 (SDPA)"),
              ("cudnn_rate", "cuDNN (SDPA)")]
    if any(r.get("flashinfer_rate") for r in rows):
        series.append(("flashinfer_rate", "FlashInfer"))
    fig, axes = plt.subplots(2, 1, figsize=(16, 10))
    for ax, (title, subset, unit) in zip(axes, panels):
        names = [r["name"] for r in subset]
        width = 0.27 if len(series) == 3 else 0.2
        for i, (key, label) in enumerate(series):
            values = [r.get(key) or 0.0 for r in subset]
            offset = (i - (len(series) - 1) / 2) * width
            ax.bar([x + offset for x in range(len(subset))], values, width, label=label)
        ax.set_xticks(range(len(subset)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, bf16, {device}")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
