// Prefill attention over the paged KV cache, torch.ops.aserve.paged_prefill_attention: FlashAttention-style
// register tiles, the cache in the query's dtype or FP8 bytes.
//
// Chunks of prompt tokens, each query attending to its chunk's cached context and causally to the chunk itself
// (its keys are written to the cache before this runs), FlashAttention's way: nothing of size keys x queries is
// kept. A work item is (chunk, kv head, tile of about kTileRows query rows: query tokens x the group's heads).
// Its queries are loaded once, scaled and held transposed, [head_dim][rows]; its keys are walked kKeyStep at a
// time, read in place from the cache (widened to fp32 first when the cache is 16-bit or FP8), with a running
// max, sum and output per query row. Both products are register tiles of 6 rows x 2W columns (W = fVec::size()),
// as in a GEMM: the scores as keys x query rows (a key element broadcast against 2W query rows), the output as
// query rows x head dims (a probability broadcast against 2W dims of a value row). No transposes of the keys,
// no horizontal sums. Items are dealt to threads round-robin by descending cost, so the causal triangle's long
// tiles do not all land on one thread.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "attention_args.h"
#include "vec_helpers.h"

namespace {

using namespace aserve_kernels;

constexpr int kTileRows = 48;
constexpr int kKeyStep = 32;
constexpr int kCols = 2 * fVec::size();

// st[i][0..kCols) = sum_d k[i][d] * qt[d][0..kCols): MR keys' scores against kCols query rows.
template <int MR>
inline void score_tile(const float* const* k, const float* qt, int64_t ldq, int64_t D, float* st, int64_t ldst) {
  fVec acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = fVec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const fVec b0 = fVec::loadu(qt + d * ldq), b1 = fVec::loadu(qt + d * ldq + fVec::size());
    for (int i = 0; i < MR; ++i) {
      const fVec a(k[i][d]);
      acc[i][0] = at::vec::fmadd(a, b0, acc[i][0]);
      acc[i][1] = at::vec::fmadd(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    acc[i][0].store(st + i * ldst);
    acc[i][1].store(st + i * ldst + fVec::size());
  }
}

// o[r][0..kCols) = o[r][0..kCols) * corr[r] + sum_j pt[j][r] * v[j][0..kCols), for MR query rows r.
template <int MR>
inline void output_tile(const float* pt, int64_t ldp, const float* const* v, int64_t c, int64_t nk, float* o,
                        int64_t ldo, const float* corr) {
  fVec acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = fVec::loadu(o + i * ldo) * fVec(corr[i]);
    acc[i][1] = fVec::loadu(o + i * ldo + fVec::size()) * fVec(corr[i]);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const fVec b0 = fVec::loadu(v[j] + c), b1 = fVec::loadu(v[j] + c + fVec::size());
    for (int i = 0; i < MR; ++i) {
      const fVec a(pt[j * ldp + i]);
      acc[i][0] = at::vec::fmadd(a, b0, acc[i][0]);
      acc[i][1] = at::vec::fmadd(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    acc[i][0].store(o + i * ldo);
    acc[i][1].store(o + i * ldo + fVec::size());
  }
}

template <typename F> inline void by_rows(int64_t n, F&& f) {  // f(first, rows) in runs of 6, then the rest
  int64_t i = 0;
  for (; i + 6 <= n; i += 6) f(i, std::integral_constant<int, 6>{});
  switch (n - i) {
    case 5: f(i, std::integral_constant<int, 5>{}); break;
    case 4: f(i, std::integral_constant<int, 4>{}); break;
    case 3: f(i, std::integral_constant<int, 3>{}); break;
    case 2: f(i, std::integral_constant<int, 2>{}); break;
    case 1: f(i, std::integral_constant<int, 1>{}); break;
  }
}

// Query tokens per item: about kTileRows rows (tokens x the group's heads), as a multiple of kCols rows where one
// near it exists, so that no score column is padding (3 heads a group, 16-lane vectors: 32 tokens = 96 rows
// instead of 16 = 48 rows in 64 columns).
inline int64_t tile_query_count(int64_t group) {
  const int64_t step = kCols / std::gcd<int64_t>(group, kCols);  // tokens whose rows fill whole columns
  const int64_t wanted = std::max<int64_t>(1, kTileRows / group);
  if (step * group <= 2 * kTileRows) return std::max<int64_t>(step, (wanted + step / 2) / step * step);
  return wanted;
}

// One thread's scratch, sized for the largest item.
struct PrefillScratch {
  std::vector<float> qt, o, st, kbuf, vbuf, m, l, corr, pos;  // pos: each query row's position, as fp32
  std::vector<const float*> krow, vrow;
  PrefillScratch(int64_t rows, int64_t padded, int64_t D)
      : qt(D * padded), o(rows * D), st(kKeyStep * padded), kbuf(kKeyStep * D), vbuf(kKeyStep * D), m(padded),
        l(padded), corr(padded), pos(padded), krow(kKeyStep), vrow(kKeyStep) {}
};

// T: the query's and output's type; C: the cache's (T, or an FP8 tag with k_scale / v_scale folded in).
template <typename T, typename C>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap, double k_scale, double v_scale) {
  const int64_t num_heads = query.size(1), D = query.size(2), chunks = context_lens.size(0);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = block_tables.size(1);
  const int64_t tile_queries = tile_query_count(group);
  const int64_t max_rows = tile_queries * group, padded = (max_rows + kCols - 1) / kCols * kCols;
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const T* q_ptr = query.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const C* k_ptr = reinterpret_cast<const C*>(k_cache.const_data_ptr());
  const C* v_ptr = reinterpret_cast<const C*>(v_cache.const_data_ptr());
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t head_stride = num_blocks * block_size * D;
  const float fscale = static_cast<float>(scale * k_scale), vscale = static_cast<float>(v_scale);
  const float cap = static_cast<float>(softcap), neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t full_cols = D / kCols * kCols;

  struct Item { int64_t chunk, kvh, q0, nq, cost; };
  std::vector<Item> items;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n = starts[c + 1] - starts[c], ctx = contexts[c];
    for (int64_t q0 = 0; q0 < n; q0 += tile_queries) {
      const int64_t nq = std::min(tile_queries, n - q0), last = ctx + q0 + nq;
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx + q0 - window + 1) : 0;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({c, h, q0, nq, nq * (last - first)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));

  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    PrefillScratch s(max_rows, padded, D);
    std::vector<float> row(D);
    for (int64_t t = begin; t < end; ++t) {
      for (size_t it = t; it < items.size(); it += threads) {
        const Item item = items[it];
        const int64_t ctx = contexts[item.chunk], row0 = starts[item.chunk] + item.q0, h0 = item.kvh * group;
        const int64_t rows = item.nq * group;
        const int64_t* table = tables + item.chunk * table_width;
        const C* k_head = k_ptr + item.kvh * head_stride;
        const C* v_head = v_ptr + item.kvh * head_stride;
        // queries, scaled, as [D][padded]; row r = query qi's head g at r = qi * group + g
        std::fill(s.qt.begin(), s.qt.end(), 0.f);
        for (int64_t qi = 0; qi < item.nq; ++qi) {
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = qi * group + g;
            load_row(q_ptr + (row0 + qi) * qs0 + (h0 + g) * qs1, row.data(), D);
            for (int64_t d = 0; d < D; ++d) s.qt[d * padded + r] = row[d] * fscale;
            s.pos[r] = static_cast<float>(ctx + item.q0 + qi);
          }
        }
        std::fill(s.pos.begin() + rows, s.pos.end(), s.pos[rows - 1]);  // padding rows: copies of the last
        std::fill(s.m.begin(), s.m.end(), neg_inf);
        std::fill(s.l.begin(), s.l.end(), 0.f);
        std::fill(s.o.begin(), s.o.begin() + rows * D, 0.f);
        const int64_t first_pos = ctx + item.q0, last_pos = ctx + item.q0 + item.nq - 1;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0, hi = last_pos + 1;
        for (int64_t t0 = lo; t0 < hi; t0 += kKeyStep) {
          const int64_t nk = std::min<int64_t>(kKeyStep, hi - t0);
          for (int64_t j = 0; j < nk; ++j) {
            const int64_t tok = t0 + j, at = (table[tok / block_size] * block_size + tok % block_size) * D;
            if constexpr (std::is_same_v<C, float>) {
              s.krow[j] = k_head + at;
              s.vrow[j] = v_head + at;
            } else {
              load_row(k_head + at, s.kbuf.data() + j * D, D);
              load_row(v_head + at, s.vbuf.data() + j * D, D);
              s.krow[j] = s.kbuf.data() + j * D;
              s.vrow[j] = s.vbuf.data() + j * D;
            }
          }
          float* st = s.st.data();  // [nk][padded] scores, then probabilities
          for (int64_t c = 0; c < padded; c += kCols)
            by_rows(nk, [&](int64_t i, auto mr) {
              score_tile<decltype(mr)::value>(s.krow.data() + i, s.qt.data() + c, padded, D, st + i * padded + c,
                                              padded);
            });
          // softcap, mask and the online softmax, each across query rows: a vector holds W rows' scores for one
          // key (padding rows too: their queries are zero, their results unused)
          const fVec lowest(neg_inf);
          if (cap > 0.f)
            for (int64_t j = 0; j < nk; ++j)
              for (int64_t r = 0; r < padded; r += fVec::size()) {
                const fVec x = fVec::loadu(st + j * padded + r);
                ((x / fVec(cap)).tanh() * fVec(cap)).store(st + j * padded + r);
              }
          if (t0 + nk - 1 > first_pos || (window > 0 && t0 <= last_pos - window)) {  // some keys masked
            for (int64_t j = 0; j < nk; ++j)
              for (int64_t r = 0; r < padded; r += fVec::size()) {
                const fVec key(static_cast<float>(t0 + j)), pos = fVec::loadu(s.pos.data() + r);
                fVec masked = key > pos;
                if (window > 0) masked = masked | (key <= pos - fVec(static_cast<float>(window)));
                fVec::blendv(fVec::loadu(st + j * padded + r), lowest, masked).store(st + j * padded + r);
              }
          }
          for (int64_t r = 0; r < padded; r += fVec::size()) {
            const fVec old = fVec::loadu(s.m.data() + r);
            fVec peak = old;
            for (int64_t j = 0; j < nk; ++j) peak = at::vec::maximum(peak, fVec::loadu(st + j * padded + r));
            // a row with no key yet (its window starts further on) keeps m = -inf; its scores, all -inf, are
            // shifted by 0 so that they give probabilities of 0, not NaN
            const fVec none = peak == lowest;
            const fVec corr = fVec::blendv((old - peak).exp(), fVec(1.f), none);
            const fVec shift = fVec::blendv(peak, fVec(0.f), none);
            fVec sum(0.f);
            for (int64_t j = 0; j < nk; ++j) {
              const fVec prob = (fVec::loadu(st + j * padded + r) - shift).exp();
              prob.store(st + j * padded + r);
              sum = sum + prob;
            }
            peak.store(s.m.data() + r);
            corr.store(s.corr.data() + r);
            (fVec::loadu(s.l.data() + r) * corr + sum).store(s.l.data() + r);
          }
          by_rows(rows, [&](int64_t r, auto mr) {
            for (int64_t c = 0; c < full_cols; c += kCols)
              output_tile<decltype(mr)::value>(st + r, padded, s.vrow.data(), c, nk, s.o.data() + r * D + c, D,
                                               s.corr.data() + r);
            for (int64_t i = r; i < r + decltype(mr)::value; ++i)  // head dims past the last full tile
              for (int64_t c = full_cols; c < D; ++c) {
                float acc = s.o[i * D + c] * s.corr[i];
                for (int64_t j = 0; j < nk; ++j) acc += st[j * padded + i] * s.vrow[j][c];
                s.o[i * D + c] = acc;
              }
          });
        }
        for (int64_t qi = 0; qi < item.nq; ++qi)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = qi * group + g;
            scale_row(s.o.data() + r * D, vscale / s.l[r], D);
            store_row(s.o.data() + r * D, o_ptr + (row0 + qi) * os0 + (h0 + g) * os1, D);
          }
      }
    }
  });
}

