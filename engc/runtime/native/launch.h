// One prepared kernel launch: function, grid, block, shared memory and packed arguments, built once and
// fired many times, so the decode loop pays for argument conversion only when an argument changes.
#pragma once

#include <pybind11/pybind11.h>

#include "args.h"
#include "cuda_driver.h"

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace engc {

using Grid = std::array<unsigned int, 3>;

// An int or a sequence of 1 to 3 ints (missing dimensions are 1), checked against the driver's limits.
Grid parse_grid(pybind11::handle grid);
// Checked block size (1..1024 threads) and shared-memory bytes (>= 0).
unsigned int check_block(long long block_x);
unsigned int check_shared(long long shared_mem);

// cuLaunchKernel (cuLaunchKernelEx with programmatic stream serialization when `pdl` and the driver
// has it); makes `context` current and retries once when the calling thread has no context.
// Launches with an empty grid are skipped, as Triton's launcher does. Needs no GIL.
CUresult launch_kernel(CUfunction func, CUcontext context, const Grid& grid, unsigned int block_x,
                       unsigned int shared_mem, CUstream stream, void** params, bool pdl = false);

// CudaError naming the kernel and the CUresult.
[[noreturn]] void raise_launch_error(CUresult rc, const std::string& kernel);

class Launch {
public:
    Launch(std::uintptr_t func, pybind11::handle grid, long long block_x, long long shared_mem,
           const std::string& signature, pybind11::handle args);

    // Raises ValueError when the function's module was unloaded since this launch was last checked.
    void validate();
    // Launches on `stream` (validate() first); holds no Python state, so it may run without the GIL.
    CUresult fire(CUstream stream) {
        return launch_kernel(func_, context_, grid_, block_x_, shared_mem_, stream, args_.params(), pdl_);
    }
    // validate() + fire() + raise on failure.
    void operator()(std::uintptr_t stream);

    void set_arg(std::size_t index, pybind11::handle value);
    void set_grid(pybind11::handle grid);

    const std::string& name() const { return name_; }
    const Grid& grid() const { return grid_; }
    unsigned int block_x() const { return block_x_; }
    unsigned int shared_mem() const { return shared_mem_; }
    std::uintptr_t func() const { return reinterpret_cast<std::uintptr_t>(func_); }
    const PackedArgs& args() const { return args_; }

private:
    CUfunction func_;
    CUcontext context_;
    std::string name_;
    Grid grid_;
    unsigned int block_x_;
    unsigned int shared_mem_;
    PackedArgs args_;
    std::uint64_t generation_;
    bool pdl_;
};

// Fires launches in order on one stream with the GIL released; the whole batch is validated first.
// On a failed launch, the ones before it have been queued and the error names its index and kernel.
void launch_all(const std::vector<std::shared_ptr<Launch>>& launches, std::uintptr_t stream);

// A fixed sequence of launches fired by one call: the cheapest path for a decode step.
class LaunchPlan {
public:
    explicit LaunchPlan(pybind11::iterable launches);
    void operator()(std::uintptr_t stream) { launch_all(launches_, stream); }
    std::size_t size() const { return launches_.size(); }
    const std::vector<std::shared_ptr<Launch>>& launches() const { return launches_; }

private:
    std::vector<std::shared_ptr<Launch>> launches_;
};

std::vector<std::shared_ptr<Launch>> collect_launches(pybind11::iterable launches);

}  // namespace engc
