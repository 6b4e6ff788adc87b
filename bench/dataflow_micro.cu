// Micro kernel for bench/dataflow_device.py: the skeleton of a dataflow decode step. One persistent CTA an
// SM; its producer warp streams the CTA's share of every GEMV phase of the step, in order, into a ring of
// shared-memory stages (cp.async.bulk, one mbarrier pair a stage) and never waits on anything but a free
// stage; its consumer warps wait, per phase, only on the counter of the phase whose output that phase reads
// (no grid barrier), then consume the phase's stages and add one to the phase's own counter. So the weights
// keep streaming while the consumers wait out the latency-bound phases (norms, attention), as far ahead as
// the ring holds: what persistent_chain_micro.cu's grid-barrier forms could not do (their CTAs loaded only
// between barriers). Only the skeleton runs: "consuming" folds the bytes into a checksum plus `work` rounds
// of integer math a 16-byte word (the dequant and FMAs of a real GEMV); a latency phase spins its CTAs.
// Compiled here: nvcc -cubin -arch=sm_90a -O3 -o DIR/dataflow.cubin bench/dataflow_micro.cu
#include <stdint.h>

namespace {

constexpr int MAX_STAGES = 64;
constexpr unsigned long long GIVE_UP_NS = 50000000ull;   // a wait this long is a bug: flag it and go on

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void spin(uint64_t ns) {
    const uint64_t t0 = now_ns();
    while (now_ns() - t0 < ns) { }
}

__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem(bar)) : "memory");
}

// The producer's arrival on a full barrier: it also sets the bytes the stage's copy will complete.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem(bar)), "r"(bytes) : "memory");
}

// Some wait gave up somewhere: every other wait stops too (one broken launch costs one GIVE_UP_NS, not one a
// wait), and the host sees the flag.
__device__ __forceinline__ bool aborted(const unsigned* err) { return *(const volatile unsigned*)err != 0; }

// Waits for the barrier's phase `parity` to complete; false (and the error flag set) after GIVE_UP_NS. Only
// try_wait in the loop: reading the flag or the clock at every turn put ~0.3 us on every stage (measured: the
// first run's time grew with the number of stages, not the bytes), as a ring that fills turns both sides' waits
// into a chain of polls.
__device__ __forceinline__ bool mbar_wait(uint64_t* bar, unsigned parity, unsigned* err) {
    unsigned done = 0;
    uint64_t t0 = 0;
    for (unsigned n = 1;; ++n) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
        if (done) return true;
        if (n % 4096) continue;
        if (aborted(err)) return false;
        if (!t0) t0 = now_ns();
        else if (now_ns() - t0 > GIVE_UP_NS) { atomicOr(err, 1u); return false; }
    }
}

// bytes (a multiple of 16) from global to shared memory by the copy engine; completes on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem(dst)), "l"(src), "r"(bytes), "r"(smem(bar)) : "memory");
}

// 16 bytes global -> shared by the LSU (cp.async, L2 only: the weights are read once).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem(dst)), "l"(src) : "memory");
}

// The consumer warps' own barrier (the producer warp never joins it).
__device__ __forceinline__ void consumers_sync(int threads) {
    asm volatile("bar.sync 1, %0;" :: "r"(threads) : "memory");
}

// Thread 0 of the consumers polls a phase counter until it reaches target (the counters only grow, across
// launches too: the host's targets count launches), then the others are let through.
__device__ __forceinline__ void wait_counter(const unsigned* c, unsigned target, int poll_ns, int threads,
                                             unsigned* err) {
    if (threadIdx.x == 32) {
        uint64_t t0 = 0;
        unsigned seen;
        for (unsigned n = 1;; ++n) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(c) : "memory");
            if ((int)(seen - target) >= 0) break;
            if (poll_ns) __nanosleep(poll_ns);
            if (n % 256) continue;
            if (aborted(err)) break;
            if (!t0) t0 = now_ns();
            else if (now_ns() - t0 > GIVE_UP_NS) { atomicOr(err, 2u); break; }
        }
    }
    consumers_sync(threads);
}

__device__ __forceinline__ void signal(unsigned* c, int threads) {
    consumers_sync(threads);   // every consumer's part of the phase is done before the release
    if (threadIdx.x == 32) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(c) : "memory");
}

// A CTA's share [lo, hi) of n16 16-byte words dealt to `ctas` CTAs in contiguous ranges (a GEMV's rows).
__device__ __forceinline__ void share(long long n16, int cta, int ctas, long long& lo, long long& hi) {
    lo = n16 * cta / ctas;
    hi = n16 * (cta + 1) / ctas;
}

}  // namespace

