// Kernel-parameter layout and packing: a signature string, one character per kernel parameter, says
// how each Python argument becomes the bytes the kernel reads.
//
//   p  64-bit device pointer: int >= 0, None (null) or an object with .data_ptr() (a torch tensor)
//   c  int8     C  uint8     s  int16    S  uint16
//   i  int32    I  uint32    l  int64    L  uint64
//   h  fp16     B  bf16      f  fp32     d  fp64     (from a Python float or int)
//
// Each parameter sits at an offset aligned to its own size (as in a C struct); the packed size is
// rounded up to the largest alignment used. cuLaunchKernel gets one pointer per parameter into that
// buffer, and copies the values when it is called, so the buffer may change right after a launch.
#pragma once

#include <Python.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace engc {

// The byte size of a parameter code, or 0 for a code that is not in the table above.
std::size_t param_size(char code);

struct ArgLayout {
    std::string signature;
    std::vector<std::uint32_t> offsets;
    std::size_t size = 0;  // bytes, rounded up to the largest alignment

    // Throws ValueError naming the first unknown character.
    static ArgLayout parse(const std::string& signature);
};

// Writes one argument at dst. Throws TypeError for a wrong Python type, ValueError for a value that does
// not fit; `index` only names the parameter in the message.
void pack_value(char code, PyObject* value, std::uint8_t* dst, std::size_t index);

// Packed parameters plus the pointer table cuLaunchKernel wants. 8-byte aligned storage.
class PackedArgs {
public:
    explicit PackedArgs(ArgLayout layout);
    // Packs a whole Python sequence; ValueError when its length differs from the signature's.
    void pack_all(PyObject* sequence);
    void pack_one(std::size_t index, PyObject* value);

    const ArgLayout& layout() const { return layout_; }
    const std::uint8_t* data() const { return reinterpret_cast<const std::uint8_t*>(storage_.data()); }
    void** params() { return params_.data(); }

private:
    ArgLayout layout_;
    std::vector<std::uint64_t> storage_;
    std::vector<void*> params_;
};

}  // namespace engc