template <typename T>
void prefill_attention_by_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                                int64_t window, double softcap, double k_scale, double v_scale, int64_t kv_format) {
  switch (kv_format) {
    case 0: return prefill_attention_impl<T, T>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale);
    case 1: return prefill_attention_impl<T, E4M3>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale * 256.0, v_scale * 256.0);
    case 2: return prefill_attention_impl<T, E5M2>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale);
  }
  TORCH_CHECK(false, "paged_prefill_attention: kv_format must be 0 (the query's dtype), 1 (fp8 e4m3) or 2 (fp8 e5m2)");
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                             int64_t window, double softcap, double k_scale, double v_scale, int64_t kv_format) {
  check_attention_args("paged_prefill_attention", out, query, k_cache, v_cache, kv_format);
  const int64_t chunks = context_lens.size(0);
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() && context_lens.dim() == 1,
              "context_lens must be a contiguous int64 [chunks] vector");
  TORCH_CHECK(query_starts.scalar_type() == at::kLong && query_starts.is_contiguous() &&
                  query_starts.numel() == chunks + 1,
              "query_starts must be contiguous int64 [chunks + 1]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == chunks,
              "block_tables must be contiguous int64 [chunks, width]");
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(starts[c] <= starts[c + 1] && starts[c + 1] <= query.size(0) && contexts[c] >= 0,
                "query_starts must rise within the query's rows, and context_lens be >= 0");
    TORCH_CHECK((contexts[c] + starts[c + 1] - starts[c] + k_cache.size(2) - 1) / k_cache.size(2) <=
                    block_tables.size(1),
                "a chunk's block table is shorter than its context and tokens");
  }
  if (chunks == 0) return;
  switch (query.scalar_type()) {
    case at::kFloat: return prefill_attention_by_cache<float>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    case at::kBFloat16: return prefill_attention_by_cache<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    case at::kHalf: return prefill_attention_by_cache<c10::Half>(out, query, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap, k_scale, v_scale, kv_format);
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_starts, Tensor context_lens, float scale, int window, float softcap, float k_scale=1.0, "
        "float v_scale=1.0, int kv_format=0) -> ()");
}

TORCH_LIBRARY_IMPL(aserve, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
