// ThreadSanitizer host for emulated launches. TSan's runtime must start with the process,
// so a TSan build of a kernel file cannot be loaded into Python: this program (built with
// -fsanitize=thread) loads it instead and replays launches that Python sends on stdin,
// answering with the launch's status and how many races TSan reported.
//
// Request: "GWL1", u32 kernel, u32 grid[3], u32 block[3], i32 sched, i32 split, u64 seed,
//          u8 poison[3], u32 nargs, then per argument u8 kind (0 buffer, 1 scalar), u64 size, bytes.
// Reply:   i32 rc, u32 races, u32 len, error text.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

struct Desc {  // the layout of gw::Desc in runtime.h
    unsigned grid[3], block[3];
    int sched, split;
    uint64_t seed;
    unsigned char poison[3];
    void** args;
    char err[2048];
    uint64_t fault_addr;
};

static unsigned g_races = 0;
extern "C" void __tsan_on_report(void*) { ++g_races; }

static bool get(void* p, size_t n) { return fread(p, 1, n, stdin) == n; }

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 3; }
    for (;;) {
        char magic[4];
        if (!get(magic, 4)) return 0;
        if (memcmp(magic, "GWL1", 4)) return 4;
        uint32_t kernel, nargs;
        Desc d;
        memset(&d, 0, sizeof d);
        if (!get(&kernel, 4) || !get(d.grid, 12) || !get(d.block, 12) || !get(&d.sched, 4) || !get(&d.split, 4) ||
            !get(&d.seed, 8) || !get(d.poison, 3) || !get(&nargs, 4))
            return 5;
        std::vector<std::vector<unsigned char>> bufs(nargs);
        std::vector<void*> slots(nargs);
        std::vector<uint64_t> ptrs(nargs);
        for (uint32_t i = 0; i < nargs; ++i) {
            uint8_t kind;
            uint64_t size;
            if (!get(&kind, 1) || !get(&size, 8)) return 6;
            bufs[i].resize(size + 64);
            if (size && !get(bufs[i].data(), size)) return 7;
            if (kind == 0) { ptrs[i] = (uint64_t)bufs[i].data(); slots[i] = &ptrs[i]; }
            else slots[i] = bufs[i].data();
        }
        d.args = slots.data();
        std::string sym = "gw_launch_" + std::to_string(kernel);
        int (*fn)(Desc*) = (int (*)(Desc*))dlsym(lib, sym.c_str());
        const unsigned before = g_races;
        int rc = fn ? fn(&d) : 9;
        const uint32_t races = g_races - before;
        const uint32_t len = (uint32_t)strnlen(d.err, sizeof d.err);
        fwrite(&rc, 4, 1, stdout);
        fwrite(&races, 4, 1, stdout);
        fwrite(&len, 4, 1, stdout);
        fwrite(d.err, 1, len, stdout);
        fflush(stdout);
    }
}
