// Micro kernels for bench/persistent_chain_device.py: how fast can a decode step's weights stream when the
// step is many dependent kernels (engc today: 7 launches a layer) against one persistent kernel whose phases
// are separated by grid barriers? Only the weight loads and the latency-bound steps between them are modeled
// (no math): a GEMV phase streams its bytes once, a "wait" phase spins some CTAs for a while (the norms and
// the decode attention: short, latency-bound kernels that leave DRAM idle). Compiled here (nvcc -cubin).
#include <stdint.h>

namespace {

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The GEMVs' weight load (templates/int4_gemv.cu.j2's load_w): read once, no L1 allocation.
__device__ __forceinline__ uint4 load_w(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// This CTA's share [lo, hi) of n16 16-byte words dealt to `ctas` CTAs in contiguous ranges (a GEMV's rows).
__device__ __forceinline__ void share(long long n16, int cta, int ctas, long long& lo, long long& hi) {
    lo = n16 * cta / ctas;
    hi = n16 * (cta + 1) / ctas;
}

// One round of U loads a thread, U * blockDim words from base (masked at hi).
template <int U>
__device__ __forceinline__ void issue(const uint4* w, long long base, long long hi, uint4 (&v)[U]) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
        const long long i = base + (long long)k * blockDim.x + threadIdx.x;
        v[k] = i < hi ? load_w(w + i) : make_uint4(0, 0, 0, 0);
    }
}

template <int U>
__device__ __forceinline__ unsigned fold_all(const uint4 (&v)[U]) {
    unsigned acc = 0;
#pragma unroll
    for (int k = 0; k < U; ++k) acc ^= fold(v[k]);
    return acc;
}

// Streams [lo, hi) in rounds of U loads a thread; the first `skip` words were taken some other way.
template <int U>
__device__ __forceinline__ unsigned stream(const uint4* w, long long lo, long long hi, long long skip) {
    unsigned acc = 0;
    for (long long base = lo + skip; base < hi; base += (long long)U * blockDim.x) {
        uint4 v[U];
        issue<U>(w, base, hi, v);
        acc ^= fold_all<U>(v);
    }
    return acc;
}

__device__ __forceinline__ void spin(uint64_t ns) {
    const uint64_t t0 = now_ns();
    while (now_ns() - t0 < ns) { }
}

__device__ __forceinline__ void keep(unsigned acc, unsigned* sink) {
    if (acc == 0x9e3779b9u) sink[0] = acc;   // never true in practice: keeps the loads
}

// Grid barrier number `round` (1, 2, ...) of launch `epoch`: the counter only grows, so no reset between
// launches. Thread 0 of each CTA arrives and polls; the CTA waits on it.
// mode 0: a fence, then atomicAdd (a round trip); mode 1: red.release (no value back, release order instead
// of the fence), polled the same way; mode 2: as 1, polls 100 ns apart (528 pollers in a tight loop on one
// line slow the arrivals themselves: 12 us a barrier with nothing else running).
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target, int mode) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (mode == 0) {
            __threadfence();
            atomicAdd(counter, 1u);
        } else {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
        }
        unsigned seen;
        long long tries = 0;
        do {
            if (mode == 2 && tries) __nanosleep(100);
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        } while ((int)(seen - target) < 0 && ++tries < (1ll << 22));   // a bug or a CTA not resident: give up
    }
    __syncthreads();
}

// cp.async of 16 bytes global -> shared (L2 only, as the weights are read once).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
}

}  // namespace

// The separate-kernel form, one launch a phase. mode 3 = as 2, but before the wait each CTA copies the first
// smem_words of its share into shared memory (cp.async; a whole share where it fits: the o and QKV
// projections of an int4 8B step) and streams only the rest after it: a GEMV launched behind a latency-bound
// kernel (the attention, a norm) fills that kernel's DRAM-idle time with its own weights. n16 > 0: a GEMV phase (each CTA its contiguous share);
// n16 == 0: a wait phase, CTAs below `busy` spin wait_ns. mode: 0 = plain (no PDL instructions run as
// no-ops when launched without the attribute), 1 = PDL as engc's kernels: wait, then launch_dependents,
// then everything; 2 = the first round of loads before the wait (their weights do not depend on it).
template <int U>
__device__ __forceinline__ void phase_body(const uint4* w, long long n16, int busy, long long wait_ns,
                                           unsigned* sink, int mode, int smem_words) {
    extern __shared__ uint4 stash[];
    if (n16 == 0) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        if ((int)blockIdx.x < busy) spin(wait_ns);
        return;
    }
    long long lo, hi;
    share(n16, blockIdx.x, gridDim.x, lo, hi);
    unsigned acc = 0;
    long long skip = 0;
    if (mode == 3) {
        const long long n = min((long long)smem_words, hi - lo);
        for (long long i = threadIdx.x; i < n; i += blockDim.x) cp_async16(stash + i, w + lo + i);
        asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        for (long long i = threadIdx.x; i < n; i += blockDim.x) acc ^= fold(stash[i]);
        skip = n;
    } else if (mode == 2) {
        uint4 v[U];
        issue<U>(w, lo, hi, v);
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        acc = fold_all<U>(v);
        skip = (long long)U * blockDim.x;
    } else {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    acc ^= stream<U>(w, lo, hi, skip);
    keep(acc, sink);
}

