// The emulator's runtime: runs a job file of dispatches. Each threadgroup's
// threads run as ucontext fibers on one OS thread; a fiber runs until it
// reaches a barrier or SIMD operation, then the scheduler resumes a runnable
// fiber chosen by the seed, so that a missing barrier shows up as a wrong
// result instead of being hidden by a fixed order. The seed also picks one of
// three schedules, by seed % 3: 0, the runnable threads of the SIMD group with
// the highest random priority first (one SIMD group runs ahead up to the next
// threadgroup barrier); 1, the runnable thread with the highest random
// priority first (one thread runs ahead); 2, any runnable thread at random.
//
// Job file, one command per line:
//   buffer <id> <bytes> <input file | -> [<virtual bytes> <offset>]
//       (with a virtual size: a lazily mapped buffer of that many bytes whose
//       bytes [offset, offset + bytes) are the file's and are what `save` writes)
//   run <entry> <groups x y z> <threads x y z> <seed> <shuffle groups 0|1>
//       <n> (<buffer index> <id>)*n <m> (<threadgroup index> <bytes>)*m
//   save <id> <output file>
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <queue>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "emu/bind.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom,
                                               size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                                size_t* size_old);
#endif

// Build with -DEMU_TSAN (runtime uninstrumented, kernels under ThreadSanitizer):
// each thread is a ThreadSanitizer fiber whose switches do not synchronise, so
// only what Metal orders is ordered: a barrier for its threadgroup (or SIMD
// group), a dispatch for the next. Accesses to the same memory that nothing
// orders are reported as races, whatever the schedule; this includes two
// threadgroups of one dispatch.
#ifdef EMU_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#define EMU_TSAN_ONLY(x) x
#else
#define EMU_TSAN_ONLY(x)
#endif

extern const emu::Entry emu_entries[];
extern const int emu_entry_count;

