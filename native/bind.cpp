// tiered_kv._core: the bookkeeping core's Python bindings (pybind11). Each method is one batch.
#include <pybind11/stl.h>

#include "convert.hpp"
#include "direct_bind.hpp"
#include "policy_core.hpp"
#include "rows.hpp"
#include "tier.hpp"

using namespace tkv;

namespace {

// (start, length) pairs as an int64 array of shape (r, 2).
py::array_t<i64> runs_array(const std::vector<std::pair<i64, i64>>& runs) {
    py::array_t<i64> out({static_cast<py::ssize_t>(runs.size()), static_cast<py::ssize_t>(2)});
    i64* o = out.mutable_data();
    for (size_t i = 0; i < runs.size(); ++i) {
        o[2 * i] = runs[i].first;
        o[2 * i + 1] = runs[i].second;
    }
    return out;
}

u64 seed_word(const py::bytes& seeds, int i) {
    std::string s = seeds;
    if (s.size() < 8 * static_cast<size_t>(i + 1)) raise(Err::Tier, "core seeds must be 32 bytes");
    u64 w;
    std::memcpy(&w, s.data() + 8 * i, 8);
    return w;
}

Kind kind_of(int k) {
    if (k < 0 || k > 2) raise(Err::Tier, "unknown policy kind " + S(k));
    return static_cast<Kind>(k);
}

// A standalone key table (the remote tier's residency filter uses one).
struct KeyIndex {
    KeyTable t;
    KeyIndex(i64 n, int kb, const py::bytes& seeds)
        : t(n, kb, seed_word(seeds, 0), seed_word(seeds, 1), seed_word(seeds, 2)) {}
};

py::array_t<i64> find_all(const KeyTable& t, const KeyArgs& k) {
    py::array_t<i64> out(k.size());
    i64* o = out.mutable_data();
    for (i64 i = 0; i < k.size(); ++i) o[i] = t.find(k.ptr[static_cast<size_t>(i)]);
    return out;
}

py::list keys_list(const KeyTable& t, const SlotArgs& s, const char* op) {
    py::list out(s.n);
    for (i64 i = 0; i < s.n; ++i) {
        if (!t.held(s.p[i])) raise(Err::Tier, std::string(op) + ": slot " + S(s.p[i]) + " holds no key");
        out[static_cast<size_t>(i)] = py::bytes(reinterpret_cast<const char*>(t.key_at(s.p[i])), static_cast<size_t>(t.key_bytes()));
    }
    return out;
}

// Where each key is: its CPU slot and whether READY; for a key with no CPU entry in any state, its
// disk slot and whether READY; pending: RESERVED in the CPU tier, or in the disk tier (being spilled).
// The disk tier hashes keys of its own length out of buffers copied at the CPU's: they must agree.
void same_key_length(const Tier& cpu, const Tier* disk, const char* op) {
    if (disk && disk->keys().key_bytes() != cpu.keys().key_bytes())
        raise(Err::Tier, std::string(op) + ": the tiers use different key lengths: " + cpu.name() + " " +
                             S(cpu.keys().key_bytes()) + " bytes, " + disk->name() + " " + S(disk->keys().key_bytes()));
}

py::tuple locate(Tier& cpu, Tier* disk, py::handle keys) {
    same_key_length(cpu, disk, "locate");
    KeyArgs k = key_args(keys, cpu.keys().key_bytes());
    i64 n = k.size();
    py::array_t<i64> cs(n), ds(n);
    py::array_t<bool> cr(n), dr(n), pend(n);
    i64 *c = cs.mutable_data(), *d = ds.mutable_data();
    bool *crp = cr.mutable_data(), *drp = dr.mutable_data(), *pp = pend.mutable_data();
    for (i64 i = 0; i < n; ++i) {
        const u8* key = k.ptr[static_cast<size_t>(i)];
        i64 s = cpu.keys().find(key);
        c[i] = s;
        d[i] = -1;
        crp[i] = s >= 0 && cpu.state(s) == READY;
        pp[i] = s >= 0 && cpu.state(s) == RESERVED;
        drp[i] = false;
        if (s < 0 && disk) {
            i64 x = disk->keys().find(key);
            d[i] = x;
            drp[i] = x >= 0 && disk->state(x) == READY;
            pp[i] = x >= 0 && disk->state(x) == RESERVED;
        }
    }
    return py::make_tuple(cs, cr, ds, dr, pend);
}

// The engine's GPU block ids of a call as int64, checked (distinct, in [0, num_blocks)) in one pass;
// None for anything but a list/tuple of plain ints or a 1-D integer array (ids.py names the culprit).
py::object block_ids(py::handle obj, i64 num_blocks) {
    std::vector<i64> v;
    PyObject* o = obj.ptr();
    if (PyList_Check(o) || PyTuple_Check(o)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
        PyObject** items = PySequence_Fast_ITEMS(o);
        v.resize(static_cast<size_t>(n));
        for (Py_ssize_t i = 0; i < n; ++i) {
            if (!PyLong_CheckExact(items[i])) return py::none();
            int overflow = 0;
            long long x = PyLong_AsLongLongAndOverflow(items[i], &overflow);
            if (overflow) return py::none();
            v[static_cast<size_t>(i)] = x;
        }
    } else if (py::isinstance<py::array>(obj)) {
        py::array a = py::reinterpret_borrow<py::array>(obj);
        if (a.ndim() != 1 || (a.dtype().kind() != 'i' && a.dtype().kind() != 'u')) return py::none();
        auto c = py::array_t<i64, py::array::c_style | py::array::forcecast>::ensure(a);
        if (!c) throw py::error_already_set();
        v.assign(c.data(), c.data() + c.size());
    } else {
        return py::none();
    }
    i64 n = static_cast<i64>(v.size());
    for (i64 i = 0; i < n; ++i)
        if (v[i] < 0 || v[i] >= num_blocks)
            raise(Err::BlockId, "gpu_block_ids[" + S(i) + "] = " + S(v[i]) + " is out of range [0, " + S(num_blocks) + ")");
    if (repeated_id(v.data(), n) >= 0) raise(Err::BlockId, "gpu_block_ids contains duplicates: one GPU block cannot hold two keys");
    return i64_array(v.data(), n);
}

// Two sides of row-major uint8 regions (side 0: the engine's blocks, side 1: the CPU slab's rows).
struct Rows {
    std::vector<Region> side[2];
    std::string name[2];
    py::list hold;  // the arrays whose memory the regions point into
};

std::vector<Region> regions_of(py::handle list, Rows& rows, int side) {
    std::vector<Region> out;
    for (py::handle item : list) {
        if (!py::isinstance<py::array>(item)) raise(Err::Transfer, "rows: side " + S(side) + " holds a non-array region");
        py::array a = py::reinterpret_borrow<py::array>(item);
        if (a.dtype().kind() != 'u' || a.itemsize() != 1 || a.ndim() != 2 || a.strides(1) != 1 || !a.writeable() ||
            a.strides(0) < a.shape(1))
            raise(Err::Transfer, "rows: regions must be writable 2-D uint8 arrays with dense, non-overlapping rows");
        out.push_back(Region{static_cast<u8*>(a.mutable_data()), a.shape(0), a.strides(0), a.shape(1)});
        rows.hold.append(a);
    }
    return out;
}

}  // namespace

