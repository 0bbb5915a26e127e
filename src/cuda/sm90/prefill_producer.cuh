// Producer warpgroup of the sm90 prefill kernel: walks the CTA's work items exactly as the
// consumers do and fills, per CTA tile, the Q buffer and one K and one V ring slot per key tile.
//
// Per key tile t (ring slot s = count % kStages, use u = count / kStages):
//   every producer thread waits until slot s is free (empty barrier, parity of use u - 1);
//   TMA tile:    thread 0 announces the bytes (arrive.expect_tx) and issues the copies (paged:
//                the per-page boxes are spread over the producer's four warps, whose issuing
//                lanes announce their own bytes and arrive after issuing; built with
//                -DTESSERA_SM90_BOX_WARPS=1, the lanes of warp 0 share them), the other
//                threads arrive plainly - the full barrier counts 128 arrivals;
//   gathered:    all 128 threads issue cp.async (zero-filling keys past the request), then
//                cp.async.mbarrier.arrive.noinc - one arrival each when their copies land.
// K of tile 0 goes out before Q (it does not wait for the previous tile's consumers), then Q
// (once the consumers released the Q buffer), then K of tile 1, V of tile 0, K of tile 2, V of
// tile 1, and so on: K one tile ahead of V, the order the consumers wait in.
//
// Paged caches: the page ids of the next kPageTableKeys keys are read into a shared table one
// chunk ahead (all 128 threads, while the current chunk's copies are in flight), so no
// dependent global load sits in front of a copy.
#pragma once

#include <cstdint>

#include "core/problem.hpp"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/sm90/prefill_tile.cuh"
#include "cuda/sm90/prefill_traits.cuh"

namespace tessera::detail::sm90 {

// Shared-memory addresses of the ring, the Q buffer, the key table and the barriers.
template <class Traits>
struct PrefillSmem {
  uint32_t base;           // 1024-aligned .shared address
  unsigned char* generic;  // the same byte as a generic pointer

  __device__ __forceinline__ uint32_t q() const { return base + Traits::kQOffset; }
  __device__ __forceinline__ uint32_t k(int stage) const {
    return base + static_cast<uint32_t>(Traits::kKOffset + stage * Traits::kKVStageBytes);
  }
  __device__ __forceinline__ uint32_t v(int stage) const {
    return base + static_cast<uint32_t>(Traits::kVOffset + stage * Traits::kKVStageBytes);
  }
  __device__ __forceinline__ uint32_t o() const { return base + Traits::kOOffset; }
  __device__ __forceinline__ unsigned char* o_generic() const { return generic + Traits::kOOffset; }
  // Page-table slot: kPageTableEntries page ids (prefill_traits.cuh).
  __device__ __forceinline__ int32_t* page_table(int slot) const {
    return reinterpret_cast<int32_t*>(generic + Traits::kPageTableOffset) +
           slot * Traits::kPageTableEntries;
  }
  __device__ __forceinline__ uint32_t barrier(int index) const {
    return base + static_cast<uint32_t>(Traits::kBarrierOffset + 8 * index);
  }
  __device__ __forceinline__ uint32_t q_full() const { return barrier(0); }
  __device__ __forceinline__ uint32_t q_empty() const { return barrier(1); }
  __device__ __forceinline__ uint32_t k_full(int stage) const { return barrier(2 + stage); }
  __device__ __forceinline__ uint32_t k_empty(int stage) const {
    return barrier(2 + Traits::kStages + stage);
  }
  __device__ __forceinline__ uint32_t v_full(int stage) const {
    return barrier(2 + 2 * Traits::kStages + stage);
  }
  __device__ __forceinline__ uint32_t v_empty(int stage) const {
    return barrier(2 + 3 * Traits::kStages + stage);
  }
};

// Ring position shared by the K and V rings (one K and one V slot per key tile).
struct RingState {
  int32_t count = 0;  // key tiles produced (or consumed) so far by this CTA
  template <int kStages>
  __device__ __forceinline__ int stage() const {
    return count % kStages;
  }
  template <int kStages>
  __device__ __forceinline__ uint32_t parity() const {
    return static_cast<uint32_t>((count / kStages) & 1);
  }
};

template <class Traits>
class PrefillProducer {
 public:
  __device__ __forceinline__ PrefillProducer(const PrefillParams& params,
                                             const PrefillSmem<Traits>& smem)
      : params_(params), problem_(params.args.problem), smem_(smem) {}