namespace emu {
namespace {

constexpr size_t kStackBytes = 512 * 1024;
constexpr size_t kThreadgroupMemoryLimit = 32 * 1024;
constexpr int kMaxThreads = 1024;

enum class State { runnable, waiting, done };

struct Fiber {
  ucontext_t ctx;      // the first entry
  jmp_buf jb;          // later switches: _setjmp/_longjmp skip swapcontext's
  bool started = false;  // signal-mask system calls
  char* stack = nullptr;
  ThreadPos pos;
  State state = State::runnable;
  uint64_t barriers = 0;  // threadgroup barriers passed
  uint64_t simd_ops = 0;  // SIMD exchanges started
  Site wait_site = {nullptr, 0};
  const char* wait_kind = nullptr;
  void* fake_stack = nullptr;
  void* tsan_fiber = nullptr;
};

// Threads waiting at one barrier or SIMD exchange.
struct Meeting {
  std::vector<int> waiting;
  Site site = {nullptr, 0};
  uint64_t seq = 0;
  // Happens-before objects of alternate meetings, in memory of this
  // threadgroup's own (so that the next threadgroup does not inherit them).
  char* sync = nullptr;
  int first = -1;
};

struct Dispatch {
  const Entry* entry = nullptr;
  uint32_t groups[3], threads[3];
  std::map<int, Span> buffers;
  std::map<int, size_t> tg_lengths;
  uint32_t group[3];
};

struct Runtime {
  Dispatch d;
  std::vector<Fiber> fibers;
  int nthreads = 0;
  int current = -1;
  int done = 0;
  ucontext_t sched;
  jmp_buf sched_jb;
  // Runnable threads by key: the schedule's priority in the high bits, a
  // random number below it (so that ties, and schedule 2, pick at random).
  std::priority_queue<std::pair<uint64_t, int>> runnable;
  std::mt19937_64 rng;
  int schedule = 0;
  std::vector<uint32_t> priority;  // per thread, by the schedule
  Meeting tg;
  std::vector<Meeting> simd;
  Span slots;  // kSimdWidth * kSimdSlot bytes per SIMD group
  Span sync;   // the meetings' happens-before objects
  std::map<const void*, Span> tg_static;
  std::map<int, Span> tg_dynamic;
  size_t tg_bytes = 0;
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
  void* sched_fake_stack = nullptr;
  void* tsan_main = nullptr;
  char dispatch_sync, exit_sync;
} R;

Fiber& cur() { return R.fibers[R.current]; }

std::string where() {
  std::ostringstream s;
  if (R.d.entry) {
    s << "kernel " << R.d.entry->name << ", threadgroup (" << R.d.group[0] << "," << R.d.group[1]
      << "," << R.d.group[2] << ")";
    if (R.current >= 0) {
      const ThreadPos& p = cur().pos;
      s << ", thread (" << p.local[0] << "," << p.local[1] << "," << p.local[2] << ")";
    }
    s << ": ";
  }
  return s.str();
}

// Memory a threadgroup starts with: exactly `size` bytes, so that
// AddressSanitizer sees one element too many, filled with 0xff (NaN for
// floats) so that reading it before writing shows. Under ThreadSanitizer,
// fresh pages mapped while ignoring accesses: nothing of an earlier
// threadgroup's use of the addresses, nor the filling, counts as an access.
void* fresh(size_t size) {
#ifdef EMU_TSAN
  __tsan_ignore_thread_begin();
  void* p = mmap(nullptr, std::max<size_t>(size, 1), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail("out of memory");
#else
  void* p = nullptr;
  if (posix_memalign(&p, 64, std::max<size_t>(size, 1)) != 0) fail("out of memory");
#endif
  std::memset(p, 0xff, size);
  EMU_TSAN_ONLY(__tsan_ignore_thread_end());
  return p;
}

void release_fresh(Span s) {
#ifdef EMU_TSAN
  __tsan_ignore_thread_begin();
  munmap(s.data, std::max<size_t>(s.size, 1));
  __tsan_ignore_thread_end();
#else
  free(s.data);
#endif
}

void* tg_alloc(size_t size) {
  R.tg_bytes += size;
  if (R.tg_bytes > kThreadgroupMemoryLimit)
    fail("threadgroup memory of %zu bytes exceeds the 32 KB that Apple GPUs have", R.tg_bytes);
  return fresh(size);
}

// Switches from the running fiber to the scheduler.
void to_scheduler() {
  Fiber& f = cur();
#ifdef EMU_ASAN
  __sanitizer_start_switch_fiber(f.state == State::done ? nullptr : &f.fake_stack,
                                 R.main_stack_bottom, R.main_stack_size);
#endif
#ifdef EMU_TSAN
  __tsan_switch_to_fiber(R.tsan_main, __tsan_switch_to_fiber_no_sync);
  swapcontext(&f.ctx, &R.sched);
#else
  if (!_setjmp(f.jb)) _longjmp(R.sched_jb, 1);
#endif
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

void make_runnable(int id) {
  R.fibers[id].state = State::runnable;
  R.runnable.push({(uint64_t(R.priority[id]) << 32) | (R.rng() & 0xffffffffu), id});
}

void release(Meeting& m) {
  for (int id : m.waiting) make_runnable(id);
  m.waiting.clear();
  m.first = -1;
}

// Adds the current fiber to meeting `m`, which completes at `expected`
// arrivals; fails if another thread waits there at a different site or count.
bool same(Site a, Site b) {
  return a.line == b.line && (a.file == b.file || (a.file && b.file && !strcmp(a.file, b.file)));
}

void meet(Meeting& m, Site site, uint64_t seq, int expected, const char* kind,
          bool orders_memory = true) {
  Fiber& f = cur();
  if (!m.waiting.empty() && (!same(m.site, site) || m.seq != seq)) {
    const Fiber& o = R.fibers[m.first];
    // SIMD operations meet twice each (seq 2n and 2n + 1).
    const uint64_t per = kind[0] == 'S' ? 2 : 1;
    fail("divergent %s: this thread is at %s:%d (its call #%llu) while thread (%u,%u,%u) waits "
         "at %s:%d (its call #%llu)",
         kind, site.file, site.line, (unsigned long long)(seq / per), o.pos.local[0],
         o.pos.local[1], o.pos.local[2], m.site.file, m.site.line,
         (unsigned long long)(m.seq / per));
  }
  if (m.waiting.empty()) {
    m.site = site;
    m.seq = seq;
    m.first = R.current;
  }
  f.state = State::waiting;
  f.wait_site = site;
  f.wait_kind = kind;
  m.waiting.push_back(R.current);
  if (int(m.waiting.size()) == expected) release(m);
  EMU_TSAN_ONLY(if (orders_memory) __tsan_release(&m.sync[seq & 1]));
  to_scheduler();
  EMU_TSAN_ONLY(if (orders_memory) __tsan_acquire(&m.sync[seq & 1]));
}

int simd_active(int sg) {
  int n = 0;
  for (int l = 0; l < kSimdWidth; l++) {
    int id = sg * kSimdWidth + l;
    if (id < R.nthreads && R.fibers[id].state != State::done) n++;
  }
  return n;
}

void fiber_main() {
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &R.main_stack_bottom, &R.main_stack_size);
#endif
  EMU_TSAN_ONLY(__tsan_acquire(&R.dispatch_sync));
  R.d.entry->run();
  Fiber& f = cur();
  if (!R.tg.waiting.empty())
    fail("returned while %zu threads wait at a threadgroup_barrier (barrier in divergent control "
         "flow)",
         R.tg.waiting.size());
  f.state = State::done;
  R.done++;
  // Inactive lanes drop out of SIMD operations.
  int sg = f.pos.simd_group;
  Meeting& m = R.simd[sg];
  if (!m.waiting.empty() && int(m.waiting.size()) == simd_active(sg)) release(m);
  EMU_TSAN_ONLY(__tsan_release(&R.exit_sync));
  to_scheduler();
  fail("a finished thread was resumed");
}

void run_threadgroup() {
  const Dispatch& d = R.d;
  int n = R.nthreads;
  int nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  EMU_TSAN_ONLY(__tsan_ignore_thread_begin());
  R.simd.assign(nsimd, Meeting());
  R.tg = Meeting();
  R.slots = Span{nullptr, size_t(nsimd) * kSimdWidth * kSimdSlot};
  R.slots.data = fresh(R.slots.size);
  R.sync = Span{fresh(2 * (nsimd + 1)), size_t(2 * (nsimd + 1))};
  R.tg.sync = static_cast<char*>(R.sync.data);
  for (int sg = 0; sg < nsimd; sg++) R.simd[sg].sync = R.tg.sync + 2 * (sg + 1);
  // Full capacity up front: threads add themselves without reallocating.
  R.tg.waiting.reserve(n);
  for (Meeting& m : R.simd) m.waiting.reserve(kSimdWidth);
  EMU_TSAN_ONLY(__tsan_ignore_thread_end());
  R.tg_bytes = 0;
  R.tg_static.clear();
  R.tg_dynamic.clear();
  R.done = 0;
  R.current = -1;
  for (auto& [index, len] : d.tg_lengths) R.tg_dynamic[index] = Span{tg_alloc(len), len};
  R.runnable = {};
  R.priority.assign(n, 0);
  if (R.schedule != 2) {
    std::vector<uint32_t> perm(R.schedule == 0 ? nsimd : n);
    for (size_t i = 0; i < perm.size(); i++) perm[i] = uint32_t(i);
    std::shuffle(perm.begin(), perm.end(), R.rng);
    for (int i = 0; i < n; i++) R.priority[i] = perm[R.schedule == 0 ? i / kSimdWidth : i];
  }
  for (int i = 0; i < n; i++) {
    Fiber& f = R.fibers[i];
    ThreadPos& p = f.pos;
    p.local[0] = i % d.threads[0];
    p.local[1] = (i / d.threads[0]) % d.threads[1];
    p.local[2] = i / (d.threads[0] * d.threads[1]);
    for (int k = 0; k < 3; k++) {
      p.group[k] = d.group[k];
      p.group_size[k] = d.threads[k];
      p.groups[k] = d.groups[k];
      p.grid_size[k] = d.groups[k] * d.threads[k];
      p.grid[k] = d.group[k] * d.threads[k] + p.local[k];
    }
    p.index = i;
    p.lane = i % kSimdWidth;
    p.simd_group = i / kSimdWidth;
    p.simd_groups = nsimd;
    f.started = false;
    f.barriers = f.simd_ops = 0;
    f.fake_stack = nullptr;
#ifdef EMU_TSAN
    // A fresh stack and fiber: nothing of the previous threadgroup's threads
    // may look ordered before this one's.
    __tsan_ignore_thread_begin();
    if (mmap(f.stack, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
             -1, 0) == MAP_FAILED)
      fail("cannot map a fiber stack");
    __tsan_ignore_thread_end();
    f.tsan_fiber = __tsan_create_fiber(0);
#endif
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
    make_runnable(i);
  }
  while (!R.runnable.empty()) {
    R.current = R.runnable.top().second;
    R.runnable.pop();
    Fiber& f = cur();
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(&R.sched_fake_stack, f.stack, kStackBytes);
#endif
#ifdef EMU_TSAN
    __tsan_switch_to_fiber(f.tsan_fiber, __tsan_switch_to_fiber_no_sync);
    swapcontext(&R.sched, &f.ctx);
#else
    if (!_setjmp(R.sched_jb)) {
      if (f.started) _longjmp(f.jb, 1);
      f.started = true;
      swapcontext(&R.sched, &f.ctx);
    }
#endif
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(R.sched_fake_stack, nullptr, nullptr);
#endif
  }
  R.current = -1;
  if (R.done != n) {
    std::ostringstream s;
    s << "deadlock: no thread can run; " << (n - R.done) << " of " << n << " threads wait (";
    int shown = 0;
    for (int i = 0; i < n && shown < 4; i++) {
      const Fiber& f = R.fibers[i];
      if (f.state != State::waiting) continue;
      s << (shown++ ? "; " : "") << "thread " << i << " at a " << f.wait_kind << " at "
        << f.wait_site.file << ":" << f.wait_site.line;
    }
    s << ") — a barrier or SIMD operation in divergent control flow";
    fail("%s", s.str().c_str());
  }
#ifdef EMU_TSAN
  // The scheduler does not acquire this threadgroup's accesses (the next
  // threadgroup's fibers would inherit them): its memory goes unobserved.
  for (int i = 0; i < n; i++) __tsan_destroy_fiber(R.fibers[i].tsan_fiber);
  __tsan_ignore_thread_begin();
#endif
  for (auto& [key, s] : R.tg_static) release_fresh(s);
  for (auto& [index, s] : R.tg_dynamic) release_fresh(s);
  release_fresh(R.slots);
  release_fresh(R.sync);
  R.tg_static.clear();
  R.tg_dynamic.clear();
  EMU_TSAN_ONLY(__tsan_ignore_thread_end());
}

const Entry* find_entry(const std::string& name) {
  for (int i = 0; i < emu_entry_count; i++)
    if (name == emu_entries[i].name) return &emu_entries[i];
  return nullptr;
}

void check_bindings(const Dispatch& d) {
  const Entry& e = *d.entry;
  for (int i = 0; i < e.num_bindings; i++) {
    const Binding& b = e.bindings[i];
    if (b.kind == Arg::buffer && !d.buffers.count(b.index))
      fail("parameter '%s' [[buffer(%d)]] is not set by the dispatch", b.name, b.index);
    if (b.kind == Arg::threadgroup && !d.tg_lengths.count(b.index))
      fail("parameter '%s' [[threadgroup(%d)]] has no threadgroup memory length set", b.name,
           b.index);
  }
  auto declared = [&](Arg kind, int index) {
    for (int i = 0; i < e.num_bindings; i++)
      if (e.bindings[i].kind == kind && e.bindings[i].index == index) return true;
    return false;
  };
  for (auto& [index, span] : d.buffers)
    if (!declared(Arg::buffer, index))
      fail("the dispatch sets buffer %d but the kernel has no [[buffer(%d)]] parameter", index,
           index);
  for (auto& [index, len] : d.tg_lengths) {
    if (!declared(Arg::threadgroup, index))
      fail("the dispatch sets threadgroup memory %d but the kernel has no [[threadgroup(%d)]] "
           "parameter",
           index, index);
    if (len % 16 != 0)
      fail("threadgroup memory length %zu at index %d is not a multiple of 16 bytes (Metal "
           "requires it)",
           len, index);
  }
}

void run_dispatch(uint64_t seed, bool shuffle) {
  Dispatch& d = R.d;
  check_bindings(d);
  R.nthreads = int(d.threads[0] * d.threads[1] * d.threads[2]);
  if (R.nthreads < 1 || R.nthreads > kMaxThreads)
    fail("%d threads per threadgroup; Metal allows 1 to %d", R.nthreads, kMaxThreads);
  if (d.entry->max_threads && R.nthreads > d.entry->max_threads)
    fail("%d threads per threadgroup exceed the kernel's max_total_threads_per_threadgroup(%d)",
         R.nthreads, d.entry->max_threads);
  while (int(R.fibers.size()) < R.nthreads) {
    R.fibers.emplace_back();
    void* s = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                   0);
    if (s == MAP_FAILED) fail("cannot map a fiber stack");
    R.fibers.back().stack = static_cast<char*>(s);
  }
  R.rng.seed(seed);
  R.schedule = int(seed % 3);
#ifdef EMU_TSAN
  R.tsan_main = __tsan_get_current_fiber();
  __tsan_release(&R.dispatch_sync);
#endif
  std::vector<uint64_t> order;
  uint64_t total = uint64_t(d.groups[0]) * d.groups[1] * d.groups[2];
  for (uint64_t g = 0; g < total; g++) order.push_back(g);
  if (shuffle) std::shuffle(order.begin(), order.end(), R.rng);
  for (uint64_t g : order) {
    d.group[0] = g % d.groups[0];
    d.group[1] = (g / d.groups[0]) % d.groups[1];
    d.group[2] = g / (uint64_t(d.groups[0]) * d.groups[1]);
    run_threadgroup();
  }
  // The dispatch's end orders all its threads before what follows.
  EMU_TSAN_ONLY(__tsan_acquire(&R.exit_sync));
}

std::vector<unsigned char> read_file(const std::string& path, size_t size) {
  std::ifstream in(path, std::ios::binary);
  std::vector<unsigned char> v(size);
  if (!in.read(reinterpret_cast<char*>(v.data()), size))
    fail("cannot read %zu bytes from %s", size, path.c_str());
  return v;
}

// A buffer of `size` bytes mapped on demand (pages never touched cost nothing),
// for offsets beyond 32 bits without the memory.
void* map_virtual(size_t size) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) fail("cannot map a virtual buffer of %zu bytes", size);
  return p;
}

