// CPU runtime for gradwire's CUDA kernels (force-included before the kernel text, which
// is compiled unmodified by g++). Why each piece exists:
// - every GPU thread is a fiber with its own stack; all fibers of a block run on the
//   calling OS thread, so `__shared__` is `static thread_local`, refilled with a poison
//   byte at every block start;
// - lanes are independent (Volta-style): `__syncthreads` and each `*_sync` intrinsic
//   park the fiber; the scheduler releases a rendezvous only when exactly the threads it
//   names have arrived, and reports divergence, mask errors, exited lanes and deadlock;
// - a fault (guard page, division by zero) becomes an error naming block and thread.
// x86-64 Linux only (the context switch is 20 lines of assembly).
#pragma once
#if !defined(__x86_64__) || !defined(__linux__)
#error "the gradwire CUDA emulator needs x86-64 Linux"
#endif

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef GW_TSAN
#include <sanitizer/tsan_interface.h>
// The runtime's own bookkeeping is not the kernel's memory traffic: not instrumented.
#define GW_RT __attribute__((no_sanitize_thread, noinline))
#define GW_TSAN_SWITCH(f) __tsan_switch_to_fiber((f), __tsan_switch_to_fiber_no_sync)
#else
#define GW_RT
#endif

#define __CUDACC__ 1
#define __CUDACC_RTC__ 1
#define __CUDA_ARCH__ 900
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#ifdef GW_TSAN  // TSan does not track TLS; tsan_host runs one thread, so plain statics do
#define __shared__ static
#else
#define __shared__ static thread_local
#endif

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };

