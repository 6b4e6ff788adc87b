#include "launch.h"

#include "registry.h"

#include <limits>

namespace py = pybind11;

namespace engc {
namespace {

long long as_dimension(py::handle value, const char* what) {
    if (!PyLong_Check(value.ptr()) && !PyIndex_Check(value.ptr())) {
        throw py::type_error(std::string(what) + " must be an int, got " + Py_TYPE(value.ptr())->tp_name);
    }
    int overflow = 0;
    py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(value.ptr()));
    if (!index) throw py::error_already_set();
    long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0) throw py::value_error(std::string(what) + " is out of range");
    return v;
}

}  // namespace

Grid parse_grid(py::handle grid) {
    Grid out{1, 1, 1};
    static const long long limits[3] = {std::numeric_limits<int>::max(), 65535, 65535};
    static const char* names[3] = {"grid x", "grid y", "grid z"};
    if (PyLong_Check(grid.ptr())) {
        long long x = as_dimension(grid, names[0]);
        if (x < 0 || x > limits[0]) throw py::value_error("grid x must be in 0.." + std::to_string(limits[0]));
        out[0] = static_cast<unsigned int>(x);
        return out;
    }
    if (!PySequence_Check(grid.ptr())) {
        throw py::type_error(std::string("grid must be an int or a tuple of 1 to 3 ints, got ") +
                             Py_TYPE(grid.ptr())->tp_name);
    }
    py::sequence dims = py::reinterpret_borrow<py::sequence>(grid);
    const std::size_t n = dims.size();
    if (n < 1 || n > 3) throw py::value_error("grid must have 1 to 3 dimensions, got " + std::to_string(n));
    for (std::size_t i = 0; i < n; ++i) {
        long long v = as_dimension(dims[i], names[i]);
        if (v < 0 || v > limits[i]) {
            throw py::value_error(std::string(names[i]) + " must be in 0.." + std::to_string(limits[i]) + ", got " +
                                  std::to_string(v));
        }
        out[i] = static_cast<unsigned int>(v);
    }
    return out;
}

unsigned int check_block(long long block_x) {
    if (block_x < 1 || block_x > 1024) {
        throw py::value_error("block_x must be in 1..1024 threads, got " + std::to_string(block_x));
    }
    return static_cast<unsigned int>(block_x);
}

unsigned int check_shared(long long shared_mem) {
    if (shared_mem < 0 || shared_mem > std::numeric_limits<int>::max()) {
        throw py::value_error("shared_mem must be a non-negative byte count, got " + std::to_string(shared_mem));
    }
    return static_cast<unsigned int>(shared_mem);
}

namespace {

CUresult fire_once(const Driver& d, CUfunction func, const Grid& grid, unsigned int block_x, unsigned int shared_mem,
                   CUstream stream, void** params, bool pdl) {
    if (!pdl || d.cuLaunchKernelEx == nullptr) {
        return d.cuLaunchKernel(func, grid[0], grid[1], grid[2], block_x, 1, 1, shared_mem, stream, params, nullptr);
    }
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmatic_stream_serialization_allowed = 1;
    CUlaunchConfig config{grid[0], grid[1], grid[2], block_x, 1, 1, shared_mem, stream, &attr, 1};
    return d.cuLaunchKernelEx(&config, func, params, nullptr);
}

}  // namespace

CUresult launch_kernel(CUfunction func, CUcontext context, const Grid& grid, unsigned int block_x,
                       unsigned int shared_mem, CUstream stream, void** params, bool pdl) {
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return CUDA_SUCCESS;
    const Driver& d = driver();
    CUresult rc = fire_once(d, func, grid, block_x, shared_mem, stream, params, pdl);
    if (rc == CUDA_ERROR_INVALID_CONTEXT) {
        // A thread that never touched CUDA (say, a server worker) has no current context yet.
        CUcontext current = nullptr;
        if (d.cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == nullptr &&
            d.cuCtxSetCurrent(context) == CUDA_SUCCESS) {
            rc = fire_once(d, func, grid, block_x, shared_mem, stream, params, pdl);
        }
    }
    return rc;
}

void raise_launch_error(CUresult rc, const std::string& kernel) {
    throw CudaError("cuLaunchKernel failed for kernel '" + kernel + "': " + result_text(rc));
}

Launch::Launch(std::uintptr_t func, py::handle grid, long long block_x, long long shared_mem,
               const std::string& signature, py::handle args)
    : func_(reinterpret_cast<CUfunction>(func)),
      context_(nullptr),
      grid_(parse_grid(grid)),
      block_x_(check_block(block_x)),
      shared_mem_(check_shared(shared_mem)),
      args_(ArgLayout::parse(signature)),
      generation_(registry().generation),
      pdl_(false) {
    FunctionInfo& info = registry().function(func);
    context_ = info.context;
    pdl_ = info.pdl;
    name_ = info.name;
    args_.pack_all(args.ptr());
    reserve_dynamic_shared(func, info, static_cast<int>(shared_mem_));
}

void Launch::validate() {
    Registry& reg = registry();
    if (generation_ == reg.generation) return;
    if (reg.functions.find(func()) == reg.functions.end()) {
        throw py::value_error("kernel '" + name_ + "' belongs to a module that was unloaded");
    }
    generation_ = reg.generation;
}

void Launch::operator()(std::uintptr_t stream) {
    validate();
    CUresult rc = fire(reinterpret_cast<CUstream>(stream));
    if (rc != CUDA_SUCCESS) raise_launch_error(rc, name_);
}

void Launch::set_arg(std::size_t index, py::handle value) { args_.pack_one(index, value.ptr()); }

void Launch::set_grid(py::handle grid) { grid_ = parse_grid(grid); }

std::vector<std::shared_ptr<Launch>> collect_launches(py::iterable launches) {
    std::vector<std::shared_ptr<Launch>> out;
    if (PySequence_Check(launches.ptr())) out.reserve(py::len(launches));
    for (py::handle item : launches) {
        if (!py::isinstance<Launch>(item)) {
            throw py::type_error(std::string("expected Launch objects, got ") + Py_TYPE(item.ptr())->tp_name);
        }
        out.push_back(item.cast<std::shared_ptr<Launch>>());
    }
    return out;
}

void launch_all(const std::vector<std::shared_ptr<Launch>>& launches, std::uintptr_t stream) {
    for (const auto& launch : launches) launch->validate();
    std::size_t failed = launches.size();
    CUresult rc = CUDA_SUCCESS;
    {
        py::gil_scoped_release release;
        const CUstream s = reinterpret_cast<CUstream>(stream);
        for (std::size_t i = 0; i < launches.size(); ++i) {
            rc = launches[i]->fire(s);
            if (rc != CUDA_SUCCESS) {
                failed = i;
                break;
            }
        }
    }
    if (failed < launches.size()) {
        throw CudaError("cuLaunchKernel failed for launch " + std::to_string(failed) + " of " +
                        std::to_string(launches.size()) + " (kernel '" + launches[failed]->name() +
                        "'): " + result_text(rc));
    }
}

LaunchPlan::LaunchPlan(py::iterable launches) : launches_(collect_launches(launches)) {}

}  // namespace engc