int run_job(const char* path) {
  std::ifstream job(path);
  if (!job) fail("cannot open job file %s", path);
  std::map<long, Span> buffers;
  std::map<long, Span> windows;  // virtual buffers: the part that holds data
  std::string line;
  while (std::getline(job, line)) {
    std::istringstream in(line);
    std::string cmd;
    if (!(in >> cmd)) continue;
    if (cmd == "buffer") {
      long id;
      size_t size;
      std::string src;
      in >> id >> size >> src;
      size_t virtual_size = 0, offset = 0;
      if (in >> virtual_size >> offset) {
        if (offset + size > virtual_size) fail("buffer %ld: window past its virtual size", id);
        char* base = static_cast<char*>(map_virtual(virtual_size));
        if (size) {
          auto v = read_file(src, size);
          std::memcpy(base + offset, v.data(), size);
        }
        buffers[id] = Span{base, virtual_size};
        windows[id] = Span{base + offset, size};
        continue;
      }
      // Exactly `size` bytes, so that AddressSanitizer catches one element too many.
      void* p = malloc(std::max<size_t>(size, 1));
      if (src == "-")
        std::memset(p, 0xff, size);
      else if (size) {
        auto v = read_file(src, size);
        std::memcpy(p, v.data(), size);
      }
      if (buffers.count(id)) free(buffers[id].data);
      buffers[id] = Span{p, size};
    } else if (cmd == "run") {
      std::string name;
      uint64_t seed;
      int shuffle, n;
      R.d = Dispatch();
      in >> name;
      R.d.entry = find_entry(name);
      if (!R.d.entry) fail("no kernel entry point named '%s' in this build", name.c_str());
      in >> R.d.groups[0] >> R.d.groups[1] >> R.d.groups[2] >> R.d.threads[0] >>
          R.d.threads[1] >> R.d.threads[2] >> seed >> shuffle >> n;
      for (int i = 0; i < n; i++) {
        int index;
        long id;
        in >> index >> id;
        if (!buffers.count(id)) fail("job binds unknown buffer id %ld", id);
        R.d.buffers[index] = buffers[id];
      }
      in >> n;
      for (int i = 0; i < n; i++) {
        int index;
        size_t len;
        in >> index >> len;
        R.d.tg_lengths[index] = len;
      }
      if (!in) fail("malformed run command: %s", line.c_str());
      run_dispatch(seed, shuffle != 0);
      R.d.entry = nullptr;
    } else if (cmd == "save") {
      long id;
      std::string dst;
      in >> id >> dst;
      std::ofstream out(dst, std::ios::binary);
      const Span& s = windows.count(id) ? windows.at(id) : buffers.at(id);
      out.write(static_cast<const char*>(s.data), s.size);
      if (!out) fail("cannot write %s", dst.c_str());
    } else {
      fail("unknown job command '%s'", cmd.c_str());
    }
  }
  for (auto& [id, s] : buffers) {
    if (windows.count(id))
      munmap(s.data, s.size);
    else
      free(s.data);
  }
  return 0;
}

}  // namespace

