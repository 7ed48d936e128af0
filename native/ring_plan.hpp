// The staged road's plan (issue 46 item 3): rows too small for a descriptor each go through a ring of
// staging chunks (4 x 8 MiB per direction by default). A call's rows, sorted by slot, are cut into chunks
// of chunk_rows; chunk k uses ring buffer k % ring size. Per chunk: the GPU block ids the capped gather/
// scatter kernel copies (chunk row i <-> block ids[starts[k] + i]), and one descriptor per run of
// consecutive slots between the chunk and the slab (cut at dma_rows), all issued as one batch per chunk.
// Pure C++ over arrays, no driver (the ids are checked by check_ids first).
#pragma once
#include <cstring>
#include <numeric>

#include "copy_plan.hpp"

namespace tkv {

// The staged kernel's parameters in order (cuLaunchKernel's kernelParams point at each field), as
// ring_kernel.py's _ring_kernel takes them: widths, strides, columns and chunk_row in elements of elem bytes.
struct RingArgs {
    u64 ids, gpu_addr, gpu_stride, widths, cols;  // device int64 arrays
    i64 chunk_addr, chunk_row;
    int n_rows, n_regions;
};

// What the kernel does, on the host: the fake driver's launch, and the reference the tests compare with.
inline void ring_reference(const RingArgs& a, i64 elem, bool load) {
    auto at = [](u64 base, i64 i) { return reinterpret_cast<const i64*>(base)[i]; };
    for (i64 item = 0; item < static_cast<i64>(a.n_rows) * a.n_regions; ++item) {
        const i64 row = item / a.n_regions, r = item % a.n_regions;
        char* gpu = reinterpret_cast<char*>(at(a.gpu_addr, r) + at(a.ids, row) * at(a.gpu_stride, r) * elem);
        char* host = reinterpret_cast<char*>(a.chunk_addr + (row * a.chunk_row + at(a.cols, r)) * elem);
        const size_t bytes = static_cast<size_t>(at(a.widths, r) * elem);
        if (load) std::memcpy(gpu, host, bytes);
        else std::memcpy(host, gpu, bytes);
    }
}

struct RingPlan {
    std::vector<i64> gpu;     // GPU block ids in slab order: chunk k's rows are [starts[k], starts[k + 1])
    std::vector<i64> starts;  // chunk boundaries, chunks + 1 entries
    std::vector<i64> chunk;   // per descriptor: its chunk
    Descriptors desc;         // chunk rows <-> slab rows (store: chunk -> slab)
    void clear() { gpu.clear(); starts.clear(); chunk.clear(); desc.clear(); }
};

// row_bytes: one block's bytes (a chunk row); slab rows are slab_stride apart (>= row_bytes: merged runs only
// when equal). ring: the staging buffers' addresses, each holding chunk_rows rows.
inline void plan_ring(const i64* gpu_ids, const i64* slots, i64 n, bool store, u64 slab_base, i64 slab_stride,
                      i64 row_bytes, const std::vector<u64>& ring, i64 chunk_rows, i64 dma_rows, RingPlan& out,
                      std::vector<i64>& order) {
    out.clear();
    if (ring.empty() || chunk_rows < 1 || row_bytes < 1 || slab_stride < row_bytes)
        fail(Err::Transfer, "ring plan: " + S(static_cast<i64>(ring.size())) + " buffers of " + S(chunk_rows) + " rows of " +
                                S(row_bytes) + " bytes, slab stride " + S(slab_stride) + ": need >= 1 buffer, >= 1 row, stride >= row");
    out.starts.push_back(0);
    if (n <= 0) return;
    order.resize(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), i64(0));
    std::stable_sort(order.begin(), order.end(), [slots](i64 a, i64 b) { return slots[a] < slots[b]; });
    for (i64 i = 0; i < n; ++i) out.gpu.push_back(gpu_ids[order[i]]);
    const bool dense = slab_stride == row_bytes;
    for (i64 c0 = 0, k = 0; c0 < n; c0 += chunk_rows, ++k) {
        const i64 c1 = std::min(n, c0 + chunk_rows);
        out.starts.push_back(c1);
        const u64 buf = ring[static_cast<size_t>(k) % ring.size()];
        for (i64 a = c0; a < c1;) {  // runs of consecutive slots within the chunk
            const i64 s0 = slots[order[a]];
            i64 b = a + 1;
            while (dense && b < c1 && slots[order[b]] == s0 + (b - a) && (dma_rows <= 0 || (s0 + (b - a)) % dma_rows != 0)) ++b;
            const u64 staged = buf + static_cast<u64>((a - c0) * row_bytes);
            const u64 slab = slab_base + static_cast<u64>(s0 * slab_stride);
            const u64 bytes = static_cast<u64>((b - a) * row_bytes);
            if (store) out.desc.add(staged, slab, bytes);
            else out.desc.add(slab, staged, bytes);
            out.chunk.push_back(k);
            a = b;
        }
    }
}

}  // namespace tkv
