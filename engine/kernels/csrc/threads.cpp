// The calling thread's OpenMP team size for its next parallel regions (engine/model_runner.py:
// a step of few rows runs on the engine thread alone). omp_set_num_threads changes this
// thread's own setting; torch.set_num_threads would also change the default every thread
// starts with. Every at::parallel_for on this thread then sees at::get_num_threads() == n, and
// at 1 calls its body directly, without a parallel region.
#include <omp.h>
#include <torch/library.h>

namespace crowdchat {

// sets the team size to n (n >= 1); returns the one before
int64_t omp_threads(int64_t n) {
  TORCH_CHECK(n >= 1 && n <= 4096, "omp_threads: n must be 1..4096, got ", n);
  const int before = omp_get_max_threads();
  omp_set_num_threads(static_cast<int>(n));
  return before;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("omp_threads(int n) -> int");
}

TORCH_LIBRARY_IMPL(crowdchat, CompositeExplicitAutograd, m) {
  m.impl("omp_threads", &crowdchat::omp_threads);
}
