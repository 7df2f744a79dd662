// A trainer's large tensors in a heap of their own: torch's CPU allocator for blocks of at least a
// threshold, best fit over free blocks that coalesce with their neighbours, and pages kept.
//
// Why: glibc serves a training step's large tensors (activations of 1-10 MB, a 200 MB chunk of
// logits) from the same heap as the small objects made beside them (a tensor's metadata, autograd's
// nodes: 32-1000 bytes). A small object that outlives its step lands in the hole a freed activation
// left (glibc splits a large free chunk when its small bins are empty), so after a micro-batch's
// backward its freed activations lie in hundreds of pieces cut by such objects, and the next
// micro-batch, a few tokens longer, no longer fits them: the heap grew to 4.0 GB for 2.4 GB in use
// at most (GRPO, the default model, LoRA). Here only large blocks live, so freed neighbours always
// merge, and the next step's larger blocks are cut from the merged space. As glibc's heap under
// `kernels/memory.py`, freed pages are never handed back: the next step's tensors find them resident
// (on a VM whose host takes freed memory back, a fresh page costs a trip to the host).
//
// The space is one reservation of address space (no memory), made writable as the pool's top grows,
// so the top merges with the free block below it as in any heap. Blocks below the threshold, and any
// request the reservation cannot hold, go to the allocator that was there before.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kAlign = size_t{1} << 16;  // blocks in 64 KB steps: near sizes reuse each other's holes
constexpr size_t kGrow = size_t{64} << 20;  // the writable top grows at least this much at a time

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

class BlockPool final : public c10::Allocator {
 public:
  BlockPool(c10::Allocator* fallback, size_t threshold, size_t reserve)
      : fallback_(fallback), threshold_(threshold) {
    void* base = mmap(nullptr, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base != MAP_FAILED) {
      base_ = reinterpret_cast<uintptr_t>(base);
      end_ = base_ + reserve;
      top_ = peak_ = writable_ = base_;
    }
  }

  bool reserved() const { return base_ != 0; }

  c10::DataPtr allocate(size_t n) override {
    if (n < threshold_) return fallback_->allocate(n);
    void* p = take(round_up(n, kAlign));
    if (p == nullptr) return fallback_->allocate(n);
    return {p, p, &BlockPool::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  // For `raw_allocate`'s callers (oneDNN's scratch space among them): a pointer from either heap.
  c10::DeleterFnPtr raw_deleter() const override { return &BlockPool::release; }

  // bytes in blocks handed out, bytes free below the top, the top's offset and its highest, bytes made
  // writable
  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t free_bytes = 0;
    for (const auto& [addr, size] : free_by_addr_) free_bytes += size;
    return {static_cast<int64_t>(in_use_), static_cast<int64_t>(free_bytes), static_cast<int64_t>(top_ - base_),
            static_cast<int64_t>(peak_ - base_), static_cast<int64_t>(writable_ - base_)};
  }

  static BlockPool* instance;

  // A fork while another thread holds the lock would leave the child's copy locked for good.
  static void before_fork() { instance->mutex_.lock(); }
  static void after_fork() { instance->mutex_.unlock(); }

 private:
  static void release(void* p) {
    const auto addr = reinterpret_cast<uintptr_t>(p);
    if (addr >= instance->base_ && addr < instance->end_) {
      instance->give_back(addr);
    } else if (p != nullptr) {
      instance->fallback_->raw_deleter()(p);  // one the allocator before handed out
    }
  }

  // The smallest free block that holds `size` (the lowest address among equals), split; else the top.
  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    uintptr_t addr = 0;
    auto fit = free_by_size_.lower_bound({size, 0});
    if (fit != free_by_size_.end()) {
      const auto [block, at] = *fit;
      free_by_size_.erase(fit);
      free_by_addr_.erase(at);
      if (block > size) add_free(at + size, block - size);
      addr = at;
    } else {
      if (size > end_ - top_) return nullptr;
      if (size > writable_ - top_) {
        const uintptr_t upto = std::min(end_, base_ + round_up(top_ + size - base_, kGrow));
        if (mprotect(reinterpret_cast<void*>(writable_), upto - writable_, PROT_READ | PROT_WRITE) != 0) return nullptr;
        writable_ = upto;
      }
      addr = top_;
      top_ += size;
      peak_ = std::max(peak_, top_);
    }
    used_[addr] = size;
    in_use_ += size;
    report(addr, static_cast<int64_t>(size));
    return reinterpret_cast<void*>(addr);
  }