const ThreadPos& pos() { return R.fibers[R.current].pos; }

void fail(const char* fmt, ...) {
  std::string w = where();
  fprintf(stderr, "emu error: %s", w.c_str());
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  fflush(stderr);
  _Exit(3);
}

void threadgroup_barrier(Site site, bool orders_memory) {
  Fiber& f = cur();
  f.barriers++;
  if (R.done > 0)
    fail("threadgroup_barrier reached after %d threads of the threadgroup returned (barrier in "
         "divergent control flow)",
         R.done);
  meet(R.tg, site, f.barriers, R.nthreads, "threadgroup_barrier", orders_memory);
}

const unsigned char* simd_exchange(const void* data, size_t size, Site site) {
  Fiber& f = cur();
  f.simd_ops++;
  int sg = f.pos.simd_group;
  unsigned char* slots = static_cast<unsigned char*>(R.slots.data) + sg * kSimdWidth * kSimdSlot;
  if (size) std::memcpy(slots + f.pos.lane * kSimdSlot, data, size);
  meet(R.simd[sg], site, 2 * f.simd_ops, simd_active(sg), "SIMD-group operation");
  return slots;
}

void simd_release() {
  Fiber& f = cur();
  int sg = f.pos.simd_group;
  // The second meeting keeps a fast lane from overwriting its slot before the
  // others have read it.
  meet(R.simd[sg], R.simd[sg].site, 2 * f.simd_ops + 1, simd_active(sg), "SIMD-group operation");
}