// Phase p: kind 0 a GEMV (len16[p] words at w + off16[p], each CTA its share, all CTAs add to counters[p]);
// kind 1 a latency phase on CTAs below busy[p] (spin wait_ns[p], each adds to counters[p]); kind 2 a latency
// phase every CTA runs for itself (a norm each CTA recomputes: no counter, no extra hop). dep[p] >= 0: the
// consumers first wait for counters[dep[p]] to reach epoch * need[p] (skipped if this CTA last waited on that
// same counter). deps = 0: no waits at all (the ring's streaming alone). sink[0] += the checksum of every word
// consumed, sink[1] the work's result (kept), sink[2] error flags (1 a stage wait, 2 a counter wait gave up).
// issuers: producer lanes taking turns at the stages (stage i: lane i % issuers); pieces: bulk copies a stage
// (16-byte multiples). Both probe the first run's finding that an SM's copies did not overlap. issuers 0: no
// bulk copies, the whole producer warp copies each stage with cp.async, 16 bytes a lane an instruction.
template <int CW>
__device__ __forceinline__ void dataflow_body(const uint4* w, const long long* off16, const long long* len16,
                                              const int* kind, const int* busy, const long long* wait_ns,
                                              const int* dep, const unsigned* need, int phases, unsigned* counters,
                                              unsigned epoch, unsigned* sink, int stages, int stage16, int deps,
                                              int work, int poll_ns, int issuers, int pieces) {
    extern __shared__ __align__(128) uint4 ring[];
    __shared__ __align__(8) uint64_t full[MAX_STAGES], empty[MAX_STAGES];
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            // the producer's expect_tx arrival (plus the copy's bytes), or each producer lane's cp.async arrival
            mbar_init(&full[s], issuers ? 1 : 32);
            mbar_init(&empty[s], CW);   // one arrival a consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    unsigned* err = sink + 2;
    long long it = 0;   // stages issued (producer) or taken (consumers) so far, across phases
    if (threadIdx.x < 32) {   // the producer warp
        // every stage of this CTA's share of each GEMV phase, in order: f(stage, its ring slot, its source,
        // its 16-byte words) once the slot is free; a wait that gives up ends the walk
        auto each_stage = [&](auto f) {
            for (int p = 0; p < phases; ++p) {
                if (kind[p] != 0) continue;
                long long lo, hi;
                share(len16[p], blockIdx.x, gridDim.x, lo, hi);
                for (long long b = lo; b < hi; b += stage16, ++it) {
                    if (issuers && (int)(it % issuers) != (int)threadIdx.x) continue;   // another lane's turn
                    const int s = (int)(it % stages);
                    const long long round = it / stages;
                    if (round > 0 && !mbar_wait(&empty[s], (unsigned)((round - 1) & 1), err)) return;
                    f(s, ring + (long long)s * stage16, w + off16[p] + b, min((long long)stage16, hi - b));
                }
            }
        };
        if (issuers == 0) {   // by cp.async, the whole warp: 16 bytes a lane an instruction
            each_stage([&](int s, uint4* dst, const uint4* src, long long n16) {
                for (long long i = threadIdx.x; i < n16; i += 32) cp_async16(dst + i, src + i);
                // the barrier's arrival of this lane, once its copies so far have landed
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(smem(&full[s])) : "memory");
            });
        } else if ((int)threadIdx.x < issuers) {   // by bulk copies, lanes below `issuers` taking turns
            each_stage([&](int s, uint4* dst, const uint4* src, long long n16) {
                mbar_expect(&full[s], (unsigned)(n16 * 16));
                const long long step = (n16 + pieces - 1) / pieces;   // `pieces` copies, one barrier
                for (long long o = 0; o < n16; o += step)
                    bulk_load(dst + o, src + o, (unsigned)(min(step, n16 - o) * 16), &full[s]);
            });
        }
        return;
    }
    const int threads = 32 * CW, t = threadIdx.x - 32;
    unsigned sum = 0, mix0 = t, mix1 = t * 3u, mix2 = t * 5u, mix3 = t * 7u;
    int waited = -1;
    for (int p = 0; p < phases; ++p) {
        const int k = kind[p], d = dep[p];
        if (k == 1 && (int)blockIdx.x >= busy[p]) continue;   // not one of this latency phase's CTAs
        if (deps && d >= 0 && d != waited) {
            wait_counter(counters + d, epoch * need[p], poll_ns, threads, err);
            waited = d;
        }
        if (k != 0) {
            spin(wait_ns[p]);
            if (k == 1) signal(counters + p, threads);
            continue;
        }
        long long lo, hi;
        share(len16[p], blockIdx.x, gridDim.x, lo, hi);
        for (long long b = lo; b < hi; b += stage16, ++it) {
            const int s = (int)(it % stages);
            if (!mbar_wait(&full[s], (unsigned)((it / stages) & 1), err)) return;
            const int n = (int)min((long long)stage16, hi - b);
            const uint4* st = ring + (long long)s * stage16;
            for (int i = t; i < n; i += threads) {
                const uint4 v = st[i];
                sum += v.x + v.y + v.z + v.w;
                for (int r = 0; r < work; ++r) {   // four independent chains, as a GEMV's accumulators
                    mix0 = mix0 * 1664525u + (v.x >> (r & 7));
                    mix1 = mix1 * 1664525u + (v.y >> (r & 7));
                    mix2 = mix2 * 1664525u + (v.z >> (r & 7));
                    mix3 = mix3 * 1664525u + (v.w >> (r & 7));
                }
            }
            __syncwarp();
            if ((t & 31) == 0) mbar_arrive(&empty[s]);
        }
        signal(counters + p, threads);
    }
    atomicAdd(sink, sum);
    const unsigned mix = mix0 ^ mix1 ^ mix2 ^ mix3;
    if (mix == 0x9e3779b9u) sink[1] = mix;   // never true in practice: keeps the work
}

#define DATAFLOW(CW)                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * (CW + 1), 1) dataflow_c##CW(                                \
            const uint4* w, const long long* off16, const long long* len16, const int* kind, const int* busy,     \
            const long long* wait_ns, const int* dep, const unsigned* need, int phases, unsigned* counters,     \
            unsigned epoch, unsigned* sink, int stages, int stage16, int deps, int work, int poll_ns,           \
            int issuers, int pieces) {                                                                            \
        dataflow_body<CW>(w, off16, len16, kind, busy, wait_ns, dep, need, phases, counters, epoch, sink,         \
                          stages, stage16, deps, work, poll_ns, issuers, pieces);                                \
    }

DATAFLOW(4)
DATAFLOW(8)
DATAFLOW(12)
