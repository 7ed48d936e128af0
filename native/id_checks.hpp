// A copy's two id lists checked in one native pass (the engines' submit: transfer/engines/base.py
// check_id_arrays, whose numpy body is the reference and the fallback for anything else, e.g. tensors);
// the checks and their messages are the direct road's own (copy_plan.hpp). Included by bind.cpp.
#pragma once

namespace {

// ids as int64 (the same array when it already is one), or None for anything but a list/tuple of plain
// ints or an integer numpy array (bool excluded) of one dimension; any empty array counts as no ids.
py::object id_array_or_none(py::handle obj) {
    PyObject* o = obj.ptr();
    if (PyList_Check(o) || PyTuple_Check(o)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
        PyObject** items = PySequence_Fast_ITEMS(o);
        py::array_t<i64> out(n);
        i64* p = out.mutable_data();
        for (Py_ssize_t i = 0; i < n; ++i) {
            if (!PyLong_CheckExact(items[i])) return py::none();
            int overflow = 0;
            p[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
            if (overflow) return py::none();
        }
        return std::move(out);
    }
    if (!py::isinstance<py::array>(obj)) return py::none();
    py::array a = py::reinterpret_borrow<py::array>(obj);
    if (a.size() == 0) return py::array_t<i64>(0);
    if (a.ndim() != 1 || (a.dtype().kind() != 'i' && a.dtype().kind() != 'u')) return py::none();
    auto c = py::array_t<i64, py::array::c_style | py::array::forcecast>::ensure(a);
    if (!c) throw py::error_already_set();
    return std::move(c);
}

// (src, dst) as int64 arrays, or None (the caller's numpy path decides); a TransferError with
// check_id_arrays' messages for unequal lengths, an id outside [0, len) (src first), a dst id twice.
py::object check_copy_ids(py::handle src_ids, py::handle dst_ids, i64 src_len, i64 dst_len, const std::string& src_name,
                     const std::string& dst_name) {
    py::object src = id_array_or_none(src_ids), dst = id_array_or_none(dst_ids);
    if (src.is_none() || dst.is_none()) return py::none();
    auto s = py::reinterpret_borrow<py::array_t<i64>>(src), d = py::reinterpret_borrow<py::array_t<i64>>(dst);
    check_ids(s.data(), s.size(), d.data(), d.size(), src_len, dst_len, src_name, dst_name);  // copy_plan.hpp
    return py::make_tuple(src, dst);
}

}  // namespace