  __device__ void run() {
    const int thread = threadIdx.x;  // 0 .. 127: the producer warpgroup is warpgroup 0
    if (thread == 0) {
      ptx::prefetch_tensor_map(&params_.q_map);
      if (params_.kv_tma != 0) {
        ptx::prefetch_tensor_map(&params_.k_map);
        ptx::prefetch_tensor_map(&params_.v_map);
      }
    }
    RingState ring;
    int32_t q_count = 0;
    for_each_prefill_tile<Traits::kBlockN, Traits::kNarrowTileMath>(
        params_, [&](const PrefillTile& tile) {
          // A tile without keys: the consumers write o = 0 without Q or K/V.
          if (tile.num_key_tiles > 0) produce_tile(tile, ring, q_count);
        });
    ptx::cp_async_wait_group<0>();  // no copy of this thread outlives it
  }

 private:
  // Producer warps that issue a paged tile's TMA boxes (load_page_boxes): all four by
  // default (page 16: +19% over one warp, page 64: -0.5..1%, H100, docs/PERF.md 2026-12-07);
  // -DTESSERA_SM90_BOX_WARPS=1 keeps them on the lanes of warp 0, to time the two side by side.
#ifdef TESSERA_SM90_BOX_WARPS
  static constexpr int kBoxWarps = TESSERA_SM90_BOX_WARPS;
#else
  static constexpr int kBoxWarps = 4;
#endif
  static_assert(kBoxWarps >= 1 && kBoxWarps <= Traits::kProducerThreads / 32,
                "box-issuing warps: 1 .. the producer warpgroup's 4");
  // A key tile has at most kBlockN / kMinTmaPageKeys boxes, one per issuing lane (fewer than
  // 32 a warp, so the __syncwarp mask of load_page_boxes is well formed).
  static_assert((Traits::kBlockN / kMinTmaPageKeys + kBoxWarps - 1) / kBoxWarps < 32,
                "more boxes than issuing lanes");
  // Key tiles per page-table chunk (one slot of the double-buffered table).
  static constexpr int kChunkTiles = Traits::kPageTableKeys / Traits::kBlockN;
  static_assert(kChunkTiles >= 2, "a chunk's table is published a tile before its first use");

  __device__ void produce_tile(const PrefillTile& tile, RingState& ring, int32_t& q_count) {
    const KVSource& kv = problem_.kv;
    const int32_t page_base = kv.paged ? kv.page_indptr[tile.request] : 0;
    const int32_t kv_row_base = kv.paged ? 0 : kv.kv_indptr[tile.request];
    const int n = tile.num_key_tiles;
    if (kv.paged) {
      // Every thread is done reading the previous tile's table before slot 0 is refilled.
      ptx::named_barrier_sync(kProducerBarrier, Traits::kProducerThreads);
      fill_page_table(tile, 0, page_base);
      ptx::named_barrier_sync(kProducerBarrier, Traits::kProducerThreads);
    }
    // K of key tile 0, Q, then K of tile t + 1 before V of tile t: the order the consumers wait
    // in (they issue S(t+1) = Q K(t+1)^T before P(t) V(t)), so a K tile is never queued behind a
    // V tile that is needed later, nor held back by the wait for that V tile's slot.
    for (int t = -1; t < n; ++t) {
      const int k_tile = t + 1;
      if (k_tile < n) {
        // Publishes chunk k_tile / kChunkTiles before its first read (filled a chunk ago).
        if (kv.paged && k_tile > 0 && k_tile % kChunkTiles == 0) {
          ptx::named_barrier_sync(kProducerBarrier, Traits::kProducerThreads);
        }
        load_ring_slot(tile, k_tile, kv_row_base, /*values=*/false, RingState{ring.count + k_tile});
        if (k_tile == 0) load_q(tile, q_count++);
      }
      if (t < 0) continue;
      load_ring_slot(tile, t, kv_row_base, /*values=*/true, RingState{ring.count + t});
      const int chunk = t / kChunkTiles;
      if (kv.paged && t % kChunkTiles == 0 && (chunk + 1) * kChunkTiles < n) {
        // The next chunk goes into the slot of chunk - 1, whose last read (V of the tile before
        // this one) every thread has issued once past this barrier.
        if (t > 0) ptx::named_barrier_sync(kProducerBarrier, Traits::kProducerThreads);
        fill_page_table(tile, chunk + 1, page_base);
      }
    }
    ring.count += n;
  }

