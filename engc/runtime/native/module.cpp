// engc._native: load cubins/PTX and launch their kernels through the CUDA driver API.
//
// The driver is dlopen'ed on first use, so this module imports everywhere and reports CUDA unavailable
// on machines without it. Handles (modules, functions, streams) cross into Python as plain ints.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "args.h"
#include "cuda_driver.h"
#include "launch.h"
#include "registry.h"

#include <cstring>

namespace py = pybind11;
using namespace engc;

namespace {

bool is_binary_image(const std::string& image) {
    static const char elf[4] = {0x7f, 'E', 'L', 'F'};
    static const unsigned char fatbin[4] = {0x50, 0xed, 0x55, 0xba};  // 0xBA55ED50, little-endian
    return image.size() >= 4 && (std::memcmp(image.data(), elf, 4) == 0 || std::memcmp(image.data(), fatbin, 4) == 0);
}

std::uintptr_t load_module(py::buffer image, int device) {
    py::buffer_info info = image.request();
    std::string data(static_cast<const char*>(info.ptr), static_cast<std::size_t>(info.size * info.itemsize));
    if (data.empty()) throw py::value_error("load_module: the image is empty");
    // PTX is text and the driver reads it up to a NUL.
    if (!is_binary_image(data) && data.back() != '\0') data.push_back('\0');
    const Driver& d = driver();
    CUcontext context = ensure_context(device);
    CUmodule module = nullptr;
    char log[8192] = {0};
    int options[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void* values[2] = {log, reinterpret_cast<void*>(static_cast<std::uintptr_t>(sizeof(log)))};
    CUresult rc;
    {
        py::gil_scoped_release release;  // PTX is JIT-compiled here, which can take a while
        rc = d.cuModuleLoadDataEx(&module, data.data(), 2, options, values);
    }
    if (rc != CUDA_SUCCESS) {
        std::string message = "cuModuleLoadData failed: " + result_text(rc);
        if (log[0] != '\0') message += "; JIT log: " + std::string(log);
        throw CudaError(message);
    }
    auto handle = reinterpret_cast<std::uintptr_t>(module);
    registry().modules[handle] = ModuleInfo{context, {}};
    return handle;
}

void unload_module(std::uintptr_t handle) {
    Registry& reg = registry();
    ModuleInfo& info = reg.module(handle);
    for (std::uintptr_t func : info.functions) reg.functions.erase(func);
    reg.modules.erase(handle);
    ++reg.generation;
    check(driver().cuModuleUnload(reinterpret_cast<CUmodule>(handle)), "cuModuleUnload");
}

std::uintptr_t get_function(std::uintptr_t module, const std::string& name) {
    ModuleInfo& info = registry().module(module);
    CUfunction func = nullptr;
    CUresult rc = driver().cuModuleGetFunction(&func, reinterpret_cast<CUmodule>(module), name.c_str());
    if (rc != CUDA_SUCCESS) throw CudaError("cuModuleGetFunction('" + name + "') failed: " + result_text(rc));
    auto handle = reinterpret_cast<std::uintptr_t>(func);
    auto& functions = registry().functions;
    if (functions.find(handle) == functions.end()) {
        // The driver's own limit, not 48 KiB: by default it is 48 KiB minus the kernel's static shared
        // memory, so a kernel with both kinds must be raised before asking for 48 KiB - static or more.
        int max_dynamic = 0;
        check(driver().cuFuncGetAttribute(&max_dynamic, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, func),
              "cuFuncGetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");
        functions[handle] = FunctionInfo{reinterpret_cast<CUmodule>(module), info.context, name, max_dynamic};
        info.functions.push_back(handle);
    }
    return handle;
}

void set_shared_carveout(std::uintptr_t func, int percent) {
    if (percent < -1 || percent > 100) throw py::value_error("carveout must be -1 (no preference) or 0..100");
    registry().function(func);
    check(driver().cuFuncSetAttribute(reinterpret_cast<CUfunction>(func),
                                      CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, percent),
          "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)");
}

void set_max_dynamic_shared(std::uintptr_t func, int bytes) {
    if (bytes < 0) throw py::value_error("bytes must be non-negative");
    FunctionInfo& info = registry().function(func);
    info.max_dynamic_shared = -1;  // force the call, even when lowering the limit
    reserve_dynamic_shared(func, info, bytes);
}

py::dict function_attributes(std::uintptr_t func) {
    registry().function(func);
    const Driver& d = driver();
    static const std::pair<const char*, int> attributes[] = {
        {"max_threads_per_block", CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK},
        {"static_shared_bytes", CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES},
        {"const_bytes", CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES},
        {"local_bytes", CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES},
        {"num_regs", CU_FUNC_ATTRIBUTE_NUM_REGS},
        {"ptx_version", CU_FUNC_ATTRIBUTE_PTX_VERSION},
        {"binary_version", CU_FUNC_ATTRIBUTE_BINARY_VERSION},
        {"max_dynamic_shared_bytes", CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES},
        {"preferred_shared_carveout", CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT},
    };
    py::dict out;
    for (const auto& [key, attribute] : attributes) {
        int value = 0;
        check(d.cuFuncGetAttribute(&value, attribute, reinterpret_cast<CUfunction>(func)), "cuFuncGetAttribute");
        out[key] = value;
    }
    return out;
}

void launch(std::uintptr_t func, py::handle grid, long long block_x, long long shared_mem, std::uintptr_t stream,
            const std::string& signature, py::handle args) {
    Grid dims = parse_grid(grid);
    unsigned int block = check_block(block_x);
    unsigned int shared = check_shared(shared_mem);
    PackedArgs packed(ArgLayout::parse(signature));
    packed.pack_all(args.ptr());
    FunctionInfo& info = registry().function(func);
    reserve_dynamic_shared(func, info, static_cast<int>(shared));
    CUresult rc = launch_kernel(reinterpret_cast<CUfunction>(func), info.context, dims, block, shared,
                                reinterpret_cast<CUstream>(stream), packed.params(), info.pdl);
    if (rc != CUDA_SUCCESS) raise_launch_error(rc, info.name);
}

py::bytes pack_args(const std::string& signature, py::handle args) {
    PackedArgs packed(ArgLayout::parse(signature));
    packed.pack_all(args.ptr());
    return py::bytes(reinterpret_cast<const char*>(packed.data()), packed.layout().size);
}

std::pair<int, int> device_capability(int device) {
    const Driver& d = driver();
    CUdevice dev = 0;
    check(d.cuDeviceGet(&dev, device), "cuDeviceGet");
    int major = 0, minor = 0;
    check(d.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute");
    check(d.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute");
    return {major, minor};
}

int driver_version() {
    int version = 0;
    check(driver().cuDriverGetVersion(&version), "cuDriverGetVersion");
    return version;
}

int device_count() {
    int count = 0;
    check(driver().cuDeviceGetCount(&count), "cuDeviceGetCount");
    return count;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() =
        "Cubin launcher over the CUDA driver API (libcuda.so.1, loaded at run time).\n\n"
        "Handles are ints. Signatures have one character per kernel parameter: p pointer (int, None or\n"
        "an object with .data_ptr()), c/C int8/uint8, s/S int16/uint16, i/I int32/uint32, l/L int64/uint64,\n"
        "h fp16, B bf16, f fp32, d fp64. Triton kernels end with two scratch pointers: append 'pp', pass 0.";
    py::register_exception<CudaError>(m, "CudaError", PyExc_RuntimeError);

    m.def("available", &driver_available,
          "True when libcuda.so.1 loads, cuInit succeeds and at least one device exists. Never raises.");
    m.def("error", &driver_error, "Why available() is False; '' when it is True.");
    m.def("driver_version", &driver_version, "cuDriverGetVersion, e.g. 13000 for CUDA 13.0.");
    m.def("device_count", &device_count);
    m.def("device_capability", &device_capability, py::arg("device") = 0, "(major, minor) of a device.");
    m.def("ensure_context", [](int device) { return reinterpret_cast<std::uintptr_t>(ensure_context(device)); },
          py::arg("device") = -1,
          "Make a context current on this thread: the current one if any (and, when device >= 0, on that\n"
          "device), else the device's primary context, which torch shares. Returns the CUcontext.");
    m.def("load_module", &load_module, py::arg("image"), py::arg("device") = -1,
          "cuModuleLoadData on a cubin, fatbin or PTX image (NUL appended to PTX if missing), in the context\n"
          "ensure_context(device) gives. Returns the module handle. JIT errors carry the JIT log.");
    m.def("unload_module", &unload_module, py::arg("module"),
          "cuModuleUnload. Its functions and Launch objects become invalid (ValueError on use).");
    m.def("get_function", &get_function, py::arg("module"), py::arg("name"),
          "cuModuleGetFunction: the handle of the kernel `name` (the mangled entry name) in `module`.");
    m.def("set_max_dynamic_shared", &set_max_dynamic_shared, py::arg("func"), py::arg("bytes"),
          "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES). Launches raise it themselves when they need\n"
          "more than the current limit (by default 48 KiB minus the kernel's static shared memory).");
    m.def("set_shared_carveout", &set_shared_carveout, py::arg("func"), py::arg("percent"),
          "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT): the share of the SM's L1/shared memory this\n"
          "function prefers as shared memory (percent of the most; -1: no preference, the driver's pick). An SM\n"
          "runs kernels of one split at a time, so two overlapping kernels that want different splits wait.");
    m.def("pdl_supported", []() { return driver().cuLaunchKernelEx != nullptr; },
          "True when the driver has cuLaunchKernelEx (programmatic dependent launch needs sm90 as well).");
    m.def("set_pdl", [](std::uintptr_t func, bool on) { registry().function(func).pdl = on; }, py::arg("func"),
          py::arg("on"),
          "Launch this function with programmatic stream serialization from now on (Launch objects made\n"
          "before keep their mode): it may start while the previous kernel in the stream still runs, so it\n"
          "must execute griddepcontrol.wait before touching anything that kernel writes or reads.");
    m.def("function_attributes", &function_attributes, py::arg("func"),
          "cuFuncGetAttribute: num_regs, static_shared_bytes, local_bytes, max_threads_per_block, ...");
    m.def("launch", &launch, py::arg("func"), py::arg("grid"), py::arg("block_x"), py::arg("shared_mem"),
          py::arg("stream"), py::arg("signature"), py::arg("args"),
          "Pack `args` by `signature` and cuLaunchKernel on `stream` (a CUstream int, e.g.\n"
          "torch.cuda.current_stream().cuda_stream), block (block_x, 1, 1). An empty grid launches nothing.");
    m.def("pack_args", &pack_args, py::arg("signature"), py::arg("args"),
          "The packed parameter bytes a launch would use: each parameter aligned to its own size, the total\n"
          "rounded up to the largest alignment. For tests and debugging.");
    m.def("launch_many",
          [](py::iterable launches, std::uintptr_t stream) { launch_all(collect_launches(launches), stream); },
          py::arg("launches"), py::arg("stream"),
          "Fire Launch objects in order on `stream` with one call and the GIL released. Do not change them\n"
          "from another thread meanwhile.");

    py::class_<Launch, std::shared_ptr<Launch>>(m, "Launch",
                                                "A prepared launch: packed once, fired by calling it with a stream.")
        .def(py::init<std::uintptr_t, py::handle, long long, long long, const std::string&, py::handle>(),
             py::arg("func"), py::arg("grid"), py::arg("block_x"), py::arg("shared_mem"), py::arg("signature"),
             py::arg("args"))
        .def("__call__", &Launch::operator(), py::arg("stream") = 0, "Launch on `stream`.")
        .def("set_arg", &Launch::set_arg, py::arg("index"), py::arg("value"),
             "Repack one argument. A CUDA graph that already captured this launch keeps the old value.")
        .def("set_grid", &Launch::set_grid, py::arg("grid"))
        .def_property_readonly("name", &Launch::name)
        .def_property_readonly("func", &Launch::func)
        .def_property_readonly("grid", [](const Launch& l) { return py::make_tuple(l.grid()[0], l.grid()[1], l.grid()[2]); })
        .def_property_readonly("block_x", &Launch::block_x)
        .def_property_readonly("shared_mem", &Launch::shared_mem)
        .def_property_readonly("signature", [](const Launch& l) { return l.args().layout().signature; })
        .def_property_readonly("packed", [](const Launch& l) {
            return py::bytes(reinterpret_cast<const char*>(l.args().data()), l.args().layout().size);
        })
        .def("__repr__", [](const Launch& l) {
            return "<Launch " + l.name() + " grid=(" + std::to_string(l.grid()[0]) + "," + std::to_string(l.grid()[1]) +
                   "," + std::to_string(l.grid()[2]) + ") block=" + std::to_string(l.block_x()) + ">";
        });

    py::class_<LaunchPlan>(m, "LaunchPlan",
                           "A fixed list of Launch objects fired by one call; they are shared, not copied,\n"
                           "so set_arg on a member shows in the next call.")
        .def(py::init<py::iterable>(), py::arg("launches"))
        .def("__call__", &LaunchPlan::operator(), py::arg("stream") = 0)
        .def("__len__", &LaunchPlan::size)
        .def_property_readonly("launches", &LaunchPlan::launches);
}
