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

std::vector<i64> id_copy(py::handle obj, const std::string& name) {
    py::array a = py::array::ensure(obj);
    if (!a) {
        PyErr_Clear();
        raise(Err::Transfer, name + "s must be integers, got " + Py_TYPE(obj.ptr())->tp_name);
    }
    char k = a.dtype().kind();
    if (a.size() == 0) return {};
    if (a.ndim() != 1 || (k != 'i' && k != 'u'))
        raise(Err::Transfer, name + "s must be integers, got " + std::string(py::str(a.dtype())) + " of shape " +
                                 std::string(py::str(py::list(a.attr("shape")))));
    auto c = py::array_t<i64, py::array::c_style | py::array::forcecast>::ensure(a);
    if (!c) throw py::error_already_set();
    return std::vector<i64>(c.data(), c.data() + c.size());
}

}  // namespace

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

    py::class_<Tier>(m, "Tier")
        .def(py::init([](const std::string& name, i64 n, int kb, int kind, const py::bytes& seeds, double start,
                         double low, double high) {
            if (n <= 0 || n > MAX_SLOTS) raise(Err::Tier, "tier " + name + " needs 1 .. " + S(MAX_SLOTS) + " slots (MAX_SLOTS), got " + S(n));
            if (kb < 1) raise(Err::Tier, "key_bytes must be >= 1, got " + S(kb));
            u64 w[4] = {seed_word(seeds, 0), seed_word(seeds, 1), seed_word(seeds, 2), seed_word(seeds, 3)};
            return new Tier(name, n, kb, kind_of(kind), w, start, low, high);
        }))
        .def_property_readonly("name", &Tier::name)
        .def_property_readonly("num_slots", &Tier::num_slots)
        .def_property_readonly("key_bytes", [](const Tier& t) { return t.keys().key_bytes(); })
        .def_property_readonly("free_count", &Tier::free_count)
        .def("free_runs", [](const Tier& t) { return runs_array(t.free_runs()); })
        .def_property_readonly("n_ready", &Tier::n_ready)
        .def_property_readonly("n_reserved", &Tier::n_reserved)
        .def_property_readonly("n_ready_pinned", &Tier::n_ready_pinned)
        .def_property_readonly("evictable", &Tier::evictable)
        .def_property_readonly("evicted_cold", &Tier::evicted_cold)
        .def_property_readonly("cold_size", &Tier::cold_size)
        .def_property_readonly("n_keys", [](const Tier& t) { return t.keys().size(); })
        .def_property_readonly("core_nbytes", &Tier::nbytes)
        .def_property_readonly("ghost_nbytes", [](const Tier& t) { return t.policy().nbytes(); })
        // The views share the tier's arrays, not the tier (convert.hpp): they outlive it, and a
        // TierIndex that stores them is still freed when dropped.
        .def("state_view", [](Tier& t) {
            return readonly_view(py::dtype::of<u8>(), {t.num_slots()}, t.state_data(), t.share_state());
        })
        .def("pins_view", [](Tier& t) {
            return readonly_view(py::dtype::of<u16>(), {t.num_slots()}, t.pins_data(), t.share_pins());
        })
        .def("keys_view", [](Tier& t) {
            std::vector<py::ssize_t> shape{t.num_slots(), t.keys().key_bytes()};
            return readonly_view(py::dtype::of<u8>(), shape, t.keys().keys_data(), t.keys().share_keys());
        })
        .def("find", [](const Tier& t, py::handle keys) { return find_all(t.keys(), key_args(keys, t.keys().key_bytes())); })
        .def("find_ready", [](const Tier& t, py::handle keys) {
            KeyArgs k = key_args(keys, t.keys().key_bytes());
            py::array_t<i64> out(k.size());
            i64* o = out.mutable_data();
            for (i64 i = 0; i < k.size(); ++i) o[i] = t.find_ready(k.ptr[static_cast<size_t>(i)]);
            return out;
        })
        .def("reserve", [](Tier& t, py::handle keys) {
            KeyArgs k = key_args(keys, t.keys().key_bytes());
            std::vector<i64> out(static_cast<size_t>(std::min(k.size(), t.free_count())));
            i64 got = t.reserve(k.data(), k.size(), out.data());
            return i64_array(out.data(), got);
        })
        .def("reassign", [](Tier& t, py::handle slots, py::handle keys) {
            SlotArgs s = slot_args(slots, t.num_slots(), "reassign");
            KeyArgs k = key_args(keys, t.keys().key_bytes());
            if (k.size() != s.n) raise(Err::Tier, "reassign got " + S(k.size()) + " keys but " + S(s.n) + " slots");
            t.reassign(s.p, s.n, k.data());
        })
        .def("commit", [](Tier& t, py::handle s) { SlotArgs a = slot_args(s, t.num_slots(), "commit"); t.commit(a.p, a.n); })
        .def("abort", [](Tier& t, py::handle s) { SlotArgs a = slot_args(s, t.num_slots(), "abort"); t.abort(a.p, a.n); })
        .def("drop", [](Tier& t, py::handle s) { SlotArgs a = slot_args(s, t.num_slots(), "drop"); t.drop(a.p, a.n); })
        .def("pin", [](Tier& t, py::handle s) { SlotArgs a = slot_args(s, t.num_slots(), "pin"); t.pin(a.p, a.n); })
        .def("unpin", [](Tier& t, py::handle s) { SlotArgs a = slot_args(s, t.num_slots(), "unpin"); t.unpin(a.p, a.n); })
        .def("touch", [](Tier& t, py::handle s) { SlotArgs a = slot_args(s, t.num_slots(), "touch"); t.touch(a.p, a.n); })
        .def("demote", [](Tier& t, py::handle s, bool loaded) {
            SlotArgs a = slot_args(s, t.num_slots(), "demote");
            t.demote(a.p, a.n, loaded);
        }, py::arg("slots"), py::arg("loaded") = false)
        .def("evict", [](Tier& t, i64 n) {
            std::vector<i64> out;
            t.evict(n, out);
            return i64_array(out.data(), static_cast<i64>(out.size()));
        })
        .def("plan_store", [](Tier& t, py::handle keys, py::handle prefix) {
            const int kb = t.keys().key_bytes();
            KeyArgs k = key_args(keys, kb), pre = key_args(prefix, kb);
            std::vector<i64> new_idx, slots;
            std::vector<u8> evicted;
            i64 counts[2];
            t.plan_store(k.data(), k.size(), pre.data(), pre.size(), new_idx, slots, evicted, counts);
            i64 ne = static_cast<i64>(evicted.size()) / kb;
            py::array_t<u8> rows({ne, static_cast<i64>(kb)});
            if (ne) std::memcpy(rows.mutable_data(), evicted.data(), evicted.size());
            return py::make_tuple(i64_array(new_idx.data(), static_cast<i64>(new_idx.size())),
                                  i64_array(slots.data(), static_cast<i64>(slots.size())), rows, counts[0], counts[1]);
        })
        .def("plan_load", [](Tier& t, py::handle keys) {
            KeyArgs k = key_args(keys, t.keys().key_bytes());
            std::vector<i64> slots;
            i64 cut = 0;
            bool pending = t.plan_load(k.data(), k.size(), slots, cut);
            return py::make_tuple(i64_array(slots.data(), static_cast<i64>(slots.size())), cut, pending);
        })
        .def("policy_insert", [](Tier& t, py::handle s) {
            SlotArgs a = slot_args(s, t.num_slots(), "policy_insert");
            t.policy_insert(a.p, a.n);
        })
        .def("policy_evict", [](Tier& t, i64 n) {
            std::vector<i64> out;
            t.policy_evict(n, out);
            return i64_array(out.data(), static_cast<i64>(out.size()));
        })
        .def_property_readonly("in_domain", &Tier::in_domain)
        .def("note", [](Tier& t, py::handle keys) {
            KeyArgs k = key_args(keys, t.keys().key_bytes());
            t.note(k.data(), k.size());
        })
        .def("make_room", [](Tier& t, i64 n, bool spill) {
            std::vector<i64> victims, dropped, sc, sd;
            std::vector<u8> gone;
            i64 clean = t.make_room(n, spill, victims, dropped, sc, sd, gone);
            const i64 kb = t.keys().key_bytes();
            py::array_t<u8> g({static_cast<py::ssize_t>(gone.size() / static_cast<size_t>(kb)), static_cast<py::ssize_t>(kb)});
            if (!gone.empty()) std::memcpy(g.mutable_data(), gone.data(), gone.size());
            return py::make_tuple(i64_array(victims.data(), static_cast<i64>(victims.size())), t.evicted_cold(), clean,
                                  i64_array(sc.data(), static_cast<i64>(sc.size())), i64_array(sd.data(), static_cast<i64>(sd.size())), g,
                                  i64_array(dropped.data(), static_cast<i64>(dropped.size())));
        })
        .def("restore", [](Tier& t, py::handle keys, py::handle slots) {
            KeyArgs k = key_args(keys, t.keys().key_bytes());
            SlotArgs s = slot_args(slots, t.num_slots(), "restore");
            if (k.size() != s.n) raise(Err::Tier, "restore got " + S(k.size()) + " keys but " + S(s.n) + " slots");
            t.restore(k.data(), s.p, s.n);
        })
        .def("keys_of", [](const Tier& t, py::handle s) { return keys_list(t.keys(), slot_args(s, t.num_slots(), "keys_of"), "keys_of"); })
        .def("key_tags", [](const Tier& t, py::handle s) {
            SlotArgs a = slot_args(s, t.num_slots(), "key_tags");
            py::array_t<u64> out(a.n);
            for (i64 i = 0; i < a.n; ++i) out.mutable_data()[i] = t.keys().hash_at(a.p[i]);
            return out;
        })
        .def("has_key", [](const Tier& t, py::handle s) {
            SlotArgs a = slot_args(s, t.num_slots(), "has_key");
            py::array_t<bool> out(a.n);
            for (i64 i = 0; i < a.n; ++i) out.mutable_data()[i] = t.keys().held(a.p[i]);
            return out;
        })
        .def("in_cold", [](const Tier& t, py::handle s) {
            SlotArgs a = slot_args(s, t.num_slots(), "in_cold");
            py::array_t<bool> out(a.n);
            for (i64 i = 0; i < a.n; ++i) out.mutable_data()[i] = t.in_cold(a.p[i]);
            return out;
        })
        .def("cold_order", [](const Tier& t) { return t.lists().members(COLD); })
        .def("policy_order", [](const Tier& t) { return t.in_domain() ? t.domain_order() : t.policy().order(); })
        .def_property_readonly("policy_name", [](const Tier& t) { return std::string(kind_name(t.policy().kind())); })
        .def_property_readonly("policy_len", &Tier::policy_len)
        .def_property_readonly("p", [](const Tier& t) { return t.policy().p(); })
        .def("list_sizes", [](const Tier& t) { return py::make_tuple(t.lists().size(T1), t.lists().size(T2)); })
        .def("ghost_sizes", [](const Tier& t) { return py::make_tuple(t.policy().ghosts().size(0), t.policy().ghosts().size(1)); })
        .def("check_invariants", &Tier::check);

    py::class_<Rows>(m, "Rows")
        .def(py::init([](py::handle a, py::handle b, const std::string& a_name, const std::string& b_name) {
            auto r = std::make_unique<Rows>();
            r->side[0] = regions_of(a, *r, 0);
            r->side[1] = regions_of(b, *r, 1);
            r->name[0] = a_name;
            r->name[1] = b_name;
            if (r->side[0].empty() || r->side[0].size() != r->side[1].size())
                raise(Err::Transfer, "rows: " + S(static_cast<i64>(r->side[0].size())) + " regions on one side, " +
                                         S(static_cast<i64>(r->side[1].size())) + " on the other");
            // copy_rows memcpy's between the sides: no byte of one side may lie in the other's span.
            for (size_t i = 0; i < r->side[0].size(); ++i)
                for (size_t j = 0; j < r->side[1].size(); ++j) {
                    const Region &x = r->side[0][i], &y = r->side[1][j];
                    const u8 *xe = x.base + (x.rows ? (x.rows - 1) * x.stride + x.width : 0),
                             *ye = y.base + (y.rows ? (y.rows - 1) * y.stride + y.width : 0);
                    if (x.base < ye && y.base < xe)
                        raise(Err::Transfer, "rows: region " + S(static_cast<i64>(i)) + " of side 0 overlaps region " +
                                                 S(static_cast<i64>(j)) + " of side 1 (" + S(static_cast<i64>(xe - x.base)) + " and " +
                                                 S(static_cast<i64>(ye - y.base)) + " bytes)");
                }
            for (int s = 0; s < 2; ++s)
                for (size_t i = 0; i < r->side[s].size(); ++i) {
                    if (r->side[s][i].rows != r->side[s][0].rows) raise(Err::Transfer, "rows: the regions of one side disagree on the row count");
                    if (r->side[s][i].width != r->side[1 - s][i].width) raise(Err::Transfer, "rows: region " + S(static_cast<i64>(i)) + " differs in width");
                }
            return r;
        }), py::arg("a"), py::arg("b"), py::arg("a_name") = "src id", py::arg("b_name") = "dst id")
        // Row src_ids[i] of side `from` into row dst_ids[i] of the other side, every region; the ids are
        // checked first (in range, no destination twice: TransferError) and the copy runs without the GIL.
        .def("copy", [](Rows& r, int from, py::handle src_ids, py::handle dst_ids) {
            if (from != 0 && from != 1) raise(Err::Transfer, "rows.copy: side must be 0 or 1, got " + S(from));
            int to = 1 - from;
            std::vector<i64> src = id_copy(src_ids, r.name[from]), dst = id_copy(dst_ids, r.name[to]);
            i64 n = static_cast<i64>(src.size());
            if (static_cast<i64>(dst.size()) != n)
                raise(Err::Transfer, "length mismatch: " + S(n) + " " + r.name[from] + "s vs " + S(static_cast<i64>(dst.size())) + " " + r.name[to] + "s");
            for (int s = 0; s < 2; ++s) {
                const std::vector<i64>& ids = s == 0 ? src : dst;
                i64 rows = r.side[s == 0 ? from : to][0].rows;
                const std::string& nm = r.name[s == 0 ? from : to];
                for (i64 x : ids)
                    if (x < 0 || x >= rows) raise(Err::Transfer, nm + " " + S(x) + " out of range [0, " + S(rows) + ")");
            }
            i64 rep = repeated_id(dst.data(), n);
            if (rep >= 0) raise(Err::Transfer, "duplicate " + r.name[to] + " " + S(rep) + " in one batch");
            py::gil_scoped_release unlocked;
            copy_rows(r.side[from], r.side[to], src.data(), dst.data(), n);
        }, py::arg("side"), py::arg("src_ids"), py::arg("dst_ids"));

    py::class_<KeyIndex>(m, "KeyIndex")
        .def(py::init([](i64 n, int kb, const py::bytes& seeds) {
            if (n < 1 || n > MAX_SLOTS) raise(Err::Tier, "KeyTable num_slots must be an int in [1, " + S(MAX_SLOTS) + "] (MAX_SLOTS), got " + S(n));
            if (kb < 1) raise(Err::Tier, "KeyTable key_bytes must be an int >= 1, got " + S(kb));
            return new KeyIndex(n, kb, seeds);
        }))
        .def_property_readonly("num_slots", [](const KeyIndex& k) { return k.t.num_slots(); })
        .def_property_readonly("key_bytes", [](const KeyIndex& k) { return k.t.key_bytes(); })
        .def_property_readonly("nbytes", [](const KeyIndex& k) { return k.t.nbytes(); })
        .def("__len__", [](const KeyIndex& k) { return k.t.size(); })
        .def("keys_view", [](KeyIndex& k) {
            std::vector<py::ssize_t> shape{k.t.num_slots(), k.t.key_bytes()};
            return readonly_view(py::dtype::of<u8>(), shape, k.t.keys_data(), k.t.share_keys());
        })
        .def("find", [](const KeyIndex& k, py::handle keys) { return find_all(k.t, key_args(keys, k.t.key_bytes())); })
        .def("leading_run", [](const KeyIndex& k, py::handle keys) {
            KeyArgs a = key_args(keys, k.t.key_bytes());
            i64 i = 0;
            while (i < a.size() && k.t.find(a.ptr[static_cast<size_t>(i)]) >= 0) ++i;
            return i;
        })
        .def("insert", [](KeyIndex& k, py::handle keys, py::handle slots) {
            KeyArgs a = key_args(keys, k.t.key_bytes());
            SlotArgs s = slot_args(slots, k.t.num_slots(), "insert");
            if (a.size() != s.n) raise(Err::Tier, "insert got " + S(a.size()) + " keys but " + S(s.n) + " slots");
            std::vector<i64> sorted(s.p, s.p + s.n);
            std::sort(sorted.begin(), sorted.end());
            auto rep = std::adjacent_find(sorted.begin(), sorted.end());
            if (rep != sorted.end()) raise(Err::Tier, "insert: slot " + S(*rep) + " appears twice in one batch");
            for (i64 i = 0; i < s.n; ++i)
                if (k.t.held(s.p[i])) raise(Err::Tier, "insert into slot " + S(s.p[i]) + ", which already holds key " + k.t.hex(k.t.key_at(s.p[i])));
            i64 done = 0;
            try {
                for (; done < s.n; ++done) {
                    const u8* key = a.ptr[static_cast<size_t>(done)];
                    u64 h = k.t.hash(key);
                    i64 at = k.t.find_h(key, h);
                    if (at >= 0) raise(Err::Tier, "insert of key " + k.t.hex(key) + " into slot " + S(s.p[done]) + ": the key is already in slot " + S(at));
                    k.t.insert_h(key, h, s.p[done]);
                }
            } catch (...) {
                for (i64 i = 0; i < done; ++i) k.t.remove(s.p[i]);
                throw;
            }
        })
        .def("remove", [](KeyIndex& k, py::handle slots) {
            SlotArgs s = slot_args(slots, k.t.num_slots(), "remove");
            std::vector<i64> sorted(s.p, s.p + s.n);
            std::sort(sorted.begin(), sorted.end());
            auto rep = std::adjacent_find(sorted.begin(), sorted.end());
            if (rep != sorted.end()) raise(Err::Tier, "remove: slot " + S(*rep) + " appears twice in one batch");
            for (i64 i = 0; i < s.n; ++i)
                if (!k.t.held(s.p[i])) raise(Err::Tier, "remove: slot " + S(s.p[i]) + " holds no key");
            for (i64 i = 0; i < s.n; ++i) k.t.remove(s.p[i]);
        })
        .def("has_key", [](const KeyIndex& k, py::handle slots) {
            SlotArgs s = slot_args(slots, k.t.num_slots(), "has_key");
            py::array_t<bool> out(s.n);
            for (i64 i = 0; i < s.n; ++i) out.mutable_data()[i] = k.t.held(s.p[i]);
            return out;
        })
        .def("keys_of", [](const KeyIndex& k, py::handle s) { return keys_list(k.t, slot_args(s, k.t.num_slots(), "keys_of"), "keys_of"); })
        .def("check_invariants", [](const KeyIndex& k) { k.t.check(); });

    py::class_<PolicyCore>(m, "PolicyCore")
        .def(py::init([](int kind, i64 n, u64 mult, double start, double low, double high) {
            if (n < 0 || n > MAX_SLOTS) raise(Err::Slot, "num_slots must be an int in 0.." + S(MAX_SLOTS) + " (MAX_SLOTS), got " + S(n));
            return new PolicyCore(kind_of(kind), n, mult, start, low, high);
        }))
        .def_property_readonly("num_slots", [](const PolicyCore& c) { return c.n; })
        .def_property_readonly("name", [](const PolicyCore& c) { return std::string(kind_name(c.policy.kind())); })
        .def("__len__", [](const PolicyCore& c) { return c.policy.size(); })
        .def("tracked", [](const PolicyCore& c, i64 s) { return s >= 0 && s < c.n && c.policy.tracked(s); })
        .def("insert", [](PolicyCore& c, py::handle slots, py::handle tags) {
            SlotArgs s = slot_args(slots, c.n, "insert", Err::Slot);
            auto t = py::array_t<u64, py::array::c_style | py::array::forcecast>::ensure(tags);
            if (!t || t.ndim() != 1 || t.size() != s.n) raise(Err::Slot, "key_tag returned " + S(t ? t.size() : -1) + " tags for " + S(s.n) + " slots");
            for (i64 i = 0; i < s.n; ++i)
                if (c.policy.tracked(s.p[i]) || c.lists.lid(s.p[i]) != NO_LIST)
                    raise(Err::Slot, "slot " + S(s.p[i]) + " is already tracked by the " + kind_name(c.policy.kind()) + " policy");
            std::vector<u64> old(static_cast<size_t>(s.n));
            for (i64 i = 0; i < s.n; ++i) old[static_cast<size_t>(i)] = c.tags[static_cast<size_t>(s.p[i])];
            for (i64 i = 0; i < s.n; ++i) c.tags[static_cast<size_t>(s.p[i])] = t.data()[i];
            try {
                c.policy.insert(s.p, s.n);
            } catch (...) {
                for (i64 i = 0; i < s.n; ++i) c.tags[static_cast<size_t>(s.p[i])] = old[static_cast<size_t>(i)];
                throw;
            }
        })
        .def("touch", [](PolicyCore& c, py::handle s) { SlotArgs a = slot_args(s, c.n, "touch", Err::Slot); c.policy.touch(a.p, a.n); })
        .def("remove", [](PolicyCore& c, py::handle s) { SlotArgs a = slot_args(s, c.n, "remove", Err::Slot); c.policy.remove(a.p, a.n); })
        .def("demote", [](PolicyCore& c, py::handle s) { SlotArgs a = slot_args(s, c.n, "demote", Err::Slot); c.policy.demote(a.p, a.n); })
        .def("evict", [](PolicyCore& c, i64 n, py::handle pins) {
            std::vector<i64> out;
            py::array p = py::array::ensure(pins);
            if (!p || p.ndim() != 1 || p.shape(0) != c.n || (p.dtype().kind() != 'u' && p.dtype().kind() != 'i' && p.dtype().kind() != 'b'))
                raise(Err::Slot, "pins must be an array of " + S(c.n) + " pin counts (one per slot)");
            auto pc = py::array::ensure(p, py::array::c_style);
            PinView view{static_cast<const u8*>(pc.data()), static_cast<int>(pc.itemsize())};
            c.policy.evict(n, view, out);
            return i64_array(out.data(), static_cast<i64>(out.size()));
        })
        .def("order", [](const PolicyCore& c) { return c.policy.order(); })
        .def_property_readonly("p", [](const PolicyCore& c) { return c.policy.p(); })
        .def("list_sizes", [](const PolicyCore& c) { return py::make_tuple(c.lists.size(T1), c.lists.size(T2)); })
        .def("ghost_sizes", [](const PolicyCore& c) { return py::make_tuple(c.policy.ghosts().size(0), c.policy.ghosts().size(1)); })
        .def("ghost_tags", [](const PolicyCore& c) { return py::make_tuple(c.policy.ghosts().tags(0), c.policy.ghosts().tags(1)); })
        .def_property_readonly("nbytes", [](const PolicyCore& c) { return c.lists.nbytes() + c.policy.nbytes(); })
        .def_property_readonly("ghost_nbytes", [](const PolicyCore& c) { return c.policy.nbytes(); })
        .def("check_invariants", [](const PolicyCore& c) { c.lists.check(); c.policy.ghosts().check(); });

    bind_direct(m);  // the direct copy road (issue 46): native/direct_bind.hpp
}
