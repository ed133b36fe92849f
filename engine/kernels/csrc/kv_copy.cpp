// A sequence's exported K or V back into the paged pool (engine/kv_cache.py `load`: a restore
// from host memory or disk). The pool half is [L, H_kv, slots, D]; the export is
// [L, T, H_kv, D], token t going to slot slots[t]. ATen's index_copy_ of the transposed export
// moved one element at a time: 11-14 ms for the 46 MB of a 2,000-token SmolLM2 conversation on
// the 2-core Zen 5 EPYC, on the engine thread, so every decoding user waited for the restore.
// Here each (layer, KV head, token) row of D values is one memcpy, the (layer, head) pairs
// split over the cores: 5-6 ms. Bytes are copied, not converted: both sides have the pool's
// dtype. (The other way, a persist's index_select, measured 8 ms against 6.5: left to ATen.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/library.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "crc32.h"

namespace {

// `slots`: n int64 slot ids, each inside the pool half [L, H_kv, slots, D]
void check_slots(const at::Tensor& pool, const at::Tensor& slots, int64_t n) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == n,
              "slots: contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < pool.size(2), "slot out of range");
}

// the element size, after checking that a pool half, an export and the slots agree
int64_t check(const at::Tensor& pool, const at::Tensor& kv, const at::Tensor& slots) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "pool: contiguous [L, H_kv, slots, D]");
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous(), "kv: contiguous [L, T, H_kv, D]");
  TORCH_CHECK(kv.scalar_type() == pool.scalar_type(), "kv and pool differ in dtype");
  TORCH_CHECK(kv.size(0) == pool.size(0) && kv.size(2) == pool.size(1) &&
                  kv.size(3) == pool.size(3),
              "kv [L, T, H_kv, D] does not match the pool's layers, heads or head size");
  check_slots(pool, slots, kv.size(1));
  return pool.element_size();
}