  // K (values = false) or V of key tile t into the ring slot of position `at`, once the
  // consumers have released that slot.
  __device__ __forceinline__ void load_ring_slot(const PrefillTile& tile, int t,
                                                 int32_t kv_row_base, bool values, RingState at) {
    const int stage = at.stage<Traits::kStages>();
    const uint32_t free_parity = at.parity<Traits::kStages>() ^ 1;
    ptx::mbarrier_wait(values ? smem_.v_empty(stage) : smem_.k_empty(stage), free_parity);
    load_key_tile(tile, t, t / kChunkTiles, key_tile_is_gathered<Traits::kBlockN>(params_, tile, t),
                  kv_row_base, values, values ? smem_.v(stage) : smem_.k(stage),
                  values ? smem_.v_full(stage) : smem_.k_full(stage));
  }

  // Q of the tile: one 3-d box {64 columns, group heads, tokens_per_tile tokens} per column
  // block. Rows past the tile's tokens are whatever follows in q (or zeros past its end): they
  // only feed padding rows, which are never stored.
  __device__ __forceinline__ void load_q(const PrefillTile& tile, int32_t q_count) {
    if (threadIdx.x != 0) return;
    const int32_t group = problem_.group_size();
    ptx::mbarrier_wait(smem_.q_empty(), static_cast<uint32_t>(q_count & 1) ^ 1);
    const uint32_t box_bytes = static_cast<uint32_t>(64 * 2 * group * params_.tokens_per_tile);
    ptx::mbarrier_arrive_expect_tx(smem_.q_full(), box_bytes * Traits::kColumnBlocks);
#pragma unroll
    for (int block = 0; block < Traits::kColumnBlocks; ++block) {
      ptx::tma_load_3d(smem_.q() + block * static_cast<uint32_t>(Traits::kQBlockBytes),
                       &params_.q_map, smem_.q_full(), block * 64, tile.kv_head * group,
                       tile.q_begin + tile.token0);
    }
  }

  // First key of page-table chunk `chunk` of the tile and the request page it starts in.
  __device__ __forceinline__ int32_t chunk_first_page(const PrefillTile& tile, int chunk) const {
    return (tile.key0 + chunk * Traits::kPageTableKeys) / problem_.kv.page_size;
  }

  // Page ids of the request pages that keys [chunk start, + kPageTableKeys) of the tile touch
  // (only pages the request has), into slot chunk % 2.
  __device__ __forceinline__ void fill_page_table(const PrefillTile& tile, int chunk,
                                                  int32_t page_base) {
    const KVSource& kv = problem_.kv;
    int32_t* table = smem_.page_table(chunk % 2);
    const int32_t first_page = chunk_first_page(tile, chunk);
    const int32_t chunk_end =
        min(tile.key0 + (chunk + 1) * Traits::kPageTableKeys,
            min(tile.kv_len, tile.key0 + tile.num_key_tiles * Traits::kBlockN));
    const int32_t end_page = (chunk_end + kv.page_size - 1) / kv.page_size;
#pragma unroll 1
    for (int32_t e = threadIdx.x; first_page + e < end_page; e += Traits::kProducerThreads) {
      table[e] = kv.page_indices[page_base + first_page + e];
    }
  }

