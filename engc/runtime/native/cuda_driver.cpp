#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace engc {
namespace {

Driver g_driver{};
std::string g_error;
bool g_available = false;
std::once_flag g_once;

template <typename Fn>
bool resolve(void* lib, const char* name, Fn& slot) {
    slot = reinterpret_cast<Fn>(dlsym(lib, name));
    if (slot == nullptr) {
        g_error = std::string("libcuda.so.1 has no ") + name + " (driver too old?)";
        return false;
    }
    return true;
}

bool resolve_all(void* lib) {
    Driver& d = g_driver;
    return resolve(lib, "cuInit", d.cuInit) && resolve(lib, "cuDriverGetVersion", d.cuDriverGetVersion) &&
           resolve(lib, "cuGetErrorName", d.cuGetErrorName) &&
           resolve(lib, "cuGetErrorString", d.cuGetErrorString) &&
           resolve(lib, "cuDeviceGetCount", d.cuDeviceGetCount) && resolve(lib, "cuDeviceGet", d.cuDeviceGet) &&
           resolve(lib, "cuDeviceGetAttribute", d.cuDeviceGetAttribute) &&
           resolve(lib, "cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain) &&
           resolve(lib, "cuCtxGetCurrent", d.cuCtxGetCurrent) && resolve(lib, "cuCtxSetCurrent", d.cuCtxSetCurrent) &&
           resolve(lib, "cuCtxGetDevice", d.cuCtxGetDevice) &&
           resolve(lib, "cuModuleLoadDataEx", d.cuModuleLoadDataEx) &&
           resolve(lib, "cuModuleUnload", d.cuModuleUnload) &&
           resolve(lib, "cuModuleGetFunction", d.cuModuleGetFunction) &&
           resolve(lib, "cuFuncGetAttribute", d.cuFuncGetAttribute) &&
           resolve(lib, "cuFuncSetAttribute", d.cuFuncSetAttribute) &&
           resolve(lib, "cuLaunchKernel", d.cuLaunchKernel);
}

void load_driver() {
    // RTLD_NOLOAD first: torch has usually loaded the driver already, and sharing its copy is the point.
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
        const char* why = dlerror();
        g_error = std::string("the CUDA driver (libcuda.so.1) could not be loaded: ") + (why ? why : "not found");
        return;
    }
    if (!resolve_all(lib)) return;
    g_driver.cuLaunchKernelEx = reinterpret_cast<decltype(g_driver.cuLaunchKernelEx)>(dlsym(lib, "cuLaunchKernelEx"));
    CUresult rc = g_driver.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        g_error = "cuInit failed: " + result_text(rc);
        return;
    }
    int count = 0;
    rc = g_driver.cuDeviceGetCount(&count);
    if (rc != CUDA_SUCCESS) {
        g_error = "cuDeviceGetCount failed: " + result_text(rc);
        return;
    }
    if (count == 0) {
        g_error = "the CUDA driver sees no device";
        return;
    }
    g_available = true;
}

}  // namespace

bool driver_available() {
    std::call_once(g_once, load_driver);
    return g_available;
}

const std::string& driver_error() {
    driver_available();
    return g_error;
}

const Driver& driver() {
    if (!driver_available()) throw CudaError("CUDA is unavailable: " + g_error);
    return g_driver;
}

std::string result_text(CUresult rc) {
    const char* name = nullptr;
    const char* text = nullptr;
    if (g_driver.cuGetErrorName == nullptr || g_driver.cuGetErrorName(rc, &name) != CUDA_SUCCESS || !name) {
        return "CUresult " + std::to_string(rc);
    }
    std::string out(name);
    if (g_driver.cuGetErrorString(rc, &text) == CUDA_SUCCESS && text) out += std::string(" (") + text + ")";
    return out;
}

void check(CUresult rc, const char* what) {
    if (rc != CUDA_SUCCESS) throw CudaError(std::string(what) + " failed: " + result_text(rc));
}

}  // namespace engc