// a file descriptor closed however the function that opened it returns or throws
struct File {
  const int fd;
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

namespace crowdchat {

// pool[l, h, slots[t]] = kv[l, t, h] for every layer, head and token
void kv_scatter(at::Tensor pool, const at::Tensor& kv, const at::Tensor& slots) {
  const int64_t e = check(pool, kv, slots);
  const int64_t L = pool.size(0), H = pool.size(1), S = pool.size(2), D = pool.size(3);
  const int64_t T = kv.size(1), row = D * e;
  auto* pp = static_cast<char*>(pool.data_ptr());
  const auto* kp = static_cast<const char*>(kv.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();
  // 256 KB a (layer, head) pair at 2,000 tokens of 64 bf16 values; a few tokens' worth is
  // copied by this thread alone (waking the others would cost more)
  const int64_t grain = T * row < 65536 ? L * H + 1 : 1;
  at::parallel_for(0, L * H, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t l = i / H, h = i % H;
      char* base = pp + (l * H + h) * S * row;
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(base + sp[t] * row, kp + ((l * T + t) * H + h) * row, row);
    }
  });
}

// A snapshot's K or V straight from its file into the pool (sessions/snapshots.py writes it:
// [L, T, H_kv, D] in the pool's dtype at byte `offset`): tokens `skip`.. go to slots[t - skip],
// the first `skip` are only checksummed (the prefix cache holds them). Returns the CRC-32 of
// all the tensor's bytes, continued from `crc` (zlib's crc32, as the writer computed it).
// Before, a disk restore mapped the file, checksummed it, then copied it into the pool on the
// engine thread, each step in Python taking turns at the GIL with the user's turn. Here it is
// one pass on the calling thread with the GIL released: a layer at a time read into a buffer
// (0.8 MB at 2,000 tokens of SmolLM2: it stays in L2 for its checksum and its copy) while the
// kernel reads the next ones ahead. Zen 5 EPYC, 2,000 tokens (46 MB) from a cold page cache:
// 24 ms with pread, 30 ms from a mapping (MADV_SEQUENTIAL: 46-62), the disk's own rate.
int64_t kv_read_file(const std::string& path, int64_t offset, at::Tensor pool,
                     const at::Tensor& slots, int64_t tokens, int64_t skip, int64_t crc) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "pool: contiguous [L, H_kv, slots, D]");
  TORCH_CHECK(tokens > 0 && skip >= 0 && skip <= tokens && slots.dim() == 1 &&
                  slots.size(0) == tokens - skip,
              "slots must number the tokens after `skip`");
  check_slots(pool, slots, tokens - skip);
  TORCH_CHECK(offset >= 0 && crc >= 0 && crc <= 0xffffffffLL, "bad offset or crc");
  const int64_t L = pool.size(0), H = pool.size(1), S = pool.size(2), D = pool.size(3);
  // The sizes are multiplied checked, and the file's size compared, before `buf` is sized:
  // a `tokens` past any file's size overflowed `layer` (undefined behaviour; the wrapped size
  // then had the copy read outside `buf`, ASan's heap-buffer-overflow, fuzz/) or allocated
  // the buffer (std::bad_alloc, a leaked descriptor) before the file could say it was short.
  int64_t row = 0, layer = 0, bytes = 0, end = 0;
  TORCH_CHECK(!__builtin_mul_overflow(D, pool.element_size(), &row) &&
                  !__builtin_mul_overflow(row, H, &layer) &&
                  !__builtin_mul_overflow(layer, tokens, &layer) &&
                  !__builtin_mul_overflow(layer, L, &bytes) &&
                  !__builtin_add_overflow(offset, bytes, &end),
              "tokens and offset past any file's size");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const File file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  // the file's faults are ValueErrors in Python (a bad snapshot), the arguments' RuntimeErrors
  TORCH_CHECK_VALUE(file.fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  TORCH_CHECK_VALUE(::fstat(file.fd, &st) == 0, path, ": ", std::strerror(errno));
  TORCH_CHECK_VALUE(S_ISREG(st.st_mode), path, ": not a regular file");
  TORCH_CHECK_VALUE(end <= st.st_size, path, ": shorter than its tensor");
  // nothing to read or copy (no layers, tokens, heads or head size): the CRC as given, and no
  // memcpy to or from the null data of an empty tensor (undefined even for 0 bytes: UBSan)
  if (L == 0 || layer == 0) return crc;
  std::vector<char> buf(layer);
  char* pp = static_cast<char*>(pool.data_ptr());
  auto c = static_cast<uint32_t>(crc);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t got = 0; got < layer;) {
      const ssize_t n = ::pread(file.fd, buf.data() + got, layer - got, offset + l * layer + got);
      if (n <= 0 && !(n < 0 && errno == EINTR)) {
        const int err = n < 0 ? errno : 0;
        TORCH_CHECK_VALUE(false, path, ": ", err ? std::strerror(err) : "shorter than its tensor");
      }
      got += n > 0 ? n : 0;
    }
    c = crc32(buf.data(), static_cast<size_t>(layer), c);
    for (int64_t t = skip; t < tokens; ++t)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(pp + ((l * H + h) * S + sp[t - skip]) * row, buf.data() + (t * H + h) * row,
                    row);
  }
  return c;
}

// zlib.crc32 of a contiguous tensor's bytes, continued from `crc` (engine/kv_file.py
// `kv_crc32`: a snapshot's checksum as it is written)
int64_t crc32_bytes(const at::Tensor& data, int64_t crc) {
  TORCH_CHECK(data.is_contiguous() && data.device().is_cpu(), "data: a contiguous CPU tensor");
  TORCH_CHECK(crc >= 0 && crc <= 0xffffffffLL, "crc: 0 to 2**32 - 1");
  const auto n = static_cast<size_t>(data.numel()) * data.element_size();
  return n ? crc32(data.data_ptr(), n, static_cast<uint32_t>(crc)) : crc;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("crc32_bytes(Tensor data, int crc) -> int");
  m.def("kv_scatter(Tensor(a!) pool, Tensor kv, Tensor slots) -> ()");
  m.def(
      "kv_read_file(str path, int offset, Tensor(a!) pool, Tensor slots, int tokens, int skip, "
      "int crc) -> int");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("kv_scatter", &crowdchat::kv_scatter);
  m.impl("kv_read_file", &crowdchat::kv_read_file);
  m.impl("crc32_bytes", &crowdchat::crc32_bytes);
}
