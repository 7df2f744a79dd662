// torch's CPU allocator with a cache of large freed blocks, as its CUDA allocator keeps freed device
// memory. Why: a training step allocates the same large tensors every time (a chunk of LM-head
// logits is 200 MB, the tied head's weight gradient 113 MB) and frees them. The C allocator maps
// each block above 32 MB afresh and unmaps it on free, so the kernel zeroes every page again on its
// first write: on a 2-core VM a GRPO step of the default model spent more time in these page faults
// than in its arithmetic. Blocks of at least `min_bytes` are kept when freed and handed to the next
// request they fit: the smallest kept block at least as large, if at most twice the request (a
// micro-batch's activations are as long as its tokens, which vary from one to the next). At most
// `limit_bytes` are kept; past that, the blocks kept longest are given back first (a block a step
// uses is taken again within the step; one that waits is of a size the steps stopped asking for).
// Smaller requests go to torch's own allocator.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

// Sizes rounded up to one of eight classes per octave (at most 12.5% over the request): a step's
// tensors vary in length from step to step, and a block of a class serves every request in it.
size_t size_class(size_t n) {
  size_t octave = size_t(1) << (63 - __builtin_clzll(n));  // the power of two at or below n
  const size_t step = octave / 8;
  return (n + step - 1) / step * step;
}

class BlockCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) return base_->allocate(n);
    const size_t want = size_class(n);
    void* p = nullptr;
    size_t size = want;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(want);
      if (it != free_.end() && it->first <= 2 * want) {
        p = it->second.first;
        size = it->first;
        cached_ -= size;
        order_.erase(it->second.second);
        free_.erase(it);
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (p == nullptr) p = c10::alloc_cpu(size);
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_[p] = size;
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void install(int64_t min_bytes, int64_t limit_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    min_bytes_ = static_cast<size_t>(min_bytes);
    limit_ = static_cast<size_t>(limit_bytes);
    if (base_ == nullptr) {
      base_ = c10::GetCPUAllocator();
      c10::SetCPUAllocator(this, /*priority=*/1);
    }
  }

  // Frees every kept block; returns the bytes given back.
  int64_t empty() {
    std::vector<void*> blocks;
    int64_t bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      bytes = static_cast<int64_t>(cached_);
      for (auto& [size, kept] : free_) blocks.push_back(kept.first);
      free_.clear();
      order_.clear();
      cached_ = 0;
    }
    for (void* p : blocks) c10::free_cpu(p);
    return bytes;
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {base_ != nullptr, static_cast<int64_t>(cached_), static_cast<int64_t>(free_.size()),
            static_cast<int64_t>(live_.size()), hits_, misses_};
  }

 private:
  static void release(void* p);

  void keep(void* p) {
    std::vector<void*> dropped;
    c10::DeleterFnPtr small = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(p);
      if (it == live_.end()) {  // a small block `raw_allocate` took from torch's allocator
        small = base_->raw_deleter();
      } else {
        keep_locked(it, dropped);
      }
    }
    if (small != nullptr) small(p);
    for (void* q : dropped) c10::free_cpu(q);
  }

  void keep_locked(std::unordered_map<void*, size_t>::iterator it, std::vector<void*>& dropped) {
    void* p = it->first;
    const size_t size = it->second;
    live_.erase(it);
    if (size > limit_) {
      dropped.push_back(p);
      return;
    }
    while (cached_ + size > limit_) {  // the block kept longest goes first
      auto oldest = order_.begin();
      auto [first, last] = free_.equal_range(oldest->second);
      for (auto k = first; k != last; ++k) {
        if (k->second.second == oldest->first) {
          dropped.push_back(k->second.first);
          free_.erase(k);
          break;
        }
      }
      cached_ -= oldest->second;
      order_.erase(oldest);
    }
    const uint64_t when = clock_++;
    order_.emplace(when, size);
    free_.emplace(size, std::make_pair(p, when));
    cached_ += size;
  }

  std::mutex mu_;
  c10::Allocator* base_ = nullptr;
  size_t min_bytes_ = size_t(1) << 62;
  size_t limit_ = 0;
  size_t cached_ = 0;
  int64_t hits_ = 0, misses_ = 0;
  uint64_t clock_ = 0;
  std::multimap<size_t, std::pair<void*, uint64_t>> free_;  // kept blocks by size: (block, when kept)
  std::map<uint64_t, size_t> order_;                         // when each was kept, oldest first: its size
  std::unordered_map<void*, size_t> live_;                   // handed-out blocks and their sizes
};

BlockCache& cache() {
  static BlockCache* instance = new BlockCache();  // never destroyed: tensors may outlive static teardown
  return *instance;
}

void BlockCache::release(void* p) { cache().keep(p); }

bool cache_cpu_blocks(int64_t min_bytes, int64_t limit_bytes) {
  TORCH_CHECK(min_bytes > 0 && limit_bytes >= 0, "cache_cpu_blocks: min_bytes > 0 and limit_bytes >= 0");
  cache().install(min_bytes, limit_bytes);
  return true;
}

int64_t empty_cpu_block_cache() { return cache().empty(); }

std::vector<int64_t> cpu_block_cache_stats() { return cache().stats(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) {
  m.def("cache_cpu_blocks(int min_bytes, int limit_bytes) -> bool", &cache_cpu_blocks);
  m.def("empty_cpu_block_cache() -> int", &empty_cpu_block_cache);
  m.def("cpu_block_cache_stats() -> int[]", &cpu_block_cache_stats);
}
