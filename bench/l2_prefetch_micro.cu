// Micro kernels for bench/l2_prefetch_device.py: does an L2 prefetch issued by a short kernel hold that
// kernel up, and does a reader that follows find the lines in L2? Compiled here (nvcc -cubin, sm_90a).
#include <stdint.h>

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A latency-bound kernel's stand-in (the decode attention): issue the prefetch of [p, p + bytes) as `mode`
// says (0 none, 1 cp.async.bulk.prefetch.L2 of 4 KB chunks, 2 prefetch.global.L2 a 128-byte line,
// 3 prefetch.global.L2::evict_last a line), then spin for `spin_ns`.
extern "C" __global__ void window(const char* p, long long bytes, int mode, long long spin_ns) {
    const uint64_t t0 = now_ns();
    const long long threads = (long long)gridDim.x * blockDim.x, me = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (mode == 1) {
        for (long long off = me * 4096; off < bytes; off += threads * 4096) {
            const uint32_t n = (uint32_t)min(4096LL, bytes - off);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + off), "r"(n) : "memory");
        }
    } else if (mode == 2) {
        for (long long off = me * 128; off < bytes; off += threads * 128)
            asm volatile("prefetch.global.L2 [%0];" :: "l"(p + off));
    } else if (mode == 3) {
        for (long long off = me * 128; off < bytes; off += threads * 128)
            asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p + off));
    }
    while (now_ns() - t0 < (uint64_t)spin_ns) { }
}

// The GEMV's loads (templates/int4_gemv.cu.j2's load_w): stream [p, p + n16 * 16) once, XOR into out.
extern "C" __global__ void stream_read(const uint4* p, long long n16, unsigned* out) {
    const long long threads = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += threads) {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 { %0, %1, %2, %3 }, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i));
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;   // keeps the loads
}

// Evicts L2: writes n16 16-byte words.
extern "C" __global__ void flush(uint4* p, long long n16) {
    const long long threads = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += threads)
        p[i] = make_uint4((unsigned)i, 0, 0, 0);
}
