// CUDA C++ kernels on the CPU, for tests: the subset of CUDA that the project's kernels use,
// so that `kernels/*.cu` compile unchanged as C++ and run on the host.
//
// One library per kernel source (a CUDA module), built with hidden visibility: each has
// its own runtime state, and exports only its kernels' entry points.
//
// A launch runs its blocks one after another. A block's threads are cooperative fibers
// (ucontext), each on a stack of its own, switched only at a barrier: `__syncthreads`
// waits for every thread of the block, and a warp shuffle or `__syncwarp` for every lane of
// the thread's warp. Nothing runs concurrently, so `__shared__` variables are plain statics
// (one block at a time) and atomics are plain reads and writes.
//
// Shared memory, static and dynamic, starts each block as 0xff bytes (NaN floats), so a
// read of what no thread wrote shows.
//
// What a GPU leaves undefined is an error here, named with the kernel, block and thread:
// a thread that returns or waits elsewhere while others wait at `__syncthreads` (a barrier
// in divergent code), a shuffle whose mask leaves out a lane of the warp, a pointer
// argument not aligned to its type, and (with guarded buffers, see the crate's `Guarded`)
// a read or write past a buffer's end or past the dynamic shared memory the launch asked
// for, caught as the fault it raises.
//
// The C entry point of kernel K is `emu_launch_K` (EMU_KERNEL(K) after the sources): its
// arguments as cuLaunchKernel takes them (an array of pointers to the values), with their
// sizes checked against K's parameters.

#ifndef ROOKWORLD_CUDA_EMU_H
#define ROOKWORLD_CUDA_EMU_H

#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One block at a time: a block's shared memory is a static of the kernel (the loader
// follows each declaration with ::emu::enter_shared, which fills it with 0xff bytes at the
// start of each block).
#define __shared__ static

