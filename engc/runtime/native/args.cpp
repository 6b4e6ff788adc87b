#include <pybind11/pybind11.h>

#include "args.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace py = pybind11;

namespace engc {
namespace {

std::string describe(std::size_t index, char code) {
    return "argument " + std::to_string(index) + " (signature '" + std::string(1, code) + "')";
}

std::string type_name(PyObject* value) { return Py_TYPE(value)->tp_name; }

// An integer-like object as a new reference to a Python int, or nullptr for anything else.
PyObject* as_index(PyObject* value) {
    if (PyLong_Check(value)) {
        Py_INCREF(value);
        return value;
    }
    if (PyFloat_Check(value) || !PyIndex_Check(value)) return nullptr;
    PyObject* index = PyNumber_Index(value);
    if (index == nullptr) PyErr_Clear();
    return index;
}

// A pointer parameter also takes None and anything with .data_ptr(), so tensors can be passed directly.
PyObject* pointer_as_index(PyObject* value) {
    if (value == Py_None) return PyLong_FromLong(0);
    if (!PyLong_Check(value) && PyObject_HasAttrString(value, "data_ptr")) {
        PyObject* ptr = PyObject_CallMethod(value, "data_ptr", nullptr);
        if (ptr == nullptr) throw py::error_already_set();
        return ptr;
    }
    return as_index(value);
}

void pack_integer(char code, PyObject* value, std::uint8_t* dst, std::size_t index) {
    PyObject* number = code == 'p' ? pointer_as_index(value) : as_index(value);
    if (number == nullptr) {
        throw py::type_error(describe(index, code) + " expects an int, got " + type_name(value));
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(number, &overflow);
    unsigned long long u = static_cast<unsigned long long>(v);
    bool fits = overflow == 0;
    bool above_int64 = false;
    if (overflow > 0) {
        u = PyLong_AsUnsignedLongLong(number);
        above_int64 = PyErr_Occurred() == nullptr;
        PyErr_Clear();
    }
    Py_DECREF(number);
    const bool is_unsigned = code == 'p' || code == 'C' || code == 'S' || code == 'I' || code == 'L';
    if (above_int64) {
        fits = code == 'L' || code == 'p';
    } else if (fits) {
        long long lo = 0;
        unsigned long long hi = 0;
        switch (code) {
            case 'c': lo = INT8_MIN, hi = INT8_MAX; break;
            case 's': lo = INT16_MIN, hi = INT16_MAX; break;
            case 'i': lo = INT32_MIN, hi = INT32_MAX; break;
            case 'l': lo = INT64_MIN, hi = INT64_MAX; break;
            case 'C': hi = UINT8_MAX; break;
            case 'S': hi = UINT16_MAX; break;
            case 'I': hi = UINT32_MAX; break;
            default: hi = INT64_MAX; break;  // 'L' and 'p' up to here; above INT64_MAX is handled above
        }
        fits = v >= lo && (v < 0 || static_cast<unsigned long long>(v) <= hi);
    }
    if (!fits) {
        PyObject* repr = PyObject_Repr(value);
        std::string text = repr ? PyUnicode_AsUTF8(repr) : "value";
        Py_XDECREF(repr);
        throw py::value_error(describe(index, code) + ": " + text + " is out of range" +
                              (is_unsigned ? " (unsigned)" : ""));
    }
    std::memcpy(dst, &u, param_size(code));  // little-endian: the low bytes are the value
}

double as_double(char code, PyObject* value, std::size_t index) {
    if (PyFloat_CheckExact(value)) return PyFloat_AS_DOUBLE(value);
    if (PyUnicode_Check(value) || PyBytes_Check(value) || value == Py_None) {
        throw py::type_error(describe(index, code) + " expects a float, got " + type_name(value));
    }
    double v = PyFloat_AsDouble(value);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        throw py::type_error(describe(index, code) + " expects a float, got " + type_name(value));
    }
    return v;
}

std::uint16_t to_fp16(double v, char code, std::size_t index) {
    unsigned char out[2];
#if PY_VERSION_HEX >= 0x030B00A7
    int rc = PyFloat_Pack2(v, reinterpret_cast<char*>(out), 1);
#else
    int rc = _PyFloat_Pack2(v, out, 1);
#endif
    if (rc != 0) {
        PyErr_Clear();
        throw py::value_error(describe(index, code) + ": " + std::to_string(v) + " does not fit in fp16");
    }
    return static_cast<std::uint16_t>(out[0] | (out[1] << 8));
}

std::uint16_t to_bf16(double v) {
    float f = static_cast<float>(v);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (std::isnan(f)) return 0x7fc0;
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return static_cast<std::uint16_t>(bits >> 16);
}

void pack_float(char code, PyObject* value, std::uint8_t* dst, std::size_t index) {
    double v = as_double(code, value, index);
    if (code == 'd') {
        std::memcpy(dst, &v, 8);
    } else if (code == 'f') {
        float f = static_cast<float>(v);
        std::memcpy(dst, &f, 4);
    } else {
        std::uint16_t h = code == 'h' ? to_fp16(v, code, index) : to_bf16(v);
        std::memcpy(dst, &h, 2);
    }
}

}  // namespace

std::size_t param_size(char code) {
    switch (code) {
        case 'c': case 'C': return 1;
        case 's': case 'S': case 'h': case 'B': return 2;
        case 'i': case 'I': case 'f': return 4;
        case 'l': case 'L': case 'd': case 'p': return 8;
        default: return 0;
    }
}

ArgLayout ArgLayout::parse(const std::string& signature) {
    ArgLayout layout;
    layout.signature = signature;
    layout.offsets.reserve(signature.size());
    std::size_t offset = 0, max_align = 1;
    for (std::size_t i = 0; i < signature.size(); ++i) {
        std::size_t size = param_size(signature[i]);
        if (size == 0) {
            throw py::value_error("signature '" + signature + "': unknown parameter code '" +
                                  std::string(1, signature[i]) + "' at position " + std::to_string(i) +
                                  " (known: p c C s S i I l L h B f d)");
        }
        offset = (offset + size - 1) / size * size;
        layout.offsets.push_back(static_cast<std::uint32_t>(offset));
        offset += size;
        if (size > max_align) max_align = size;
    }
    layout.size = (offset + max_align - 1) / max_align * max_align;
    return layout;
}

void pack_value(char code, PyObject* value, std::uint8_t* dst, std::size_t index) {
    if (code == 'f' || code == 'd' || code == 'h' || code == 'B') {
        pack_float(code, value, dst, index);
    } else {
        pack_integer(code, value, dst, index);
    }
}

PackedArgs::PackedArgs(ArgLayout layout)
    : layout_(std::move(layout)), storage_((layout_.size + 7) / 8 + 1, 0), params_(layout_.offsets.size()) {
    auto* base = reinterpret_cast<std::uint8_t*>(storage_.data());
    for (std::size_t i = 0; i < params_.size(); ++i) params_[i] = base + layout_.offsets[i];
}

void PackedArgs::pack_all(PyObject* sequence) {
    PyObject* fast = PySequence_Fast(sequence, "kernel arguments must be a sequence");
    if (fast == nullptr) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (static_cast<std::size_t>(n) != layout_.offsets.size()) {
        Py_DECREF(fast);
        throw py::value_error("signature '" + layout_.signature + "' has " +
                              std::to_string(layout_.offsets.size()) + " parameters but " + std::to_string(n) +
                              " arguments were given");
    }
    PyObject** items = PySequence_Fast_ITEMS(fast);
    try {
        for (Py_ssize_t i = 0; i < n; ++i) pack_one(static_cast<std::size_t>(i), items[i]);
    } catch (...) {
        Py_DECREF(fast);
        throw;
    }
    Py_DECREF(fast);
}

void PackedArgs::pack_one(std::size_t index, PyObject* value) {
    if (index >= layout_.offsets.size()) {
        throw py::index_error("argument index " + std::to_string(index) + " is out of range for signature '" +
                              layout_.signature + "'");
    }
    auto* base = reinterpret_cast<std::uint8_t*>(storage_.data());
    pack_value(layout_.signature[index], value, base + layout_.offsets[index], index);
}

}  // namespace engc
