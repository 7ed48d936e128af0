// Python bindings of the direct copy road (issue 46): _core.DirectCopier, _core.direct_plan and
// _core.check_copy_ids (every engine's id check; the direct road's own, for property tests too), and _core.fake_cuda (the fake driver's test
// controls). bind.cpp calls bind_direct(m) once.
#pragma once
#include "convert.hpp"
#include "direct_copy.hpp"
#include "fake_driver.hpp"

namespace tkv {

// Regions as (gpu_base, gpu_stride, row_bytes, host_base, host_stride, host_col) tuples.
inline std::vector<PlanRegion> direct_regions(const std::vector<std::array<i64, 6>>& rows) {
    std::vector<PlanRegion> out;
    for (size_t r = 0; r < rows.size(); ++r) {
        const auto& x = rows[r];
        if (x[1] < 0 || x[2] < 0 || x[4] < 0 || x[5] < 0)
            raise(Err::Transfer, "direct copy: region " + S(static_cast<i64>(r)) + " has a bad geometry (gpu stride " + S(x[1]) +
                                     ", row bytes " + S(x[2]) + ", slab stride " + S(x[4]) + ", column " + S(x[5]) + ")");
        out.push_back(PlanRegion{static_cast<u64>(x[0]), x[1], x[2], static_cast<u64>(x[3]), x[4], x[5]});
    }
    if (out.empty()) raise(Err::Transfer, "direct copy: at least one region is needed, got 0");
    return out;
}

inline py::array_t<u64> u64_array(const std::vector<u64>& v) {
    py::array_t<u64> a(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(u64));
    return a;
}

inline void bind_direct(py::module_& m) {
    using Regions = std::vector<std::array<i64, 6>>;
    // A copy's ids as two int64 arrays, checked as the direct road checks them (check_id_arrays in
    // transfer/engines/base.py calls this for every engine; its numpy reference is tests/reference_core).
    m.def("check_copy_ids", [](py::handle src, py::handle dst, i64 src_len, i64 dst_len, const std::string& sn, const std::string& dn) {
        std::vector<i64> s = id_copy(src, sn), d = id_copy(dst, dn);  // in order: src's error first
        check_ids(s, d, src_len, dst_len, sn, dn);
        return py::make_tuple(i64_array(s.data(), static_cast<i64>(s.size())), i64_array(d.data(), static_cast<i64>(d.size())));
    }, py::arg("src"), py::arg("dst"), py::arg("src_len"), py::arg("dst_len"), py::arg("src_name"), py::arg("dst_name"));
    // The descriptors of one call (ids unchecked: use check_copy_ids first) as (src, dst, bytes) uint64 arrays.
    m.def("direct_plan", [](const Regions& regions, py::handle gpu_ids, py::handle slots, bool store, i64 dma_rows) {
        std::vector<i64> g = id_copy(gpu_ids, "gpu block id"), s = id_copy(slots, "cpu slot");
        if (g.size() != s.size()) raise(Err::Transfer, "direct_plan: " + S(static_cast<i64>(g.size())) + " ids vs " + S(static_cast<i64>(s.size())) + " slots");
        Descriptors d;
        std::vector<i64> order;
        plan_descriptors(direct_regions(regions), g.data(), s.data(), static_cast<i64>(g.size()), store, dma_rows, d, order);
        return py::make_tuple(u64_array(d.src), u64_array(d.dst), u64_array(std::vector<u64>(d.bytes.begin(), d.bytes.end())));
    }, py::arg("regions"), py::arg("gpu_ids"), py::arg("slots"), py::arg("store"), py::arg("dma_rows") = 0);

    // The staged road's plan (ring_plan.hpp, ids unchecked): (gpu ids in slab order, chunk starts, chunk of
    // each descriptor, src, dst, bytes).
    m.def("ring_plan", [](py::handle gpu_ids, py::handle slots, bool store, u64 slab_base, i64 slab_stride, i64 row_bytes,
                          const std::vector<u64>& ring, i64 chunk_rows, i64 dma_rows) {
        std::vector<i64> g = id_copy(gpu_ids, "gpu block id"), s = id_copy(slots, "cpu slot");
        if (g.size() != s.size()) raise(Err::Transfer, "ring_plan: " + S(static_cast<i64>(g.size())) + " ids vs " + S(static_cast<i64>(s.size())) + " slots");
        RingPlan p;
        std::vector<i64> order;
        plan_ring(g.data(), s.data(), static_cast<i64>(g.size()), store, slab_base, slab_stride, row_bytes, ring, chunk_rows, dma_rows, p, order);
        auto i64s = [](const std::vector<i64>& v) { return py::array_t<i64>(static_cast<py::ssize_t>(v.size()), v.data()); };
        return py::make_tuple(i64s(p.gpu), i64s(p.starts), i64s(p.chunk), u64_array(p.desc.src), u64_array(p.desc.dst),
                              u64_array(std::vector<u64>(p.desc.bytes.begin(), p.desc.bytes.end())));
    }, py::arg("gpu_ids"), py::arg("slots"), py::arg("store"), py::arg("slab_base"), py::arg("slab_stride"), py::arg("row_bytes"),
       py::arg("ring"), py::arg("chunk_rows"), py::arg("dma_rows") = 0);

    py::class_<DirectCopier>(m, "DirectCopier")
        // driver: "cuda" (libcuda through cuGetProcAddress) or "fake:VERSION" (fake_cuda, for tests).
        .def(py::init([](const std::string& driver, int device, const Regions& regions, i64 num_blocks, i64 num_slots, i64 dma_rows,
                         int max_inflight) {
            if (max_inflight < 1) raise(Err::Transfer, "direct copy: max_inflight must be at least 1, got " + S(max_inflight));
            cu::Driver d;
            if (driver.rfind("fake:", 0) == 0) {
                d = fake::driver(std::stoi(driver.substr(5)));
            } else if (driver == "cuda") {
                std::string why = cu::load_driver(d);
                if (!why.empty()) raise(Err::Transfer, "direct copy path: " + why);
            } else {
                raise(Err::Transfer, "direct copy: driver must be cuda or fake:VERSION, got " + driver);
            }
            auto rs = direct_regions(regions);
            py::gil_scoped_release unlocked;
            return new DirectCopier(d, device, std::move(rs), num_blocks, num_slots, dma_rows, max_inflight);
        }), py::arg("driver"), py::arg("device"), py::arg("regions"), py::arg("num_blocks"), py::arg("num_slots"), py::arg("dma_rows") = 0,
            py::arg("max_inflight") = 4)
        // One call: direction 0 store (src: gpu ids, dst: slots) or 1 load; ready 0 none, 1 event, 2 stream.
        .def("submit", [](DirectCopier& c, int direction, py::handle src, py::handle dst, int ready, u64 handle) {
            if (direction != 0 && direction != 1) raise(Err::Transfer, "direct copy: direction must be 0 or 1, got " + S(direction));
            const std::string gpu = "gpu block id", slot = "cpu slot";
            const std::string& sn = direction == 0 ? gpu : slot;
            const std::string& dn = direction == 0 ? slot : gpu;
            std::vector<i64> s = id_copy(src, sn), d = id_copy(dst, dn);
            py::gil_scoped_release unlocked;
            return c.submit(direction, std::move(s), std::move(d), ready, handle, sn, dn).first;
        }, py::arg("direction"), py::arg("src"), py::arg("dst"), py::arg("ready") = 0, py::arg("handle") = 0)
        // A layered load: edge[i] marks block i as copied whole first (mark 0), then groups[g] (mark 1 + g).
        .def("submit_layered", [](DirectCopier& c, py::handle slots, py::handle gpu_ids, const std::vector<int>& edge,
                                  const std::vector<std::vector<int>>& groups, int ready, u64 handle) {
            auto layers = std::make_shared<Layers>();
            for (int e : edge) layers->edge.push_back(static_cast<char>(e != 0));
            for (size_t g = 0; g < groups.size(); ++g)
                for (int r : groups[g])
                    if (r < 0 || static_cast<size_t>(r) >= c.num_regions())
                        raise(Err::Transfer, "direct copy: layer group " + S(static_cast<i64>(g)) + " names region " + S(r) + " of " + S(static_cast<i64>(c.num_regions())));
            layers->groups = groups;
            std::vector<i64> s = id_copy(slots, "cpu slot"), d = id_copy(gpu_ids, "gpu block id");
            py::gil_scoped_release unlocked;
            return c.submit(1, std::move(s), std::move(d), ready, handle, "cpu slot", "gpu block id", std::move(layers)).first;
        }, py::arg("slots"), py::arg("gpu_ids"), py::arg("edge"), py::arg("groups"), py::arg("ready") = 0, py::arg("handle") = 0)
        .def("wait", [](DirectCopier& c, int direction, u64 seq, double timeout_s) {
            if (direction != 0 && direction != 1) raise(Err::Transfer, "direct copy: direction must be 0 or 1, got " + S(direction));
            py::gil_scoped_release unlocked;
            return c.wait(direction, seq, timeout_s);
        }, py::arg("direction"), py::arg("seq"), py::arg("timeout_s") = -1.0)
        .def("wait_mark", [](DirectCopier& c, u64 seq, size_t mark, u64 stream, double timeout_s) {
            py::gil_scoped_release unlocked;
            return c.wait_mark(seq, mark, stream, timeout_s);
        }, py::arg("seq"), py::arg("mark"), py::arg("stream"), py::arg("timeout_s") = -1.0)
        // The staged road (staged_issue.hpp): functions (gather, scatter), the region table's 4 device arrays, the
        // rings and the ids slots per direction (store, load).
        .def("set_staged", [](DirectCopier& c, std::array<u64, 2> functions, unsigned threads, unsigned shared, unsigned programs,
                              unsigned scratch, std::array<u64, 4> table, i64 elem, i64 row_bytes, i64 n_regions, u64 slab_base,
                              i64 slab_stride, i64 chunk_rows, i64 max_rows, std::array<std::vector<u64>, 2> rings,
                              std::array<u64, 2> ids_host, std::array<u64, 2> ids_dev) {
            auto r = std::make_unique<StagedRoad>();
            std::copy(functions.begin(), functions.end(), r->function);
            r->threads = threads, r->shared = shared, r->programs = programs, r->scratch = scratch;
            std::copy(table.begin(), table.end(), r->table);
            r->elem = elem, r->row_bytes = row_bytes, r->n_regions = n_regions, r->slab_base = slab_base, r->slab_stride = slab_stride;
            r->chunk_rows = chunk_rows, r->max_rows = max_rows;
            for (int i = 0; i < 2; ++i) r->ring[i] = rings[i], r->ids_host[i] = ids_host[i], r->ids_dev[i] = ids_dev[i];
            c.set_staged(std::move(r));
        }, py::arg("functions"), py::arg("threads"), py::arg("shared"), py::arg("programs"), py::arg("scratch"), py::arg("table"),
           py::arg("elem"), py::arg("row_bytes"), py::arg("n_regions"), py::arg("slab_base"), py::arg("slab_stride"),
           py::arg("chunk_rows"), py::arg("max_rows"), py::arg("rings"), py::arg("ids_host"), py::arg("ids_dev"))
        .def_property_readonly("staged", &DirectCopier::staged)
        .def("inflight", &DirectCopier::inflight)
        .def_property_readonly("max_inflight", &DirectCopier::max_inflight)
        .def("poll", [](DirectCopier& c) {
            auto r = c.poll();
            py::list errors;
            for (auto& e : r.second) errors.append(py::make_tuple(std::get<0>(e), std::get<1>(e), std::get<2>(e)));
            return py::make_tuple(r.first[0], r.first[1], errors);
        })
        .def("close", [](DirectCopier& c) { py::gil_scoped_release unlocked; c.close(); })
        .def_property_readonly("fd", &DirectCopier::fd)
        .def_property_readonly("closed", &DirectCopier::closed)
        .def_property_readonly("submits", &DirectCopier::submits)
        .def_property_readonly("driver_version", [](const DirectCopier& c) { return c.driver().version; })
        .def_property_readonly("batched", [](const DirectCopier& c) { return c.driver().has_batch(); })
        .def("stream", &DirectCopier::stream)
        .def("last_descriptors", &DirectCopier::last_descriptors);

    py::module_ f = m.def_submodule("fake_cuda", "the fake CUDA driver's controls (tests only)");
    auto ok = [](cu::CUresult rc, const char* what) { if (rc != cu::SUCCESS) raise(Err::Transfer, std::string("fake_cuda.") + what + ": CUresult " + S(rc)); };
    f.def("stream_create", [ok]() { cu::CUstream s; ok(fake::stream_create(&s, 0), "stream_create"); return reinterpret_cast<u64>(s); });
    f.def("stream_destroy", [ok](u64 s) { ok(fake::stream_destroy(reinterpret_cast<cu::CUstream>(s)), "stream_destroy"); });
    f.def("event_create", [ok]() { cu::CUevent e; ok(fake::event_create(&e, 0), "event_create"); return reinterpret_cast<u64>(e); });
    f.def("event_destroy", [ok](u64 e) { ok(fake::event_destroy(reinterpret_cast<cu::CUevent>(e)), "event_destroy"); });
    f.def("record", [ok](u64 e, u64 s) { ok(fake::event_record(reinterpret_cast<cu::CUevent>(e), reinterpret_cast<cu::CUstream>(s)), "record"); });
    f.def("query", [](u64 e) { return fake::event_query(reinterpret_cast<cu::CUevent>(e)) == cu::SUCCESS; });
    f.def("hold", [](u64 s, bool held) { py::gil_scoped_release u; fake::hold(reinterpret_cast<cu::CUstream>(s), held); }, py::arg("stream"), py::arg("held") = true);
    f.def("step", [](u64 s, long long records) { py::gil_scoped_release u; fake::step(reinterpret_cast<cu::CUstream>(s), records); }, py::arg("stream"), py::arg("records") = 1);
    f.def("ring_function", [](bool load, int elem) { return reinterpret_cast<u64>(fake::ring_function(load, elem)); },
          py::arg("load"), py::arg("elem"));
    f.def("fail_batches", [](int n) { std::lock_guard<std::mutex> l(fake::device().mu); fake::device().fail_batches = n; });
    f.def("move_bytes", [](bool on) { std::lock_guard<std::mutex> l(fake::device().mu); fake::device().move_bytes = on; });
    f.def("counts", []() { std::lock_guard<std::mutex> l(fake::device().mu); return fake::device().counts; });
    f.def("reset_counts", []() { std::lock_guard<std::mutex> l(fake::device().mu); fake::device().counts.clear(); });
    f.def("live", []() {  // (events, streams) not destroyed yet: a closed engine leaves none of its own
        std::lock_guard<std::mutex> l(fake::device().mu);
        return py::make_tuple(fake::device().events.size(), fake::device().streams.size());
    });
}

}  // namespace tkv