namespace gw {

enum State { READY, BAR, WARP, ACTIVE, DONE };
enum Op { SYNCWARP, SHFL, SHFL_XOR, SHFL_UP, SHFL_DOWN, BALLOT, ANY, ALL, MATCH_ANY, MATCH_ALL,
          RED_ADD, RED_MIN, RED_MAX, RED_AND, RED_OR, RED_XOR, NOPS };
static const char* const OP_NAMES[NOPS] = {
    "__syncwarp", "__shfl_sync", "__shfl_xor_sync", "__shfl_up_sync", "__shfl_down_sync", "__ballot_sync",
    "__any_sync", "__all_sync", "__match_any_sync", "__match_all_sync", "__reduce_add_sync",
    "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync", "__reduce_or_sync", "__reduce_xor_sync"};

enum Sched { LOWEST = 0, HIGHEST = 1, RANDOM = 2 };

struct Fiber {
    void* sp;
    unsigned tid;  // linear thread index in the block
    uint3 idx;
    int state;
    // what the fiber waits for
    const void* site;
    int line;
    int op;
    unsigned mask;
    int size;      // operand width in bytes (warp ops)
    uint64_t val;  // operand bits
    int param;     // source lane / delta / lane mask
    int width;
    uint64_t result;
    int pred;
#ifdef GW_TSAN
    void* tsan;
#endif
};

struct Desc {  // filled by the Python side (tools/cuda_emulator/module.py)
    unsigned grid[3], block[3];
    int sched;
    int split;  // randomly split __activemask groups in two
    uint64_t seed;
    unsigned char poison[3];
    void** args;
    char err[2048];
    uint64_t fault_addr;  // nonzero: the error is an illegal address
};

struct Launch {
    Desc* d;
    uint3 bidx;
    dim3 bdim, gdim;
    std::vector<Fiber> f;
    uint64_t ready[16];  // bit t: fiber t can run (the scheduler's pick reads only this)
    Fiber* cur;
    void* sched_sp;
    char* stacks;
    size_t stack_bytes, stack_total;
    uint64_t rng;
    bool failed;
    sigjmp_buf jb;
    bool in_fibers;
    void (*body)(Launch*);
    const void* kernel_args;
#ifdef GW_TSAN
    void* tsan_main;
    // ThreadSanitizer sync objects, each in its own 8-byte word: the only orderings are
    // the launch (start, end), __syncthreads and __syncwarp (one word per warp)
    // (two words per barrier, by phase: a fiber's release for the next barrier must not
    // reach a slower fiber still acquiring the previous one)
    uint64_t start_sync, end_sync, bar_sync[2], warp_sync[32][2];
    unsigned bar_gen, warp_gen[32];
#endif
};

// The only TLS of the runtime: saved and restored around the shared-memory poisoning.
static thread_local Launch* tl_launch;

extern "C" void gw_ctx_switch(void** save_sp, void* new_sp);
asm(R"(
    .text
    .p2align 4
    .hidden gw_ctx_switch
    .type gw_ctx_switch,@function
gw_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size gw_ctx_switch, .-gw_ctx_switch
)");

GW_RT static inline uint64_t next_rand(Launch* L) {  // splitmix64
    uint64_t z = (L->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline unsigned nthreads(const Launch* L) { return L->bdim.x * L->bdim.y * L->bdim.z; }

GW_RT static void to_scheduler(Launch* L) {
    Fiber* me = L->cur;
#ifdef GW_TSAN
    GW_TSAN_SWITCH(L->tsan_main);
#endif
    gw_ctx_switch(&me->sp, L->sched_sp);
}

// Record the first error and leave the fibers for good.
GW_RT __attribute__((format(printf, 2, 3))) static void fail(Launch* L, const char* fmt, ...) {
    if (!L->failed) {
        L->failed = true;
        int n = snprintf(L->d->err, sizeof L->d->err, "block (%u,%u,%u): ", L->bidx.x, L->bidx.y, L->bidx.z);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(L->d->err + n, sizeof L->d->err - n, fmt, ap);
        va_end(ap);
    }
    if (L->in_fibers && L->cur) to_scheduler(L);  // never resumed
}

static const char* state_str(const Fiber& f) {
    switch (f.state) {
        case BAR: return "__syncthreads";
        case WARP: return OP_NAMES[f.op];
        case ACTIVE: return "__activemask";
        case DONE: return "exited";
        default: return "running";
    }
}

// ---- the scheduler ---------------------------------------------------------------------------
GW_RT static inline void mark_ready(Launch* L, unsigned t) {
    L->f[t].state = READY;
    L->ready[t >> 6] |= 1ull << (t & 63);
}

// The next fiber to run, by policy; it leaves the ready set (it runs until it parks).
GW_RT static Fiber* pick(Launch* L) {
    const unsigned words = (nthreads(L) + 63) / 64;
    int t = -1;
    if (L->d->sched == LOWEST) {
        for (unsigned w = 0; w < words && t < 0; ++w)
            if (L->ready[w]) t = (int)(64 * w + __builtin_ctzll(L->ready[w]));
    } else if (L->d->sched == HIGHEST) {
        for (unsigned w = words; w-- > 0 && t < 0;)
            if (L->ready[w]) t = (int)(64 * w + 63 - __builtin_clzll(L->ready[w]));
    } else {
        unsigned cnt = 0;
        for (unsigned w = 0; w < words; ++w) cnt += __builtin_popcountll(L->ready[w]);
        if (cnt) {
            unsigned k = (unsigned)(next_rand(L) % cnt);
            for (unsigned w = 0; w < words && t < 0; ++w) {
                const unsigned c = __builtin_popcountll(L->ready[w]);
                if (k >= c) { k -= c; continue; }
                uint64_t m = L->ready[w];
                for (unsigned j = 0; j < k; ++j) m &= m - 1;  // drop the k lowest set bits
                t = (int)(64 * w + __builtin_ctzll(m));
            }
        }
    }
    if (t < 0) return nullptr;
    L->ready[t >> 6] &= ~(1ull << (t & 63));
    return &L->f[t];
}

GW_RT static inline unsigned warp_lanes(const Launch* L, unsigned w) {  // lanes that exist in warp w
    const unsigned n = nthreads(L), lo = 32 * w;
    const unsigned c = n - lo >= 32 ? 32 : n - lo;
    return c == 32 ? 0xFFFFFFFFu : ((1u << c) - 1u);
}

GW_RT static void try_barrier(Launch* L) {
    const unsigned n = nthreads(L);
    const Fiber* first = nullptr;
    for (unsigned i = 0; i < n; ++i) {
        const Fiber& f = L->f[i];
        if (f.state == DONE) continue;
        if (f.state != BAR) return;
        if (!first) first = &f;
    }
    if (!first) return;
    for (unsigned i = 0; i < n; ++i) {
        const Fiber& f = L->f[i];
        if (f.state == BAR && f.site != first->site) {
            fail(L, "barrier divergence: thread %u waits at __syncthreads on line %d, thread %u at "
                    "__syncthreads on line %d (a different call site)", first->tid, first->line, f.tid, f.line);
            return;
        }
    }
    for (unsigned i = 0; i < n; ++i) if (L->f[i].state == BAR) mark_ready(L, i);
#ifdef GW_TSAN
    ++L->bar_gen;
#endif
}

GW_RT static uint64_t lane_src(const Fiber& f, int lane) {  // source lane of a shuffle
    const int w = f.width, seg = lane & ~(w - 1), end = seg + w;
    int s = lane;
    switch (f.op) {
        case SHFL: s = seg + (f.param & (w - 1)); break;
        case SHFL_XOR: s = lane ^ f.param; if (s >= end || s < seg) s = lane; break;
        case SHFL_UP: s = lane - f.param; if (s < seg) s = lane; break;
        case SHFL_DOWN: s = lane + f.param; if (s >= end) s = lane; break;
    }
    return (uint64_t)s;
}

GW_RT static void try_warp(Launch* L, Fiber* me) {
    const unsigned w = me->tid / 32, base = 32 * w, exist = warp_lanes(L, w), m = me->mask;
    for (int l = 0; l < 32; ++l) {
        if (!(m >> l & 1u)) continue;
        if (!(exist >> l & 1u)) {
            fail(L, "thread %u: %s on line %d names lane %d (mask 0x%08x), which does not exist in the block",
                 me->tid, OP_NAMES[me->op], me->line, l, m);
            return;
        }
        const Fiber& o = L->f[base + l];
        if (o.state == DONE) {
            fail(L, "thread %u: %s on line %d names lane %d (mask 0x%08x), which has exited", me->tid,
                 OP_NAMES[me->op], me->line, l, m);
            return;
        }
        if (o.state != WARP) return;  // not everyone is here yet
    }
    Fiber* g[32];
    int cnt = 0;
    for (int l = 0; l < 32; ++l)
        if (m >> l & 1u) {
            Fiber& o = L->f[base + l];
            if (o.op != me->op || o.mask != m || o.size != me->size) {
                fail(L, "warp op mismatch: lane %u runs %s (mask 0x%08x) on line %d, lane %d runs %s (mask 0x%08x) "
                        "on line %d", me->tid % 32, OP_NAMES[me->op], m, me->line, l, OP_NAMES[o.op], o.mask, o.line);
                return;
            }
            g[cnt++] = &o;
        }
    // compute every lane's result
    const int op = me->op;
    uint64_t acc = 0;
    unsigned bits = 0;
    if (op == RED_MIN) acc = ~0ull;
    if (op == RED_AND) acc = ~0ull;
    if (op == RED_ADD || op == RED_MIN || op == RED_MAX || op == RED_AND || op == RED_OR || op == RED_XOR) {
        for (int i = 0; i < cnt; ++i) {
            const uint32_t v = (uint32_t)g[i]->val;
            if (op == RED_ADD) acc = (uint32_t)(acc + v);
            else if (op == RED_MIN) acc = v < acc ? v : acc;
            else if (op == RED_MAX) acc = v > acc ? v : acc;
            else if (op == RED_AND) acc &= v;
            else if (op == RED_OR) acc |= v;
            else acc ^= v;
        }
    }
    for (int i = 0; i < cnt; ++i) if (g[i]->pred) bits |= 1u << (g[i]->tid % 32);
    for (int i = 0; i < cnt; ++i) {
        Fiber& o = *g[i];
        const int lane = (int)(o.tid % 32);
        switch (op) {
            case SHFL: case SHFL_XOR: case SHFL_UP: case SHFL_DOWN: {
                const int s = (int)lane_src(o, lane);
                if (!(m >> s & 1u)) {
                    fail(L, "thread %u: %s on line %d reads lane %d, outside its mask 0x%08x (undefined on a GPU)",
                         o.tid, OP_NAMES[op], o.line, s, m);
                    return;
                }
                o.result = L->f[base + s].val;
                break;
            }
            case BALLOT: o.result = bits; break;
            case ANY: o.result = bits != 0; break;
            case ALL: o.result = bits == m; break;
            case MATCH_ANY: case MATCH_ALL: {
                unsigned same = 0;
                for (int j = 0; j < cnt; ++j) if (g[j]->val == o.val) same |= 1u << (g[j]->tid % 32);
                if (op == MATCH_ANY) o.result = same;
                else { o.result = same == m ? m : 0; o.pred = same == m; }
                break;
            }
            default: o.result = acc;
        }
    }
    for (int i = 0; i < cnt; ++i) mark_ready(L, g[i]->tid);
#ifdef GW_TSAN
    if (op == SYNCWARP) ++L->warp_gen[w % 32];
#endif
}

// __activemask: once no lane of the warp can run, the lanes parked at the same call site
// are the active set; with `split`, a set may be cut in two at random (legal on hardware).
GW_RT static void try_activemask(Launch* L, unsigned w) {
    const unsigned base = 32 * w, n = nthreads(L);
    const unsigned hi = base + 32 < n ? base + 32 : n;
    for (unsigned i = base; i < hi; ++i) if (L->f[i].state == READY) return;
    bool todo[32] = {};
    for (unsigned i = base; i < hi; ++i) todo[i - base] = L->f[i].state == ACTIVE;
    for (unsigned i = base; i < hi; ++i) {
        if (!todo[i - base]) continue;
        unsigned set = 0;
        for (unsigned j = i; j < hi; ++j)
            if (todo[j - base] && L->f[j].site == L->f[i].site) { set |= 1u << (j - base); todo[j - base] = false; }
        unsigned a = set, b = 0;
        if (L->d->split && __builtin_popcount(set) > 1 && (next_rand(L) & 1)) {
            const unsigned cut = (unsigned)next_rand(L) & set;
            if (cut && cut != set) { a = cut; b = set & ~cut; }
        }
        for (unsigned j = i; j < hi; ++j) {
            const unsigned bit = 1u << (j - base);
            if (set & bit) { L->f[j].result = (a & bit) ? a : b; mark_ready(L, j); }
        }
    }
}

GW_RT static void on_exit(Launch* L, Fiber* me) {
    const unsigned w = me->tid / 32, base = 32 * w, n = nthreads(L);
    const unsigned hi = base + 32 < n ? base + 32 : n;
    for (unsigned i = base; i < hi; ++i) {
        const Fiber& o = L->f[i];
        if (o.state == WARP && (o.mask >> (me->tid - base) & 1u)) {
            fail(L, "lane %u exited while thread %u waits in %s on line %d with mask 0x%08x naming it",
                 me->tid - base, o.tid, OP_NAMES[o.op], o.line, o.mask);
            return;
        }
    }
    try_barrier(L);
}

GW_RT static void report_deadlock(Launch* L) {
    std::string s = "deadlock: no thread can run;";
    const unsigned n = nthreads(L);
    char b[256];
    int shown = 0;
    for (unsigned i = 0; i < n && shown < 8; ++i) {
        const Fiber& f = L->f[i];
        if (f.state == DONE) continue;
        if (f.state == WARP) snprintf(b, sizeof b, " thread %u in %s on line %d (mask 0x%08x);", f.tid, state_str(f), f.line, f.mask);
        else snprintf(b, sizeof b, " thread %u in %s on line %d;", f.tid, state_str(f), f.line);
        s += b;
        ++shown;
    }
    fail(L, "%s", s.c_str());
}

static void fiber_main();

#ifdef GW_TSAN
// TSan fibers are costly to create: thread t of every block and launch reuses fiber t (its
// program order then orders consecutive blocks, which run one after another anyway).
GW_RT static void* tsan_fiber(unsigned t) {
    static void* pool[1024];
    if (!pool[t]) pool[t] = __tsan_create_fiber(0);
    return pool[t];
}
#endif

GW_RT static void run_block(Launch* L) {
    const unsigned n = nthreads(L);
    memset(L->ready, 0, sizeof L->ready);
    for (unsigned t = 0; t < n; ++t) {
        Fiber& f = L->f[t];
        memset(&f, 0, sizeof f);
        f.tid = t;
        f.idx.x = t % L->bdim.x;
        f.idx.y = (t / L->bdim.x) % L->bdim.y;
        f.idx.z = t / (L->bdim.x * L->bdim.y);
        mark_ready(L, t);
        // stack: [guard page][stack ...top]; top holds the frame gw_ctx_switch pops
        char* top = L->stacks + (size_t)(t + 1) * L->stack_bytes;
        uint64_t* sp = (uint64_t*)top;
        *--sp = 0;                          // fake return address of fiber_main
        *--sp = (uint64_t)(void*)&fiber_main;
        for (int r = 0; r < 6; ++r) *--sp = 0;
        *--sp = 0x037F00001F80ull;          // mxcsr (low word), x87 control word (high)
        f.sp = sp;
#ifdef GW_TSAN
        f.tsan = tsan_fiber(t);
#endif
    }
    L->in_fibers = true;
#ifdef GW_TSAN
    __tsan_release(&L->start_sync);
#endif
    for (;;) {
        Fiber* f = pick(L);
        if (!f) {
            bool all_done = true;
            for (unsigned i = 0; i < n; ++i) all_done &= L->f[i].state == DONE;
            if (!all_done) report_deadlock(L);
            break;
        }
        L->cur = f;
#ifdef GW_TSAN
        GW_TSAN_SWITCH(f->tsan);
#endif
        gw_ctx_switch(&L->sched_sp, f->sp);
        L->cur = nullptr;
        if (L->failed) break;
        switch (f->state) {
            case DONE: on_exit(L, f); break;
            case BAR: try_barrier(L); break;
            case WARP: try_warp(L, f); break;
            default: break;
        }
        if (L->failed) break;
        try_activemask(L, f->tid / 32);
        if (L->failed) break;
    }
    L->in_fibers = false;
#ifdef GW_TSAN
    __tsan_acquire(&L->end_sync);
#endif
}

GW_RT static void fiber_main() {
    Launch* L = tl_launch;
#ifdef GW_TSAN
    __tsan_acquire(&L->start_sync);
#endif
    L->body(L);
#ifdef GW_TSAN
    __tsan_release(&L->end_sync);
#endif
    L->cur->state = DONE;
    to_scheduler(L);
    __builtin_trap();  // an exited fiber is never resumed
}

// ---- shared memory poisoning ----------------------------------------------------------------
// Every `__shared__` variable is a static thread_local of this module, so this module's TLS
// block on the calling thread *is* the block's shared memory (plus tl_launch, kept).
#include <dlfcn.h>
#include <link.h>

struct TlsFind { uintptr_t base; void* data; size_t size; };

static int find_tls(struct dl_phdr_info* info, size_t, void* arg) {
    TlsFind* t = (TlsFind*)arg;
    if (info->dlpi_addr != t->base) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i)
        if (info->dlpi_phdr[i].p_type == PT_TLS) { t->data = info->dlpi_tls_data; t->size = info->dlpi_phdr[i].p_memsz; }
    return 1;
}

GW_RT static void poison_shared(Launch* L, unsigned char byte) {
    Dl_info di;
    dladdr((void*)&poison_shared, &di);
    TlsFind t = {(uintptr_t)di.dli_fbase, nullptr, 0};
    Launch* keep = tl_launch;  // touching it also allocates this thread's block
    dl_iterate_phdr(find_tls, &t);
    if (t.data && t.size) memset(t.data, byte, t.size);
    tl_launch = keep;
    (void)L;
}

// ---- faults -------------------------------------------------------------------------------
static std::mutex g_sig_mu;

GW_RT static void on_fault(int sig, siginfo_t* si, void*) {
    Launch* L = tl_launch;
    if (!L || !L->in_fibers) {  // not ours: fall back to the default action, re-raised on return
        signal(sig, SIG_DFL);
        return;
    }
    const Fiber* f = L->cur;
    const char* what = sig == SIGFPE ? "arithmetic fault (integer division by zero?)"
                     : sig == SIGBUS ? "bus error" : "illegal address";
    if (f)
        snprintf(L->d->err, sizeof L->d->err, "block (%u,%u,%u) thread (%u,%u,%u): %s %p", L->bidx.x, L->bidx.y,
                 L->bidx.z, f->idx.x, f->idx.y, f->idx.z, what, si->si_addr);
    else  // not in a kernel thread: the runtime itself
        snprintf(L->d->err, sizeof L->d->err, "block (%u,%u,%u), emulator runtime: %s %p", L->bidx.x, L->bidx.y,
                 L->bidx.z, what, si->si_addr);
    L->d->fault_addr = sig == SIGFPE ? 0 : (uint64_t)si->si_addr;
    L->failed = true;
    siglongjmp(L->jb, 1);
}

// ---- launching ----------------------------------------------------------------------------
template <typename P> struct ParamSig {
    static void put(std::string& s) {
        typedef typename std::remove_cv<P>::type T;
        char b[32];
        if (std::is_pointer<T>::value) {
            typedef typename std::remove_pointer<T>::type E;
            const bool c = std::is_const<E>::value;
            typedef typename std::remove_cv<E>::type U;
            snprintf(b, sizeof b, "p%d%s", std::is_void<U>::value ? 0 : (int)sizeof(typename std::conditional<std::is_void<U>::value, char, U>::type), c ? "c" : "");
        } else if (std::is_same<T, bool>::value) {
            snprintf(b, sizeof b, "b1");
        } else if (std::is_integral<T>::value) {
            snprintf(b, sizeof b, "%c%d", std::is_signed<T>::value ? 'i' : 'u', (int)sizeof(T));
        } else if (std::is_floating_point<T>::value) {
            snprintf(b, sizeof b, "f%d", (int)sizeof(T));
        } else {
            snprintf(b, sizeof b, "o%d", (int)sizeof(T));
        }
        if (!s.empty()) s += ";";
        s += b;
    }
};

template <typename... P> std::string signature(void (*)(P...)) {
    std::string s;
    (ParamSig<P>::put(s), ...);
    return s;
}

template <typename... P> struct Bound {
    void (*k)(P...);
    std::tuple<typename std::decay<P>::type...> a;
};

template <typename B> GW_RT static void call_bound(Launch* L) {
    const B* b = (const B*)L->kernel_args;
    std::apply(b->k, b->a);
}

template <typename... P, size_t... I>
static std::tuple<typename std::decay<P>::type...> unpack(void** args, std::index_sequence<I...>) {
    return std::tuple<typename std::decay<P>::type...>(*(typename std::decay<P>::type*)args[I]...);
}

static const size_t STACK = 64 << 10;

template <typename... P> GW_RT int launch(void (*k)(P...), Desc* d) {
    Bound<P...> b{k, unpack<P...>(d->args, std::index_sequence_for<P...>())};
    Launch* L = new Launch();
    L->d = d;
    L->bdim = {d->block[0], d->block[1], d->block[2]};
    L->gdim = {d->grid[0], d->grid[1], d->grid[2]};
    L->rng = d->seed;
    L->body = &call_bound<Bound<P...>>;
    L->kernel_args = &b;
    const unsigned n = nthreads(L);
    L->f.resize(n);
    L->stack_bytes = STACK;
    L->stack_total = STACK * n;
    L->stacks = (char*)mmap(nullptr, L->stack_total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (L->stacks == MAP_FAILED) { snprintf(d->err, sizeof d->err, "cannot map fiber stacks"); delete L; return 1; }
    for (unsigned t = 0; t < n; ++t) mprotect(L->stacks + (size_t)t * STACK, 4096, PROT_NONE);  // overflow guard
#ifdef GW_TSAN
    L->tsan_main = __tsan_get_current_fiber();
#endif
    // block order by the same policy as threads
    const uint64_t nb = (uint64_t)d->grid[0] * d->grid[1] * d->grid[2];
    std::vector<uint64_t> order(nb);
    for (uint64_t i = 0; i < nb; ++i) order[i] = d->sched == HIGHEST ? nb - 1 - i : i;
    if (d->sched == RANDOM)
        for (uint64_t i = nb; i > 1; --i) std::swap(order[i - 1], order[next_rand(L) % i]);
    // alternate signal stack: a fiber's stack overflow must still reach the handler
    stack_t alt, old_alt;
    alt.ss_sp = malloc(1 << 16); alt.ss_size = 1 << 16; alt.ss_flags = 0;
    sigaltstack(&alt, &old_alt);
    struct sigaction sa, old[3];
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    const int sigs[3] = {SIGSEGV, SIGBUS, SIGFPE};
    Launch* prev = tl_launch;
    int rc = 0;
    {
        std::lock_guard<std::mutex> g(g_sig_mu);  // one launch at a time owns the fault handlers
        for (int i = 0; i < 3; ++i) sigaction(sigs[i], &sa, &old[i]);
        tl_launch = L;
        if (sigsetjmp(L->jb, 1) == 0) {
            for (uint64_t i = 0; i < nb && !L->failed; ++i) {
                const uint64_t bi = order[i];
                L->bidx.x = (unsigned)(bi % d->grid[0]);
                L->bidx.y = (unsigned)((bi / d->grid[0]) % d->grid[1]);
                L->bidx.z = (unsigned)(bi / ((uint64_t)d->grid[0] * d->grid[1]));
                poison_shared(L, d->poison[i % 3]);
                run_block(L);
            }
        }
        L->in_fibers = false;
        tl_launch = prev;
        for (int i = 0; i < 3; ++i) sigaction(sigs[i], &old[i], nullptr);
    }
    sigaltstack(&old_alt, nullptr);
    free(alt.ss_sp);
    rc = L->failed ? 1 : 0;
    munmap(L->stacks, L->stack_total);
    delete L;
    return rc;
}

// ---- what kernels call ------------------------------------------------------------------------
static inline Launch* cur() { return tl_launch; }

GW_RT static __attribute__((noinline)) void syncthreads(int line) {
    Launch* L = cur();
    Fiber* f = L->cur;
    f->site = __builtin_return_address(0);
    f->line = line;
    f->state = BAR;
#ifdef GW_TSAN
    const unsigned phase = L->bar_gen & 1u;
    __tsan_release(&L->bar_sync[phase]);
#endif
    to_scheduler(L);
#ifdef GW_TSAN
    __tsan_acquire(&L->bar_sync[phase]);
#endif
}

template <typename T> static inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp operand must be <= 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}
template <typename T> static inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}

GW_RT static __attribute__((noinline)) uint64_t warp_op(int line, int op, unsigned mask, int size, uint64_t val,
                                                  int param, int width, int pred, int* pred_out) {
    Launch* L = cur();
    Fiber* f = L->cur;
    const unsigned lane = f->tid % 32;
    if (!(mask >> lane & 1u))
        fail(L, "thread %u: %s on line %d called by lane %u, which is outside its mask 0x%08x", f->tid,
             OP_NAMES[op], line, lane, mask);
    if (width <= 0 || width > 32 || (width & (width - 1)))
        fail(L, "thread %u: %s on line %d with width %d (must be a power of two <= 32)", f->tid, OP_NAMES[op], line, width);
    f->site = __builtin_return_address(0);
    f->line = line;
    f->op = op; f->mask = mask; f->size = size; f->val = val; f->param = param; f->width = width;
    f->pred = pred;
    f->state = WARP;
#ifdef GW_TSAN
    const unsigned w = f->tid / 32 % 32, phase = L->warp_gen[w] & 1u;
    if (op == SYNCWARP) __tsan_release(&L->warp_sync[w][phase]);
#endif
    to_scheduler(L);
#ifdef GW_TSAN
    if (op == SYNCWARP) __tsan_acquire(&L->warp_sync[w][phase]);
#endif
    if (pred_out) *pred_out = f->pred;
    return f->result;
}

GW_RT static __attribute__((noinline)) unsigned activemask(int line) {
    Launch* L = cur();
    Fiber* f = L->cur;
    f->site = __builtin_return_address(0);
    f->line = line;
    f->state = ACTIVE;
    to_scheduler(L);
    return (unsigned)f->result;
}

}  // namespace gw

