// Part of bind.cpp (included there, after its helpers): _core.Rows (the host copy engine's rows, rows.hpp),
// _core.KeyIndex (a standalone key table) and _core.PolicyCore (a policy without a tier, for the replay).
// Not a standalone header: it uses bind.cpp's helpers in the same translation unit.
#pragma once

namespace {

void bind_rows_keys(py::module_& m) {
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
}

}  // namespace
