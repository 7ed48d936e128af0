// Part of bind.cpp (included there, after its helpers): the Python bindings of one tier (tier.hpp), _core.Tier.
// Not a standalone header: it uses bind.cpp's helpers (the key and slot conversions) in the same translation unit.
#pragma once

namespace {

void bind_tier(py::module_& m) {
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

}

}  // namespace