// ---- CUDA names -----------------------------------------------------------------------------
#ifdef GW_TSAN
namespace gw {
GW_RT static uint3 thread_idx() { return tl_launch->cur->idx; }
GW_RT static uint3 block_idx() { return tl_launch->bidx; }
GW_RT static dim3 block_dim() { return tl_launch->bdim; }
GW_RT static dim3 grid_dim() { return tl_launch->gdim; }
}  // namespace gw
#define threadIdx (gw::thread_idx())
#define blockIdx (gw::block_idx())
#define blockDim (gw::block_dim())
#define gridDim (gw::grid_dim())
#else
#define threadIdx (gw::tl_launch->cur->idx)
#define blockIdx (gw::tl_launch->bidx)
#define blockDim (gw::tl_launch->bdim)
#define gridDim (gw::tl_launch->gdim)
#endif
#define warpSize 32

#define __syncthreads() gw::syncthreads(__LINE__)
#define __syncwarp(...) (gw_syncwarp_at{__LINE__}(__VA_ARGS__))  // the mask is optional
#define __activemask() gw::activemask(__LINE__)
#define __shfl_sync(...) gw_shfl(__LINE__, gw::SHFL, __VA_ARGS__)
#define __shfl_xor_sync(...) gw_shfl(__LINE__, gw::SHFL_XOR, __VA_ARGS__)
#define __shfl_up_sync(...) gw_shfl(__LINE__, gw::SHFL_UP, __VA_ARGS__)
#define __shfl_down_sync(...) gw_shfl(__LINE__, gw::SHFL_DOWN, __VA_ARGS__)
#define __ballot_sync(m, p) ((unsigned)gw::warp_op(__LINE__, gw::BALLOT, (m), 0, 0, 0, 32, (p) ? 1 : 0, nullptr))
#define __any_sync(m, p) ((int)gw::warp_op(__LINE__, gw::ANY, (m), 0, 0, 0, 32, (p) ? 1 : 0, nullptr))
#define __all_sync(m, p) ((int)gw::warp_op(__LINE__, gw::ALL, (m), 0, 0, 0, 32, (p) ? 1 : 0, nullptr))
#define __match_any_sync(m, v) gw_match_any(__LINE__, (m), (v))
#define __match_all_sync(m, v, pred) gw_match_all(__LINE__, (m), (v), (pred))
#define __reduce_add_sync(m, v) ((unsigned)gw::warp_op(__LINE__, gw::RED_ADD, (m), 4, (unsigned)(v), 0, 32, 0, nullptr))
#define __reduce_min_sync(m, v) ((unsigned)gw::warp_op(__LINE__, gw::RED_MIN, (m), 4, (unsigned)(v), 0, 32, 0, nullptr))
#define __reduce_max_sync(m, v) ((unsigned)gw::warp_op(__LINE__, gw::RED_MAX, (m), 4, (unsigned)(v), 0, 32, 0, nullptr))
#define __reduce_and_sync(m, v) ((unsigned)gw::warp_op(__LINE__, gw::RED_AND, (m), 4, (unsigned)(v), 0, 32, 0, nullptr))
#define __reduce_or_sync(m, v) ((unsigned)gw::warp_op(__LINE__, gw::RED_OR, (m), 4, (unsigned)(v), 0, 32, 0, nullptr))
#define __reduce_xor_sync(m, v) ((unsigned)gw::warp_op(__LINE__, gw::RED_XOR, (m), 4, (unsigned)(v), 0, 32, 0, nullptr))

