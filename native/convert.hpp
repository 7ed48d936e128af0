// Python -> core arguments: keys (a list/tuple of bytes, or a uint8[n, key_bytes] array) and slot
// arrays, checked with errors that name the culprit; core results -> numpy arrays.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "common.hpp"

namespace py = pybind11;

namespace tkv {

// The Python exception classes of tiered_kv.errors, by Err kind (set once by _core.set_errors).
inline py::object& error_class(Err kind) {
    static py::object classes[5];
    return classes[static_cast<int>(kind)];
}

[[noreturn]] inline void raise(Err kind, const std::string& msg) {
    py::object& cls = error_class(kind);
    PyErr_SetString(cls ? cls.ptr() : PyExc_ValueError, msg.c_str());
    throw py::error_already_set();
}

// Every argument is copied out of its Python objects before the core runs: converting a later
// argument (iterating an iterable, an __array__) runs Python code that may free or rewrite the
// buffers of an earlier one, so no pointer into a Python object outlives its own conversion.
struct KeyArgs {
    std::vector<u8> buf;  // n * key_bytes bytes
    std::vector<const u8*> ptr;
    i64 size() const { return static_cast<i64>(ptr.size()); }
    const u8* const* data() const { return ptr.data(); }
    void point(i64 n, int kb) {
        ptr.resize(static_cast<size_t>(n));
        for (i64 i = 0; i < n; ++i) ptr[static_cast<size_t>(i)] = buf.data() + i * kb;
    }
};

inline KeyArgs key_args(py::handle obj, int kb) {
    KeyArgs k;
    PyObject* o = obj.ptr();
    if (PyList_Check(o) || PyTuple_Check(o)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
        PyObject** items = PySequence_Fast_ITEMS(o);
        k.buf.resize(static_cast<size_t>(n) * kb);
        for (Py_ssize_t i = 0; i < n; ++i) {  // no Python code runs in this loop
            PyObject* it = items[i];
            if (!PyBytes_Check(it))
                raise(Err::Key, "keys[" + S(i) + "] must be bytes, got " + Py_TYPE(it)->tp_name);
            if (PyBytes_GET_SIZE(it) != kb)
                raise(Err::Key, "keys[" + S(i) + "] has " + S(PyBytes_GET_SIZE(it)) + " bytes, expected " + S(kb) + " per key");
            std::memcpy(k.buf.data() + i * kb, PyBytes_AS_STRING(it), static_cast<size_t>(kb));
        }
        k.point(n, kb);
        return k;
    }
    if (py::isinstance<py::array>(obj)) {
        py::array a = py::reinterpret_borrow<py::array>(obj);
        if (a.dtype().kind() != 'u' || a.itemsize() != 1 || a.ndim() != 2 || a.shape(1) != kb)
            raise(Err::Key, "key array must be uint8[n, " + S(kb) + "], got " + std::string(py::str(a.dtype())) +
                                std::string(py::str(py::tuple(a.attr("shape")))));
        auto c = py::array_t<u8, py::array::c_style>::ensure(a);
        if (!c) throw py::error_already_set();
        i64 n = a.shape(0);
        k.buf.assign(c.data(), c.data() + n * kb);
        k.point(n, kb);
        return k;
    }
    if (PyBytes_Check(o) || PyByteArray_Check(o) || PyUnicode_Check(o) || PyMemoryView_Check(o))
        raise(Err::Key, "keys must be a sequence of " + S(kb) + "-byte keys, got one " + Py_TYPE(o)->tp_name);
    return key_args(py::list(py::reinterpret_borrow<py::iterable>(obj)), kb);  // any other iterable of keys
}

struct SlotArgs {
    std::vector<i64> v;  // a copy, checked: see KeyArgs
    const i64* p = nullptr;
    i64 n = 0;
};

// A 1-D integer array (or list) of slots in [0, num); `op` names the call in errors.
inline SlotArgs slot_args(py::handle obj, i64 num, const char* op, Err kind = Err::Tier) {
    py::array a = py::array::ensure(obj);
    if (!a) {
        PyErr_Clear();
        raise(kind, std::string(op) + ": slots must be a 1-D integer array, got " + Py_TYPE(obj.ptr())->tp_name);
    }
    if (a.ndim() == 0) a = a.attr("reshape")(1);
    char dk = a.dtype().kind();
    if (a.ndim() != 1 || (a.size() && dk != 'i' && dk != 'u'))
        raise(kind, std::string(op) + ": slots must be a 1-D integer array, got " + std::string(py::str(a.dtype())) +
                        std::string(py::str(py::tuple(a.attr("shape")))));
    auto c = py::array_t<i64, py::array::c_style | py::array::forcecast>::ensure(a);
    if (!c) throw py::error_already_set();
    SlotArgs s;
    s.v.assign(c.data(), c.data() + c.size());
    s.p = s.v.data();
    s.n = static_cast<i64>(s.v.size());
    for (i64 i = 0; i < s.n; ++i)
        if (s.p[i] < 0 || s.p[i] >= num) {
            if (kind == Err::Slot) raise(kind, "slot " + S(s.p[i]) + " out of range for a policy of " + S(num) + " slots");
            raise(kind, std::string(op) + ": slot " + S(s.p[i]) + " is outside [0, " + S(num) + ")");
        }
    return s;
}

// A read-only array over memory the core owns: writing a slot's state, pins or key from Python would
// let the core trust a lie (e.g. drop a FREE slot). Its base is a capsule sharing the storage, not the
// core object: a base pointing back at the owner would close a cycle the GC cannot see (common.hpp).
inline py::array readonly_view(py::dtype dt, std::vector<py::ssize_t> shape, const void* data, std::shared_ptr<const void> storage) {
    auto hold = std::make_unique<std::shared_ptr<const void>>(std::move(storage));
    py::capsule base(hold.get(), [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); });
    hold.release();  // the capsule owns it now
    py::array a(dt, std::move(shape), {}, data, base);
    py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return a;
}

inline py::array_t<i64> i64_array(const i64* p, i64 n) {
    py::array_t<i64> a(n);
    if (n) std::memcpy(a.mutable_data(), p, static_cast<size_t>(n) * sizeof(i64));
    return a;
}

inline py::array_t<bool> bool_array(i64 n) {
    py::array_t<bool> a(n);
    if (n) std::memset(a.mutable_data(), 0, static_cast<size_t>(n));
    return a;
}

// An id list as int64 (numpy arrays, lists, anything np.asarray takes), or TransferError worded as
// check_id_arrays words it: the host rows' copy and the direct copy road both take their ids here.
inline std::vector<i64> id_copy(py::handle obj, const std::string& name) {
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

}  // namespace tkv