bool lane_active(int l) {
  if (l < 0 || l >= kSimdWidth) return false;
  int id = cur().pos.simd_group * kSimdWidth + l;
  return id < R.nthreads && R.fibers[id].state != State::done;
}

void yield() {
  Fiber& f = cur();
  make_runnable(R.current);
  to_scheduler();
}

void* threadgroup_static(const void* key, size_t size, size_t align) {
  auto it = R.tg_static.find(key);
  if (it != R.tg_static.end()) return it->second.data;
  void* p = tg_alloc(size);
  R.tg_static[key] = Span{p, size};
  return p;
}

Span buffer_arg(int index, const char* name) {
  auto it = R.d.buffers.find(index);
  if (it == R.d.buffers.end())
    fail("parameter '%s' [[buffer(%d)]] is not set by the dispatch", name, index);
  return it->second;
}

Span threadgroup_arg(int index, const char* name) {
  auto it = R.tg_dynamic.find(index);
  if (it == R.tg_dynamic.end())
    fail("parameter '%s' [[threadgroup(%d)]] has no threadgroup memory", name, index);
  return it->second;
}

void builtin_value(Arg kind, uint32_t out[3]) {
  const ThreadPos& p = pos();
  const uint32_t* v = nullptr;
  uint32_t s = 0;
  switch (kind) {
    case Arg::thread_position_in_grid: v = p.grid; break;
    case Arg::thread_position_in_threadgroup: v = p.local; break;
    case Arg::threadgroup_position_in_grid: v = p.group; break;
    case Arg::threads_per_threadgroup: v = p.group_size; break;
    case Arg::threadgroups_per_grid: v = p.groups; break;
    case Arg::threads_per_grid: v = p.grid_size; break;
    case Arg::thread_index_in_threadgroup: s = p.index; break;
    case Arg::thread_index_in_simdgroup: s = p.lane; break;
    case Arg::simdgroup_index_in_threadgroup: s = p.simd_group; break;
    case Arg::simdgroups_per_threadgroup: s = p.simd_groups; break;
    case Arg::threads_per_simdgroup: s = kSimdWidth; break;
    case Arg::thread_index_in_quadgroup: s = p.lane % 4; break;
    case Arg::quadgroup_index_in_threadgroup: s = p.index / 4; break;
    default: fail("a buffer parameter was bound as a builtin");
  }
  for (int k = 0; k < 3; k++) out[k] = v ? v[k] : (k == 0 ? s : 0);
}

}  // namespace emu

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s JOB_FILE\n", argv[0]);
    return 2;
  }
  return emu::run_job(argv[1]);
}