#include "bind_tier.hpp"  // parts of this file, after the helpers above
#include "bind_rows_keys.hpp"

PYBIND11_MODULE(_core, m) {
    m.doc() = "tiered_kv's bookkeeping core: key tables, tier indexes and eviction policies";
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const CoreError& e) {
            py::object& cls = error_class(e.kind);
            PyErr_SetString(cls ? cls.ptr() : PyExc_RuntimeError, e.what());
        }
    });
    m.def("set_errors", [](py::object tier, py::object key, py::object slot, py::object transfer, py::object block_id) {
        error_class(Err::Tier) = tier;
        error_class(Err::Key) = key;
        error_class(Err::Slot) = slot;
        error_class(Err::Transfer) = transfer;
        error_class(Err::BlockId) = block_id;
    });
    m.def("block_ids", &block_ids, py::arg("ids"), py::arg("num_blocks"));
    m.def("slot_runs", [](py::handle obj) {
        py::array a = py::array::ensure(obj);
        if (!a) throw py::error_already_set();
        if (a.size() == 0) return i64{0};
        if (a.ndim() != 1 || (a.dtype().kind() != 'i' && a.dtype().kind() != 'u'))
            raise(Err::Slot, "slot_runs: slots must be 1-D integers, got " + std::string(py::str(a.dtype())) + " of " + S(a.ndim()) + " dims");
        auto c = py::array_t<i64, py::array::c_style | py::array::forcecast>::ensure(a);
        if (!c) throw py::error_already_set();
        return count_runs(c.data(), c.size());
    }, py::arg("slots"));
