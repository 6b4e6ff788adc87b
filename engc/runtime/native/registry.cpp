#include <pybind11/pybind11.h>

#include "registry.h"

#include <cstdio>
#include <map>

namespace py = pybind11;

namespace engc {
namespace {

std::string hex(std::uintptr_t handle) {
    char text[32];
    std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(handle));
    return text;
}

}  // namespace

Registry& registry() {
    static Registry* instance = new Registry();  // never destroyed: outlives interpreter teardown
    return *instance;
}

ModuleInfo& Registry::module(std::uintptr_t handle) {
    auto it = modules.find(handle);
    if (it == modules.end()) throw py::value_error("unknown module handle " + hex(handle) + " (not loaded, or unloaded)");
    return it->second;
}

FunctionInfo& Registry::function(std::uintptr_t handle) {
    auto it = functions.find(handle);
    if (it == functions.end()) {
        throw py::value_error("unknown function handle " + hex(handle) + " (not from get_function, or its module was unloaded)");
    }
    return it->second;
}

CUcontext ensure_context(int device) {
    const Driver& d = driver();
    CUcontext current = nullptr;
    check(d.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
    const int ordinal = device < 0 ? 0 : device;
    CUdevice wanted = 0;
    check(d.cuDeviceGet(&wanted, ordinal), "cuDeviceGet");
    if (current != nullptr) {
        if (device < 0) return current;
        CUdevice current_device = -1;
        check(d.cuCtxGetDevice(&current_device), "cuCtxGetDevice");
        if (current_device == wanted) return current;
    }
    static std::map<CUdevice, CUcontext> retained;
    auto it = retained.find(wanted);
    if (it == retained.end()) {
        CUcontext primary = nullptr;
        check(d.cuDevicePrimaryCtxRetain(&primary, wanted), "cuDevicePrimaryCtxRetain");
        it = retained.emplace(wanted, primary).first;
    }
    check(d.cuCtxSetCurrent(it->second), "cuCtxSetCurrent");
    return it->second;
}

void reserve_dynamic_shared(std::uintptr_t func, FunctionInfo& info, int bytes) {
    if (bytes <= info.max_dynamic_shared) return;
    const Driver& d = driver();
    CUresult rc = d.cuFuncSetAttribute(reinterpret_cast<CUfunction>(func),
                                       CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes);
    if (rc != CUDA_SUCCESS) {
        throw CudaError("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES=" + std::to_string(bytes) +
                        ") failed for kernel '" + info.name + "': " + result_text(rc) +
                        " (more shared memory than the device allows per block?)");
    }
    info.max_dynamic_shared = bytes;
}

}  // namespace engc
