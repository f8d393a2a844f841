// The argument checks the two attention ops (attention_decode.cpp, attention_prefill.cpp) share.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace aserve_kernels {

// What both attention ops require of the query, the output and the caches (keys in pairs of dims: kv_write.cpp).
inline void check_attention_args(const char* op, const at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t kv_format) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), op, ": query and out must be [rows, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              op, ": k_cache and v_cache must be contiguous [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(query.size(1) % k_cache.size(0) == 0, op, ": query heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), op, ": head_dim differs between query and cache");
  TORCH_CHECK(query.size(2) % 2 == 0, op, ": head_dim must be even (the cache stores keys in pairs of dims)");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, op, ": query and out need unit stride in head_dim");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              op, ": query and out must share a dtype, and so must the two caches");
  TORCH_CHECK(kv_format == 0 ? k_cache.scalar_type() == query.scalar_type() : k_cache.scalar_type() == at::kByte,
              op, ": the cache must be in the query's dtype, or uint8 (FP8 bytes) with kv_format 1 or 2");
}

// Row i of block_tables ([rows, width] int64) holds the blocks of tokens[i] tokens: enough entries, each a block of
// the cache. The kernels read wherever a table points, so a short table or a stray block id read outside the cache.
inline void check_block_tables(const char* op, const at::Tensor& block_tables, const int64_t* tokens,
                               const at::Tensor& k_cache) {
  const int64_t rows = block_tables.size(0), width = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t* table = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(tokens[i] >= 0 && (tokens[i] + block_size - 1) / block_size <= width, op,
                ": row ", i, "'s block table is shorter than its context and tokens (", tokens[i], " tokens, ", width,
                " blocks of ", block_size, ")");
    for (int64_t j = 0; j < (tokens[i] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(table[i * width + j] >= 0 && table[i * width + j] < num_blocks, op, ": block ",
                  table[i * width + j], " is outside the cache (", num_blocks, " blocks)");
  }
}

}  // namespace aserve_kernels