#ifdef TKV_DEBUG
    m.attr("DEBUG") = true;
#else
    m.attr("DEBUG") = false;
#endif
    m.attr("FREE") = FREE;
    m.attr("RESERVED") = RESERVED;
    m.attr("READY") = READY;
    m.attr("WINDOW_GHOSTS") = py::make_tuple(WINDOW_GHOSTS[0], WINDOW_GHOSTS[1]);
    m.attr("MAX_SLOTS") = MAX_SLOTS;
    m.attr("GHOST_BYTES") = 25;  // per ghost at the bound (lists.hpp)
    m.def("leading_run", [](const Tier& cpu, const Tier* disk, py::handle keys) {
        same_key_length(cpu, disk, "leading_run");
        KeyArgs k = key_args(keys, cpu.keys().key_bytes());
        i64 counts[2];
        i64 run = cpu.leading_run(disk, k.data(), k.size(), counts);
        return py::make_tuple(run, counts[0], counts[1]);
    }, py::arg("cpu"), py::arg("disk").none(true), py::arg("keys"));
    m.def("locate", &locate, py::arg("cpu"), py::arg("disk").none(true), py::arg("keys"));

    // One policy over a CPU tier and the disk tier below it (domain.hpp); attach both while empty.
    py::class_<Domain>(m, "Domain")
        .def(py::init([](int kind, i64 cpu, i64 disk, const py::bytes& seeds, double start, double low, double high) {
            if (cpu <= 0 || disk <= 0 || cpu + disk > MAX_SLOTS)
                raise(Err::Tier, "a hierarchy needs 1 .. " + S(MAX_SLOTS) + " slots in all (MAX_SLOTS), got " + S(cpu) + " + " + S(disk));
            return new Domain(kind_of(kind), cpu, disk, seed_word(seeds, 3), start, low, high);
        }))
        // Each tier keeps the domain alive (its lists, tags and pins view outlive neither tier); the
        // tiers refer to each other, and one freed first detaches (Tier::~Tier: the other refuses).
        .def("attach", [](Domain& d, Tier& cpu, Tier& disk) { Tier::attach_pair(d, cpu, disk); },
             py::arg("cpu"), py::arg("disk"), py::keep_alive<2, 1>(), py::keep_alive<3, 1>())
        .def_property_readonly("p", [](const Domain& d) { return d.policy.p(); })
        .def_property_readonly("policy_len", [](const Domain& d) { return d.policy.size(); })
        .def("history_sizes", [](const Domain& d) { return py::make_tuple(d.history.size(0), d.history.size(1)); })
        .def("ghost_sizes", [](const Domain& d) { return py::make_tuple(d.policy.ghosts().size(0), d.policy.ghosts().size(1)); })
        .def_property_readonly("nbytes", &Domain::nbytes);

    // The free-slot allocator on its own (free_runs.hpp), for its property tests.
    py::class_<FreeRuns>(m, "FreeRuns")
        .def(py::init([](i64 n) {
            if (n < 0 || n > MAX_SLOTS) raise(Err::Tier, "free runs need 0 .. " + S(MAX_SLOTS) + " slots, got " + S(n));
            return new FreeRuns(n);
        }))
        .def_property_readonly("count", &FreeRuns::count)
        .def_property_readonly("num_runs", &FreeRuns::num_runs)
        .def_property_readonly("nbytes", &FreeRuns::nbytes)
        .def("runs", [](const FreeRuns& f) { return runs_array(f.runs()); })
        .def("take", [](FreeRuns& f, i64 m) {
            if (m < 0 || m > f.count()) raise(Err::Tier, "take(" + S(m) + ") of " + S(f.count()) + " free slots");
            std::vector<i64> out(static_cast<size_t>(m));
            f.take(m, out.data());
            return i64_array(out.data(), m);
        })
        .def("give", [](FreeRuns& f, py::handle s) {
            std::vector<i64> v = s.cast<std::vector<i64>>();
            f.give(v.data(), static_cast<i64>(v.size()));
        })
        .def("check_invariants", [](const FreeRuns& f) {
            std::vector<u8> is_free(static_cast<size_t>(f.size()), 0);
            f.check(is_free.data(), "free runs");
        });

    bind_tier(m);  // native/bind_tier.hpp
    bind_rows_keys(m);  // native/bind_rows_keys.hpp

    bind_direct(m);  // the direct copy road (issue 46): native/direct_bind.hpp
}
