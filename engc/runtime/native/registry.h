// Modules and functions this process loaded, so a stale or made-up handle from Python raises
// ValueError instead of crashing in the driver. Touched only while holding the GIL.
#pragma once

#include "cuda_driver.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace engc {

struct FunctionInfo {
    CUmodule module;
    CUcontext context;
    std::string name;
    int max_dynamic_shared;  // the driver's limit: queried at get_function (48 KiB - static), then as last set
    bool pdl = false;        // launched with programmatic stream serialization (set_pdl)
};

struct ModuleInfo {
    CUcontext context;
    std::vector<std::uintptr_t> functions;
};

struct Registry {
    std::unordered_map<std::uintptr_t, ModuleInfo> modules;
    std::unordered_map<std::uintptr_t, FunctionInfo> functions;
    // Bumped by every unload, so a Launch re-checks its function only after one happened.
    std::uint64_t generation = 0;

    ModuleInfo& module(std::uintptr_t handle);
    FunctionInfo& function(std::uintptr_t handle);
};

Registry& registry();

// The context current on this thread; when none is (or `device` >= 0 names another device), the
// primary context of `device` (0 when negative) is retained once and made current. That is the context
// torch uses, so tensors and kernels share it.
CUcontext ensure_context(int device);

// Raises the function's dynamic shared-memory limit if `bytes` exceeds it (by default 48 KiB minus the
// kernel's static shared memory).
void reserve_dynamic_shared(std::uintptr_t func, FunctionInfo& info, int bytes);

}  // namespace engc