struct gw_syncwarp_at {
    int line;
    void operator()(unsigned mask = 0xFFFFFFFFu) const { gw::warp_op(line, gw::SYNCWARP, mask, 0, 0, 0, 32, 0, nullptr); }
};
template <typename T> static inline T gw_shfl(int line, int op, unsigned mask, T v, int p, int width = 32) {
    return gw::from_bits<T>(gw::warp_op(line, op, mask, (int)sizeof(T), gw::to_bits(v), p, width, 0, nullptr));
}
template <typename T> static inline unsigned gw_match_any(int line, unsigned mask, T v) {
    return (unsigned)gw::warp_op(line, gw::MATCH_ANY, mask, (int)sizeof(T), gw::to_bits(v), 0, 32, 0, nullptr);
}
template <typename T> static inline unsigned gw_match_all(int line, unsigned mask, T v, int* pred) {
    int p = 0;
    const unsigned r = (unsigned)gw::warp_op(line, gw::MATCH_ALL, mask, (int)sizeof(T), gw::to_bits(v), 0, 32, 0, &p);
    *pred = p;
    return r;
}

// ---- bit and math intrinsics -------------------------------------------------------------------
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline long long __double_as_longlong(double f) { long long u; memcpy(&u, &f, 8); return u; }
static inline double __longlong_as_double(long long u) { double f; memcpy(&f, &u, 8); return f; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    return __builtin_bswap32(x);
}
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
template <typename T> static inline T __ldg(const T* p) { return *p; }
// round-to-nearest float ops that never contract (the build has -ffp-contract=off; SSE is IEEE)
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <typename T> static inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> static inline T max(T a, T b) { return a < b ? b : a; }