extern "C" __global__ void __launch_bounds__(128) phase_u4(const uint4* w, long long n16, int busy,
                                                           long long wait_ns, unsigned* sink, int mode,
                                                           int smem_words) {
    phase_body<4>(w, n16, busy, wait_ns, sink, mode, smem_words);
}

extern "C" __global__ void __launch_bounds__(128) phase_u8(const uint4* w, long long n16, int busy,
                                                           long long wait_ns, unsigned* sink, int mode,
                                                           int smem_words) {
    phase_body<8>(w, n16, busy, wait_ns, sink, mode, smem_words);
}

constexpr int MAX_PHASES = 256;

// The persistent form: every phase of the step in one launch, a grid barrier after each. Phase p reads
// w + off16[p], len16[p] words (0: a wait phase: CTAs below busy[p] spin wait_ns[p]). prefetch: at each
// barrier, the next GEMV phase's loads (which do not depend on the barrier) start before it: 0 = none;
// 1 = the first round of the CTA's share into registers; 2 = the first smem_words of its share into shared
// memory by cp.async. Held across wait phases, taken when that GEMV phase starts. All CTAs must be resident
// at once (the host sizes the grid).
template <int U>
__device__ __forceinline__ void persistent_body(const uint4* w, const long long* off16, const long long* len16,
                                                const int* busy, const long long* wait_ns, int phases,
                                                unsigned* counter, unsigned epoch, unsigned* sink, int prefetch,
                                                int smem_words, int barrier_mode) {
    extern __shared__ uint4 stash[];
    // The phase table in shared memory, with each phase's next GEMV phase: read from global memory at every
    // barrier it put a chain of L2 round trips on each one (and a scan over the remaining phases).
    __shared__ long long s_off[MAX_PHASES], s_len[MAX_PHASES], s_wait[MAX_PHASES];
    __shared__ int s_busy[MAX_PHASES], s_next[MAX_PHASES];
    for (int i = threadIdx.x; i < phases; i += blockDim.x) {
        s_off[i] = off16[i];
        s_len[i] = len16[i];
        s_wait[i] = wait_ns[i];
        s_busy[i] = busy[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int next = phases;
        for (int i = phases - 1; i >= 0; --i) {
            s_next[i] = next;
            if (s_len[i]) next = i;
        }
    }
    __syncthreads();
    const unsigned base_target = (epoch - 1) * (unsigned)(phases - 1) * gridDim.x;   // epoch counts from 1
    unsigned acc = 0;
    uint4 v[U];
    int pending = -1;   // the phase whose first words are already on their way (registers or stash)
    for (int p = 0; p < phases; ++p) {
        const long long n16 = s_len[p];
        if (n16 == 0) {
            if ((int)blockIdx.x < s_busy[p]) spin(s_wait[p]);
        } else {
            long long lo, hi, skip = 0;
            share(n16, blockIdx.x, gridDim.x, lo, hi);
            if (pending == p && prefetch == 1) {
                acc ^= fold_all<U>(v);
                skip = (long long)U * blockDim.x;
            } else if (pending == p && prefetch == 2) {
                asm volatile("cp.async.wait_all;" ::: "memory");
                __syncthreads();
                skip = min((long long)smem_words, hi - lo);
                for (long long i = threadIdx.x; i < skip; i += blockDim.x) acc ^= fold(stash[i]);
                __syncthreads();
            }
            pending = -1;
            acc ^= stream<U>(w + s_off[p], lo, hi, skip);
        }
        if (p + 1 == phases) break;
        const int q = s_next[p];
        if (prefetch && q < phases && pending != q) {
            long long lo, hi;
            share(s_len[q], blockIdx.x, gridDim.x, lo, hi);
            const uint4* qw = w + s_off[q];
            if (prefetch == 1) {
                issue<U>(qw, lo, hi, v);
            } else {
                const long long n = min((long long)smem_words, hi - lo);
                for (long long i = threadIdx.x; i < n; i += blockDim.x) cp_async16(stash + i, qw + lo + i);
                asm volatile("cp.async.commit_group;" ::: "memory");
            }
            pending = q;
        }
        grid_barrier(counter, base_target + (unsigned)(p + 1) * gridDim.x, barrier_mode);
    }
    keep(acc, sink);
}

extern "C" __global__ void __launch_bounds__(128) persistent_u4(
        const uint4* w, const long long* off16, const long long* len16, const int* busy, const long long* wait_ns,
        int phases, unsigned* counter, unsigned epoch, unsigned* sink, int prefetch, int smem_words,
        int barrier_mode) {
    persistent_body<4>(w, off16, len16, busy, wait_ns, phases, counter, epoch, sink, prefetch, smem_words,
                        barrier_mode);
}

extern "C" __global__ void __launch_bounds__(128) persistent_u8(
        const uint4* w, const long long* off16, const long long* len16, const int* busy, const long long* wait_ns,
        int phases, unsigned* counter, unsigned epoch, unsigned* sink, int prefetch, int smem_words,
        int barrier_mode) {
    persistent_body<8>(w, off16, len16, busy, wait_ns, phases, counter, epoch, sink, prefetch, smem_words,
                        barrier_mode);
}