  void give_back(uintptr_t addr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = used_.find(addr);
    TORCH_INTERNAL_ASSERT(it != used_.end(), "block pool: a block freed that it did not hand out");
    size_t size = it->second;
    used_.erase(it);
    in_use_ -= size;
    report(addr, -static_cast<int64_t>(size));
    auto next = free_by_addr_.find(addr + size);  // merge with the free block above
    if (next != free_by_addr_.end()) {
      size += next->second;
      remove_free(next);
    }
    auto after = free_by_addr_.lower_bound(addr);  // and with the one below
    if (after != free_by_addr_.begin()) {
      auto below = std::prev(after);
      if (below->first + below->second == addr) {
        addr = below->first;
        size += below->second;
        remove_free(below);
      }
    }
    if (addr + size == top_) {
      top_ = addr;  // the top takes it back: pages stay writable and resident
    } else {
      add_free(addr, size);
    }
  }

  // As torch's own CPU allocator does: the profiler's memory view sees every block.
  void report(uintptr_t addr, int64_t delta) const {
    c10::reportMemoryUsageToProfiler(reinterpret_cast<void*>(addr), delta, in_use_, writable_ - base_,
                                     c10::Device(c10::DeviceType::CPU));
  }

  void add_free(uintptr_t addr, size_t size) {
    free_by_addr_[addr] = size;
    free_by_size_.insert({size, addr});
  }

  void remove_free(std::map<uintptr_t, size_t>::iterator it) {
    free_by_size_.erase({it->second, it->first});
    free_by_addr_.erase(it);
  }

  c10::Allocator* fallback_;
  size_t threshold_;
  uintptr_t base_ = 0, end_ = 0, top_ = 0, peak_ = 0, writable_ = 0;
  size_t in_use_ = 0;
  std::mutex mutex_;
  std::map<uintptr_t, size_t> free_by_addr_;
  std::set<std::pair<size_t, uintptr_t>> free_by_size_;
  std::unordered_map<uintptr_t, size_t> used_;
};

BlockPool* BlockPool::instance = nullptr;

// Installs the pool as torch's CPU allocator (once per process: blocks it handed out must outlive
// any later change, so it is never removed); returns whether it is torch's CPU allocator now. Not
// over an allocator whose raw pointers cannot be freed alone (the pool's raw deleter passes them on).
bool install_block_pool(int64_t threshold, int64_t reserve) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (BlockPool::instance == nullptr) {
    c10::Allocator* before = c10::GetCPUAllocator();
    if (before->raw_deleter() == nullptr) return false;
    auto* pool = new BlockPool(before, std::max(static_cast<size_t>(threshold), kAlign), static_cast<size_t>(reserve));
    if (!pool->reserved()) {
      delete pool;
      return false;
    }
    BlockPool::instance = pool;
    pthread_atfork(&BlockPool::before_fork, &BlockPool::after_fork, &BlockPool::after_fork);
    c10::SetCPUAllocator(pool, /*priority=*/1);
  }
  return c10::GetCPUAllocator() == BlockPool::instance;
}

std::vector<int64_t> block_pool_stats() {
  if (BlockPool::instance == nullptr) return {};
  return BlockPool::instance->stats();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("install_block_pool(int threshold, int reserve) -> bool", &install_block_pool);
  m.def("block_pool_stats() -> int[]", &block_pool_stats);
}
