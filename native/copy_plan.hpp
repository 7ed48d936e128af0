// The direct road's copy plan (issue 46): GPU rows <-> pinned slab rows as (src, dst, bytes) descriptors.
// Pure C++ over arrays, no driver: the ids are checked (the messages of base.py's check_id_arrays), sorted
// by slot, and every (block, region) becomes one descriptor, except that rows consecutive on both sides
// merge into one when the region's rows are dense on both sides (GPU stride == slab stride == row bytes).
// No descriptor crosses a multiple of dma_rows slab rows (the pinned slab is registered in chunks).
#pragma once
#include <numeric>

#include "common.hpp"

namespace tkv {

// One region of the direct road: its GPU rows and where its bytes sit in the slab's rows.
struct PlanRegion {
    u64 gpu_base;      // address of GPU row 0
    i64 gpu_stride;    // bytes between GPU rows (block ids)
    i64 row_bytes;     // bytes of one row of this region
    u64 host_base;     // address of slab row 0
    i64 host_stride;   // bytes between slab rows (slots)
    i64 host_col;      // the region's first byte in a slab row
    bool dense() const { return gpu_stride == row_bytes && host_stride == row_bytes; }
};

struct Descriptors {
    std::vector<u64> src, dst;
    std::vector<size_t> bytes;
    void clear() { src.clear(); dst.clear(); bytes.clear(); }
    size_t size() const { return src.size(); }
    void add(u64 s, u64 d, u64 n) { src.push_back(s); dst.push_back(d); bytes.push_back(static_cast<size_t>(n)); }
};

// Raise TransferError (CoreError, Err::Transfer) unless the ids are in range and no destination repeats.
inline void check_ids(const std::vector<i64>& src, const std::vector<i64>& dst, i64 src_len, i64 dst_len,
                      const std::string& src_name, const std::string& dst_name) {
    const i64 n = static_cast<i64>(src.size());
    if (static_cast<i64>(dst.size()) != n)
        fail(Err::Transfer, "length mismatch: " + S(n) + " " + src_name + "s vs " + S(static_cast<i64>(dst.size())) + " " + dst_name + "s");
    for (int side = 0; side < 2; ++side) {
        const std::vector<i64>& ids = side == 0 ? src : dst;
        const i64 len = side == 0 ? src_len : dst_len;
        for (i64 x : ids)
            if (x < 0 || x >= len) fail(Err::Transfer, (side == 0 ? src_name : dst_name) + " " + S(x) + " out of range [0, " + S(len) + ")");
    }
    if (n > 1) {
        std::vector<i64> s(dst);
        std::sort(s.begin(), s.end());
        auto rep = std::adjacent_find(s.begin(), s.end());
        if (rep != s.end()) fail(Err::Transfer, "duplicate " + dst_name + " " + S(*rep) + " in one batch");
    }
}

// Descriptors of one call: block gpu_ids[i] <-> slot slots[i] for every region (ids already checked).
// store: GPU -> slab (src is the GPU row); else slab -> GPU. dma_rows <= 0: no registration chunks.
// only: the indices of the regions to copy (a layer group of a layered load); null: every region.
inline void plan_descriptors(const std::vector<PlanRegion>& regions, const i64* gpu_ids, const i64* slots, i64 n,
                             bool store, i64 dma_rows, Descriptors& out, std::vector<i64>& order,
                             const std::vector<int>* only = nullptr) {
    out.clear();
    if (n <= 0) return;
    order.resize(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), i64(0));
    bool sorted = true;
    for (i64 i = 1; i < n && sorted; ++i) sorted = slots[i] > slots[i - 1];
    if (!sorted) std::sort(order.begin(), order.end(), [slots](i64 a, i64 b) { return slots[a] < slots[b]; });
    // Runs in slot order where both the slots and the GPU ids are consecutive, cut at dma_rows multiples.
    i64 a = 0;
    while (a < n) {
        const i64 s0 = slots[order[a]], g0 = gpu_ids[order[a]];
        i64 b = a + 1;
        while (b < n && slots[order[b]] == s0 + (b - a) && gpu_ids[order[b]] == g0 + (b - a) &&
               (dma_rows <= 0 || (s0 + (b - a)) % dma_rows != 0))
            ++b;
        const i64 rows = b - a;
        const size_t count = only ? only->size() : regions.size();
        for (size_t q = 0; q < count; ++q) {
            const PlanRegion& r = regions[only ? static_cast<size_t>((*only)[q]) : q];
            if (r.row_bytes == 0) continue;
            const i64 per = r.dense() ? rows : 1;  // rows merged into one descriptor
            for (i64 k = 0; k < rows; k += per) {
                const u64 g = r.gpu_base + static_cast<u64>((g0 + k) * r.gpu_stride);
                const u64 h = r.host_base + static_cast<u64>((s0 + k) * r.host_stride + r.host_col);
                const u64 bytes = static_cast<u64>(per * r.row_bytes);
                if (store) out.add(g, h, bytes);
                else out.add(h, g, bytes);
            }
        }
        a = b;
    }
}

}  // namespace tkv