// ---- vector types ----------------------------------------------------------------------
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// ---- device functions --------------------------------------------------------------------
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline unsigned __float_as_uint(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
inline int __float_as_int(float x) { return (int)__float_as_uint(x); }
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
template <class T> inline T atomicMin(T *p, T v) {
    const T old = *p;
    if (v < old) *p = v;
    return old;
}
template <class T> inline T atomicMax(T *p, T v) {
    const T old = *p;
    if (v > old) *p = v;
    return old;
}
template <class T> inline T atomicAdd(T *p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
#define warpSize 32

// ---- the scheduler -------------------------------------------------------------------------
namespace emu {

constexpr int WARP = 32;
constexpr size_t STACK = 256 * 1024;
constexpr int MAX_THREADS = 1024;
// Dynamic shared memory a block may ask for (an H100's 227 KiB), and a guard page's size.
constexpr size_t SHARED_MAX = 227 * 1024;
constexpr size_t GUARD = 64 * 1024;
// The mapping's part before its guard page: page-aligned (a multiple of 64 KiB).
constexpr size_t SHARED_AREA = 256 * 1024;

enum State { READY, AT_BLOCK, AT_WARP, DONE };

struct Thread {
    ucontext_t ctx;
    uint3 idx;
    State state;
};

// The launch in progress (one at a time: `launch` holds `lock`).
struct Launch {
    const char *kernel;
    dim3 grid, block;
    uint3 block_idx;
    int n;  // threads per block
    Thread threads[MAX_THREADS];
    char *stacks;
    int current;
    ucontext_t scheduler;
    int at_block;
    int at_warp[MAX_THREADS / WARP];
    uint64_t exchange[MAX_THREADS];
    // Each warp's operands of a matrix product (mma.h's mma_sync), pooled from its lanes.
    float mma[MAX_THREADS / WARP][2][256];
    void (*body)(void *);
    void *closure;
    char error[512];
    bool failed;
    // A fault's jump back to `run`.
    sigjmp_buf fault;
    // The launch's dynamic shared memory: its bytes end at a guard page, so a read or
    // write past the size the launch asked for faults; each block's starts as 0xff bytes
    // (NaN floats), so a read of what no thread wrote shows.
    char *shared_map;
    size_t shared_bytes;
    char *dynamic_shared;
};

inline pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
// Blocks started so far, in this library (each block's number).
inline unsigned long long block_serial = 0;
inline Launch *L = nullptr;

inline Thread &self() { return L->threads[L->current]; }
inline int linear(const uint3 &t) {
    return (int)(t.x + L->block.x * (t.y + L->block.y * t.z));
}

inline void fail(const char *what) {
    if (L->failed) return;
    L->failed = true;
    const uint3 t = L->threads[L->current].idx, b = L->block_idx;
    snprintf(L->error, sizeof L->error, "kernel %s, block (%u, %u, %u), thread (%u, %u, %u): %s",
             L->kernel, b.x, b.y, b.z, t.x, t.y, t.z, what);
}

// Switches from the current fiber to the next ready one after it, or back to the scheduler
// when none is (every thread done, waiting, or the launch failed).
inline void yield() {
    const int from = L->current;
    if (!L->failed) {
        for (int k = 1; k <= L->n; ++k) {
            const int next = (from + k) % L->n;
            if (L->threads[next].state == READY) {
                if (next == from) return;
                L->current = next;
                swapcontext(&L->threads[from].ctx, &L->threads[next].ctx);
                return;
            }
        }
    }
    swapcontext(&L->threads[from].ctx, &L->scheduler);
}

inline int warp_lanes(int warp) {
    const int rest = L->n - warp * WARP;
    return rest < WARP ? rest : WARP;
}

inline void sync_block() {
    Thread &t = self();
    if (++L->at_block == L->n) {
        L->at_block = 0;
        for (int i = 0; i < L->n; ++i)
            if (L->threads[i].state == AT_BLOCK) L->threads[i].state = READY;
        return;
    }
    t.state = AT_BLOCK;
    while (t.state == AT_BLOCK && !L->failed) yield();
}

inline void sync_warp(unsigned mask) {
    const int me = linear(self().idx), warp = me / WARP, lanes = warp_lanes(warp);
    const unsigned all = lanes == WARP ? 0xffffffffu : ((1u << lanes) - 1u);
    if ((mask & all) != all) fail("a warp-synchronous call whose mask leaves out lanes of the warp");
    if (++L->at_warp[warp] == lanes) {
        L->at_warp[warp] = 0;
        for (int i = warp * WARP; i < warp * WARP + lanes; ++i)
            if (L->threads[i].state == AT_WARP) L->threads[i].state = READY;
        return;
    }
    Thread &t = self();
    t.state = AT_WARP;
    while (t.state == AT_WARP && !L->failed) yield();
}

// Lane `src` of the caller's warp's `v` (every lane of the warp calls it).
template <class T> inline T exchange(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    const int me = linear(self().idx), warp = me / WARP;
    uint64_t slot = 0;
    memcpy(&slot, &v, sizeof(T));
    L->exchange[me] = slot;
    sync_warp(mask);
    T out;
    memcpy(&out, &L->exchange[warp * WARP + src], sizeof(T));
    sync_warp(mask);
    return out;
}

inline int lane_id() { return linear(self().idx) % WARP; }

extern "C" inline void fiber_main() {
    L->body(L->closure);
    self().state = DONE;
    // uc_link returns to the scheduler.
}

// The launch running on this thread, if any: a fault on it ends that launch.
inline thread_local Launch *active = nullptr;
inline struct sigaction previous_segv, previous_bus;

inline void on_fault(int sig, siginfo_t *info, void *context) {
    if (active) {
        char what[160];
        snprintf(what, sizeof what, "%s at address %p (outside its buffers?)",
                 sig == SIGSEGV ? "segmentation fault" : "bus error", info->si_addr);
        fail(what);
        siglongjmp(active->fault, 1);
    }
    // Not a launch's: the handler that was there before.
    struct sigaction &prev = sig == SIGSEGV ? previous_segv : previous_bus;
    if (prev.sa_flags & SA_SIGINFO) {
        prev.sa_sigaction(sig, info, context);
    } else if (prev.sa_handler == SIG_DFL || prev.sa_handler == SIG_IGN) {
        signal(sig, SIG_DFL);
        raise(sig);
    } else {
        prev.sa_handler(sig);
    }
}

// Installed once, never removed (the library stays loaded): a fault outside a launch goes
// on to the handler installed before.
inline void install_fault_handler() {
    static bool installed = false;
    if (installed) return;
    installed = true;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &previous_segv);
    sigaction(SIGBUS, &action, &previous_bus);
}

// Describes why no thread of the block can go on.
inline void deadlock() {
    int done = 0, at_block = 0, at_warp = 0;
    for (int i = 0; i < L->n; ++i) {
        done += L->threads[i].state == DONE;
        at_block += L->threads[i].state == AT_BLOCK;
        at_warp += L->threads[i].state == AT_WARP;
    }
    for (int i = 0; i < L->n; ++i)
        if (L->threads[i].state != DONE) {
            L->current = i;
            break;
        }
    char what[256];
    snprintf(what, sizeof what,
             "the block cannot go on: %d threads wait at __syncthreads, %d at a warp shuffle or "
             "__syncwarp, %d returned (a barrier in divergent code)",
             at_block, at_warp, done);
    fail(what);
}

// Runs `body` (the kernel's call) for every thread of every block of the grid.
inline int run(const char *kernel, dim3 grid, dim3 block, size_t shared_bytes,
               void (*body)(void *), void *closure, char *err, size_t errlen) {
    pthread_mutex_lock(&lock);
    static Launch launch;
    Launch *l = &launch;
    const int n = (int)(block.x * block.y * block.z);
    if (n < 1 || n > MAX_THREADS || grid.x * grid.y * grid.z == 0) {
        snprintf(err, errlen, "kernel %s: a launch of (%u, %u, %u) blocks of (%u, %u, %u) threads",
                 kernel, grid.x, grid.y, grid.z, block.x, block.y, block.z);
        pthread_mutex_unlock(&lock);
        return 1;
    }
    if (!l->stacks) l->stacks = (char *)malloc(STACK * MAX_THREADS);
    if (shared_bytes > SHARED_MAX) {
        snprintf(err, errlen, "kernel %s: %zu bytes of dynamic shared memory, at most %zu",
                 kernel, shared_bytes, SHARED_MAX);
        pthread_mutex_unlock(&lock);
        return 1;
    }
    if (!l->shared_map) {
        l->shared_map = (char *)mmap(nullptr, SHARED_AREA + GUARD, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (l->shared_map == MAP_FAILED) {
            l->shared_map = nullptr;
            snprintf(err, errlen, "kernel %s: mapping shared memory failed", kernel);
            pthread_mutex_unlock(&lock);
            return 1;
        }
        if (mprotect(l->shared_map + SHARED_AREA, GUARD, PROT_NONE) != 0) {
            snprintf(err, errlen, "kernel %s: protecting shared memory's guard page failed",
                     kernel);
            pthread_mutex_unlock(&lock);
            return 1;
        }
    }
    l->shared_bytes = shared_bytes;
    l->dynamic_shared = l->shared_map + SHARED_AREA - ((shared_bytes + 15) / 16 * 16);
    l->kernel = kernel;
    l->grid = grid;
    l->block = block;
    l->n = n;
    l->body = body;
    l->closure = closure;
    l->failed = false;
    l->error[0] = 0;
    L = l;
    install_fault_handler();
    if (sigsetjmp(l->fault, 1) == 0) {
        active = l;
        for (unsigned bz = 0; bz < grid.z && !l->failed; ++bz)
            for (unsigned by = 0; by < grid.y && !l->failed; ++by)
                for (unsigned bx = 0; bx < grid.x && !l->failed; ++bx) {
                    l->block_idx = {bx, by, bz};
                    ++block_serial;
                    memset(l->dynamic_shared, 0xff, l->shared_bytes);
                    l->at_block = 0;
                    memset(l->at_warp, 0, sizeof l->at_warp);
                    for (int i = 0; i < n; ++i) {
                        Thread &t = l->threads[i];
                        t.idx = {(unsigned)i % block.x, ((unsigned)i / block.x) % block.y,
                                 (unsigned)i / (block.x * block.y)};
                        t.state = READY;
                        getcontext(&t.ctx);
                        t.ctx.uc_stack.ss_sp = l->stacks + (size_t)i * STACK;
                        t.ctx.uc_stack.ss_size = STACK;
                        t.ctx.uc_link = &l->scheduler;
                        makecontext(&t.ctx, (void (*)())fiber_main, 0);
                    }
                    // Until every thread is done: run the first ready one (it runs the
                    // others in turn), and stop when none is ready.
                    for (;;) {
                        int ready = -1, done = 0;
                        for (int i = 0; i < n; ++i) {
                            if (l->threads[i].state == READY && ready < 0) ready = i;
                            done += l->threads[i].state == DONE;
                        }
                        if (done == n || l->failed) break;
                        if (ready < 0) {
                            deadlock();
                            break;
                        }
                        l->current = ready;
                        swapcontext(&l->scheduler, &l->threads[ready].ctx);
                    }
                }
    }
    active = nullptr;
    const bool failed = l->failed;
    if (failed) snprintf(err, errlen, "%s", l->error);
    L = nullptr;
    pthread_mutex_unlock(&lock);
    return failed ? 1 : 0;
}

// A `__shared__` declaration reached by a thread of the running block (the loader adds the
// call after each): its variable is filled with 0xff bytes (NaN floats, -1 ints) the first
// time in each block, so a read of what no thread of the block wrote shows.
struct SharedSeen {
    const void *at;
    unsigned long long block;
};
inline SharedSeen shared_seen[512];
inline int shared_count = 0;

inline void enter_shared(void *at, size_t bytes) {
    for (int i = 0; i < shared_count; ++i) {
        if (shared_seen[i].at != at) continue;
        if (shared_seen[i].block != block_serial) {
            memset(at, 0xff, bytes);
            shared_seen[i].block = block_serial;
        }
        return;
    }
    if (shared_count < (int)(sizeof shared_seen / sizeof shared_seen[0]))
        shared_seen[shared_count++] = {at, block_serial};
    memset(at, 0xff, bytes);
}

// ---- launching a kernel by its parameter types -------------------------------------------

template <class... A> struct Call {
    void (*kernel)(A...);
    void **args;
};

template <class... A, size_t... I>
inline void call(void (*kernel)(A...), void **args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A> *>(args[I])...);
}

template <class... A> inline void body(void *closure) {
    auto *c = static_cast<Call<A...> *>(closure);
    call(c->kernel, c->args, std::index_sequence_for<A...>{});
}

template <class T> inline size_t pointee_align() {
    if constexpr (std::is_pointer_v<T>) {
        using P = std::remove_cv_t<std::remove_pointer_t<T>>;
        if constexpr (std::is_void_v<P>) return 1;
        else return alignof(P);
    } else {
        return 0;
    }
}

// Checks the arguments against the kernel's parameters, then runs it.
template <class... A>
inline int launch(const char *name, void (*kernel)(A...), const unsigned *dims, void **args,
                  const size_t *sizes, size_t nargs, char *err, size_t errlen) {
    constexpr size_t want = sizeof...(A);
    const size_t sizes_of[want + 1] = {sizeof(A)..., 0};
    const size_t aligns[want + 1] = {pointee_align<A>()..., 0};
    if (nargs != want) {
        snprintf(err, errlen, "kernel %s takes %zu arguments, given %zu", name, want, nargs);
        return 1;
    }
    for (size_t i = 0; i < want; ++i) {
        if (sizes[i] != sizes_of[i]) {
            snprintf(err, errlen, "kernel %s: argument %zu is %zu bytes, its parameter %zu", name,
                     i, sizes[i], sizes_of[i]);
            return 1;
        }
        if (aligns[i] > 1) {
            uintptr_t p;
            memcpy(&p, args[i], sizeof p);
            if (p % aligns[i] != 0) {
                snprintf(err, errlen,
                         "kernel %s: argument %zu (%p) is not aligned to its type's %zu bytes",
                         name, i, (void *)p, aligns[i]);
                return 1;
            }
        }
    }
    Call<A...> c{kernel, args};
    return run(name, dim3(dims[0], dims[1], dims[2]), dim3(dims[3], dims[4], dims[5]), dims[6],
               body<A...>, &c, err, errlen);
}

}  // namespace emu

// The built-in variables of the thread running.
#define threadIdx (::emu::self().idx)
#define blockIdx (::emu::L->block_idx)
#define blockDim (::emu::L->block)
#define gridDim (::emu::L->grid)

inline void __syncthreads() { emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::sync_warp(mask); }

template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const int lane = emu::lane_id();
    return emu::exchange(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const int lane = emu::lane_id();
    int src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return emu::exchange(mask, v, src);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = emu::lane_id();
    const int src = (lane & (width - 1)) >= (int)delta ? lane - (int)delta : lane;
    return emu::exchange(mask, v, src);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = emu::lane_id();
    const int src = (lane & (width - 1)) + (int)delta < width ? lane + (int)delta : lane;
    return emu::exchange(mask, v, src);
}

// The C entry point of kernel K: emu_launch_K(dims (grid x, y, z, block x, y, z, dynamic
// shared memory bytes), args,
// sizes, nargs, err, errlen) → 0, or 1 with the reason in err.
#define EMU_KERNEL(K)                                                                         \
    extern "C" __attribute__((visibility("default"))) int emu_launch_##K(const unsigned *dims, void **args, const size_t *sizes,      \
                                  size_t nargs, char *err, size_t errlen) {                   \
        return ::emu::launch(#K, K, dims, args, sizes, nargs, err, errlen);                   \
    }

// `extern __shared__ T name[];` is rewritten by the loader to this: the launch's dynamic
// shared memory (as many bytes as the launch asked for, then a guard page).
#define EMU_DYNAMIC_SHARED(T) (reinterpret_cast<T *>(::emu::L->dynamic_shared))

#endif
