// torch.ops.aserve.stream_read: read every byte of a buffer once, on all of torch's threads, as fast as the cores
// can stream it. `aserve bench roofline` times it over a buffer far larger than the caches to find the memory
// bandwidth a batch-1 decode step (which reads every weight once) can at best reach on this machine.
//
// Returns the xor of the buffer's 64-bit words, so the compiler cannot drop the reads; four independent
// accumulators per thread keep the xors off the loads' critical path (the compiler widens them to vector lanes).
// stream_read_each reads several buffers in turn, a parallel read each, in one call: benchmarks/row_kernels.py sets a
// projection's kernel against reading what it reads (its codes and their scales), a call each from Python.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kWordsPerChunk = 1 << 14;  // 128 KiB per parallel_for grain: large enough to stream

uint64_t xor_words(const uint64_t* p, int64_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a ^= p[i];
    b ^= p[i + 1];
    c ^= p[i + 2];
    d ^= p[i + 3];
  }
  for (; i < n; ++i) a ^= p[i];
  return a ^ b ^ c ^ d;
}

int64_t stream_read(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.is_cpu() && buffer.is_contiguous(), "stream_read: needs a contiguous CPU tensor");
  const int64_t bytes = buffer.numel() * buffer.element_size();
  TORCH_CHECK(bytes % 8 == 0, "stream_read: the buffer's size must be a multiple of 8 bytes");
  const auto* words = static_cast<const uint64_t*>(buffer.data_ptr());
  const int64_t n = bytes / 8, chunks = (n + kWordsPerChunk - 1) / kWordsPerChunk;
  std::vector<uint64_t> per_chunk(chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t start = c * kWordsPerChunk;
      per_chunk[c] = xor_words(words + start, std::min(kWordsPerChunk, n - start));
    }
  });
  uint64_t all = 0;
  for (uint64_t x : per_chunk) all ^= x;
  int64_t out;
  std::memcpy(&out, &all, sizeof(out));
  return out;
}

int64_t stream_read_each(const std::vector<at::Tensor>& buffers) {
  int64_t all = 0;
  for (const at::Tensor& buffer : buffers) all ^= stream_read(buffer);
  return all;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("stream_read(Tensor buffer) -> int");
  m.def("stream_read_each(Tensor[] buffers) -> int");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("stream_read", &stream_read);
  m.impl("stream_read_each", &stream_read_each);
}
