// Each of torch's OpenMP threads bound to one core (Linux), as vLLM binds its CPU workers'
// (`VLLM_CPU_OMP_THREADS_BIND`). Why: every operator is a parallel region whose threads wait for each
// other at its end, so a thread the kernel moves onto a core another process keeps busy stalls them
// all; bound one to a core each, they are never moved behind each other.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <cstdint>
#include <vector>

namespace {

// Thread i of the pool runs on cores[i]; returns, per thread, whether the kernel accepted it.
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cores) {
  const int threads = static_cast<int>(cores.size());
  std::vector<int64_t> done(threads, 0);
#pragma omp parallel num_threads(threads)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cores[i]), &set);
    done[i] = pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
  }
  return done;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedrl_cpu, m) { m.def("bind_threads(int[] cores) -> int[]", &bind_threads); }