  // One K (values = false) or V tile into `dst`, completing on `full`.
  __device__ __forceinline__ void load_key_tile(const PrefillTile& tile, int t, int chunk,
                                                bool gathered, int32_t kv_row_base, bool values,
                                                uint32_t dst, uint32_t full) {
    const KVSource& kv = problem_.kv;
    const int32_t first_key = tile.key0 + t * Traits::kBlockN;
    if (!gathered) {
      const CUtensorMap* map = values ? &params_.v_map : &params_.k_map;
      const int32_t heads_first = params_.kv_heads_first;
      if (!kv.paged) {
        if (threadIdx.x != 0) {
          ptx::mbarrier_arrive(full);
          return;
        }
        ptx::mbarrier_arrive_expect_tx(full, static_cast<uint32_t>(Traits::kKVStageBytes));
        const int32_t row = kv_row_base + first_key;
#pragma unroll
        for (int block = 0; block < Traits::kColumnBlocks; ++block) {
          ptx::tma_load_3d(dst + block * static_cast<uint32_t>(Traits::kKVBlockBytes), map, full,
                           block * 64, heads_first ? tile.kv_head : row,
                           heads_first ? row : tile.kv_head);
        }
        return;
      }
      // Paged: one box per page (or per key tile when pages are larger), spread over warps.
      load_page_boxes(tile, first_key, chunk, values, map, dst, full);
      return;
    }
    // Gather: thread -> 16-byte chunk (thread % 8) of rows thread / 8 + 16 i, every column
    // block; the chunk lands at its swizzled place (chunk ^ row % 8, ptx/wgmma.cuh). Page-by-page
    // V puts row r at page r / R, row r % R of the page, column blocks R rows apart (R =
    // v_page_rows; R = BLOCK_N is the usual layout).
    const bool page_layout = Traits::kVPageBoxes && values;
    const int32_t layout_rows = page_layout ? params_.v_page_rows : Traits::kBlockN;
    const int32_t layout_shift = page_layout ? params_.v_page_rows_shift : 0;
    const uint32_t block_bytes =
        page_layout ? static_cast<uint32_t>(layout_rows) * static_cast<uint32_t>(Traits::kRowBytes)
                    : static_cast<uint32_t>(Traits::kKVBlockBytes);
    const auto* base = static_cast<const uint16_t*>(values ? kv.v : kv.k);
    const int64_t stride_token = values ? kv.v_stride_token : kv.k_stride_token;
    const int64_t stride_head = values ? kv.v_stride_head : kv.k_stride_head;
    const int32_t* table = smem_.page_table(chunk % 2);
    const int32_t table_first = kv.paged ? chunk_first_page(tile, chunk) : 0;
    const int64_t stride_page = values ? kv.v_stride_page : kv.k_stride_page;
    const int lane_chunk = threadIdx.x % 8;
#pragma unroll 1
    for (int row = threadIdx.x / 8; row < Traits::kBlockN; row += Traits::kProducerThreads / 8) {
      const int32_t key = first_key + row;
      int64_t offset = -1;
      if (key < tile.kv_len) {
        if (kv.paged) {
          // A shift for power-of-two pages: the gather's issue rate is what limits it.
          const int32_t page_in_request = divide_by(key, kv.page_size, params_.page_shift);
          offset = int64_t{table[page_in_request - table_first]} * stride_page +
                   int64_t{key - page_in_request * kv.page_size} * stride_token;
        } else {
          offset = (kv_row_base + int64_t{key}) * stride_token;
        }
        offset += int64_t{tile.kv_head} * stride_head;
      }
      const int32_t layout_row =
          page_layout ? (row >> layout_shift) * layout_rows * Traits::kColumnBlocks +
                            (row & (layout_rows - 1))
                      : row;
      const uint32_t row_dst = dst + static_cast<uint32_t>(layout_row) * Traits::kRowBytes +
                               static_cast<uint32_t>((lane_chunk ^ (row % 8)) << 4);
#pragma unroll
      for (int block = 0; block < Traits::kColumnBlocks; ++block) {
        const int column = block * 64 + lane_chunk * 8;
        const bool valid = offset >= 0 && column < problem_.head_dim;
        ptx::cp_async_16_zfill(row_dst + block * block_bytes,
                               valid ? base + offset + column : base, valid);
      }
    }
    ptx::cp_async_mbarrier_arrive_noinc(full);
  }

