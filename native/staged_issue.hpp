// The staged road's issue (issue 46 item 3), for rows too small to go to the link one descriptor each: per
// call, the GPU ids in slab order go to the device in one copy (from a pinned slot of the call's own,
// seq % max_inflight: that slot's previous call has completed, since at most max_inflight are issued); then
// per staging chunk, the capped gather kernel (a store) or one batch of slab descriptors (a load) and then
// the other. Chunk k uses ring buffer k % ring size; on one stream, a buffer is reused only after the chunk
// that used it before was drained. The kernel is launched with cuLaunchKernel on at most `programs` programs.
#pragma once
#include "batch_submit.hpp"
#include "ring_plan.hpp"

namespace tkv {

struct StagedRoad {
    u64 function[2] = {0, 0};  // CUfunction: gather (stores), scatter (loads)
    unsigned threads = 128, shared = 0, programs = 16, scratch = 0;  // scratch: trailing null pointer params
    u64 table[4] = {0, 0, 0, 0};  // the region table: gpu_addr, gpu_stride, widths, cols (device int64)
    i64 elem = 1, row_bytes = 0, n_regions = 0, chunk_rows = 0, max_rows = 0;
    u64 slab_base = 0;
    i64 slab_stride = 0;
    std::vector<u64> ring[2];        // staging buffers per direction, chunk_rows rows each
    u64 ids_host[2] = {0, 0}, ids_dev[2] = {0, 0};  // max_inflight x max_rows int64 per direction
};

// Queue one staged call on `stream`; "" or what failed (the rest is still queued up to the failure).
inline std::string issue_staged(const cu::Driver& d, const StagedRoad& st, int direction, u64 seq, size_t cap, const i64* g,
                                const i64* s, i64 n, i64 dma_rows, cu::CUstream stream, RingPlan& plan, std::vector<i64>& order,
                                Descriptors& desc) {
    const bool store = direction == 0;
    if (n > st.max_rows) return "staged call of " + S(n) + " blocks over the ids slot of " + S(st.max_rows);
    plan_ring(g, s, n, store, st.slab_base, st.slab_stride, st.row_bytes, st.ring[direction], st.chunk_rows, dma_rows, plan, order);
    if (n == 0) return "";
    const u64 slot = (seq % cap) * static_cast<u64>(st.max_rows) * sizeof(i64);
    const u64 host_ids = st.ids_host[direction] + slot, dev_ids = st.ids_dev[direction] + slot;
    std::memcpy(reinterpret_cast<void*>(host_ids), plan.gpu.data(), static_cast<size_t>(n) * sizeof(i64));
    cu::CUresult rc = d.memcpy_async(dev_ids, host_ids, static_cast<size_t>(n) * sizeof(i64), stream);
    if (rc != cu::SUCCESS) return "cuMemcpyAsync(ids) failed with CUresult " + S(rc);
    auto fn = reinterpret_cast<cu::CUfunction>(st.function[direction]);
    std::vector<void*> params(9 + st.scratch, nullptr);
    std::vector<u64> nulls(st.scratch, 0);
    size_t next = 0;
    std::string error;
    const size_t chunks = plan.starts.size() - 1;
    for (size_t k = 0; k < chunks && error.empty(); ++k) {
        desc.clear();
        for (; next < plan.chunk.size() && plan.chunk[next] == static_cast<i64>(k); ++next)
            desc.add(plan.desc.src[next], plan.desc.dst[next], plan.desc.bytes[next]);
        const i64 rows = plan.starts[k + 1] - plan.starts[k];
        RingArgs a{dev_ids + static_cast<u64>(plan.starts[k]) * sizeof(i64), st.table[0], st.table[1], st.table[2], st.table[3],
                   static_cast<i64>(st.ring[direction][k % st.ring[direction].size()]), st.row_bytes / st.elem,
                   static_cast<int>(rows), static_cast<int>(st.n_regions)};
        void* fields[9] = {&a.ids, &a.gpu_addr, &a.gpu_stride, &a.widths, &a.cols, &a.chunk_addr, &a.chunk_row, &a.n_rows, &a.n_regions};
        for (size_t i = 0; i < params.size(); ++i) params[i] = i < 9 ? fields[i] : static_cast<void*>(&nulls[i - 9]);
        const auto grid = static_cast<unsigned>(std::min<i64>(st.programs, rows * st.n_regions));
        auto launch = [&] {
            cu::CUresult r = d.launch_kernel(fn, grid, 1, 1, st.threads, 1, 1, st.shared, stream, params.data(), nullptr);
            return r == cu::SUCCESS ? std::string() : "cuLaunchKernel(chunk " + S(static_cast<i64>(k)) + ") failed with CUresult " + S(r);
        };
        error = store ? launch() : submit_batch(d, desc, stream);  // a store gathers first, a load scatters last
        if (error.empty()) error = store ? submit_batch(d, desc, stream) : launch();
    }
    return error;
}

}  // namespace tkv