// ---- atomics (the __atomic builtins: visible to ThreadSanitizer) --------------------------------
#define GW_ATOMIC_INT(T)                                                                          \
    static inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }   \
    static inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }   \
    static inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }     \
    static inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }   \
    static inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }   \
    static inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); } \
    static inline T atomicCAS(T* p, T cmp, T v) {                                                 \
        __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);       \
        return cmp;                                                                               \
    }                                                                                             \
    static inline T atomicMax(T* p, T v) {                                                        \
        T o = __atomic_load_n(p, __ATOMIC_RELAXED);                                               \
        while (o < v && !__atomic_compare_exchange_n(p, &o, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} \
        return o;                                                                                 \
    }                                                                                             \
    static inline T atomicMin(T* p, T v) {                                                        \
        T o = __atomic_load_n(p, __ATOMIC_RELAXED);                                               \
        while (v < o && !__atomic_compare_exchange_n(p, &o, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} \
        return o;                                                                                 \
    }
GW_ATOMIC_INT(int)
GW_ATOMIC_INT(unsigned)
GW_ATOMIC_INT(unsigned long long)
GW_ATOMIC_INT(long long)
#undef GW_ATOMIC_INT

template <typename F> static inline F gw_atomic_fadd(F* p, F v) {
    typedef typename std::conditional<sizeof(F) == 4, unsigned, unsigned long long>::type U;
    U o = __atomic_load_n((U*)p, __ATOMIC_RELAXED), n;
    do { F f; memcpy(&f, &o, sizeof f); f = f + v; memcpy(&n, &f, sizeof n); }
    while (!__atomic_compare_exchange_n((U*)p, &o, n, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    F r;
    memcpy(&r, &o, sizeof r);
    return r;
}
static inline float atomicAdd(float* p, float v) { return gw_atomic_fadd(p, v); }
static inline double atomicAdd(double* p, double v) { return gw_atomic_fadd(p, v); }

// Entry points the Python side calls (one pair per kernel instantiation, appended after the
// kernel text by tools/cuda_emulator/build.py).
#define GW_EXPORT extern "C" __attribute__((visibility("default")))