  // Paged TMA tile: its boxes (one page each, or the whole tile when pages are larger) spread
  // over the first kBoxWarps producer warps; box b is issued by lane b / kBoxWarps of warp
  // b % kBoxWarps (with 16-key pages a d128 K tile is 8 boxes x 2 column blocks). Within a
  // warp, lanes with different coordinates issue one after another (ptxas loops over them:
  // elect, R2UR of each coordinate, UTMALDG), about 100 cycles a box, so warp 0 alone spent
  // about 1 us on a page-16 K tile; warps issue side by side (docs/PERF.md, 2026-12-07). Each
  // issuing warp's lane 0 announces the bytes of that warp's boxes (arrive.expect_tx) before
  // any lane of the warp issues one (__syncwarp), and the other issuing lanes arrive after
  // issuing theirs, so the phase cannot complete before every box has been issued and has
  // landed; every other producer thread arrives at once (the full barrier counts
  // kProducerThreads arrivals).
  __device__ __forceinline__ void load_page_boxes(const PrefillTile& tile, int32_t first_key,
                                                  int chunk, bool values,
                                                  const CUtensorMap* map, uint32_t dst,
                                                  uint32_t full) const {
    const KVSource& kv = problem_.kv;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int32_t box_rows = params_.kv_box_rows;
    const int boxes = Traits::kBlockN / box_rows;  // <= kBlockN / kMinTmaPageKeys
    const int mine = warp < kBoxWarps && warp < boxes ? (boxes - 1 - warp) / kBoxWarps + 1 : 0;
    if (lane >= mine) {
      ptx::mbarrier_arrive(full);
      return;
    }
    constexpr uint32_t kBoxBytesPerRow = Traits::kColumnBlocks * Traits::kRowBytes;
    if (lane == 0) {
      ptx::mbarrier_arrive_expect_tx(full,
                                     static_cast<uint32_t>(mine * box_rows) * kBoxBytesPerRow);
    }
    __syncwarp((1u << mine) - 1u);
    const int box = warp + kBoxWarps * lane;
    const int32_t heads_first = params_.kv_heads_first;
    const int32_t row_in_page = first_key % kv.page_size;  // 0 unless page_size > BLOCK_N
    const int32_t* table = smem_.page_table(chunk % 2);
    const int32_t table_first = first_key / kv.page_size - chunk_first_page(tile, chunk);
    const int32_t page = table[table_first + box * box_rows / kv.page_size];
    if (Traits::kVPageBoxes && values && params_.v_page_rows < Traits::kBlockN) {
      ptx::tma_load_5d(dst + static_cast<uint32_t>(box * box_rows) * kBoxBytesPerRow, map, full, 0,
                       row_in_page, 0, tile.kv_head, page);
    } else {
#pragma unroll
      for (int block = 0; block < Traits::kColumnBlocks; ++block) {
        ptx::tma_load_4d(dst + block * static_cast<uint32_t>(Traits::kKVBlockBytes) +
                             static_cast<uint32_t>(box * box_rows) * Traits::kRowBytes,
                         map, full, block * 64, heads_first ? tile.kv_head : row_in_page,
                         heads_first ? row_in_page : tile.kv_head, page);
      }
    }
    if (lane != 0) ptx::mbarrier_arrive(full);
  }

  const PrefillParams& params_;
  const AttentionProblem& problem_;
  PrefillSmem<Traits> smem_;
};

}  // namespace tessera::detail::sm90
