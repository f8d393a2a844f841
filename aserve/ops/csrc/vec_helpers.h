// What more than one of aserve's CPU kernel files uses: the fp32 vector type, the FP8 cache tags and their
// widening, rows converted to and from fp32 scratch and scaled there, and a vector's lanes summed. Inline, in
// namespace aserve_kernels, which each kernel file brings into its anonymous namespace.
//
// The kernels (csrc/*.cpp, one file a family, each registering its own torch.ops.aserve.* ops) fuse decode and
// prefill attention over the paged KV cache, KV cache writes (FP8 quantization included), RMSNorm, rotary
// embedding, SiLU-and-mul, the int8 weight-only linear of decode batches, sampling and the batched LoRA delta
// (lora.cpp). Each replaces a chain of small torch ops (and, for attention, a gather that copied every request's
// context once per layer) with one pass over the data. aserve/ops/cpu_kernels.py builds them, with cpu_gemm.cpp,
// as one extension once per CPU kind and falls back to the torch path without it.
//
// Arithmetic is in fp32 whatever the storage dtype (float, bfloat16, half); results are rounded where the
// torch path rounds, so the two agree to the last bit in fp32 up to summation order.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace aserve_kernels {

using fVec = at::vec::Vectorized<float>;  // 16 lanes with AVX-512, 8 with AVX2 (CPU_CAPABILITY_* at build)
// fVec's register, for sums a loop keeps: GCC may keep an array of fVec in memory and store every element back on
// every step of the loop (prefill attention's fp32 tiles, as built for bf16 rows, stored their 12 sums beside their
// 12 FMAs), an array of the register type it keeps in registers.
#if defined(CPU_CAPABILITY_AVX512)
using fReg = __m512;
#else
using fReg = fVec;  // AVX2: those tiles ran no faster on __m256
#endif

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = 2^(x log2(e))

// 2^t for t <= 8 (prefill's softmax lets a probability reach 2^8; nothing asks for more): 2^round(t) times a
// degree-5 polynomial in the remainder (within about 2 ulp of fp32), scaled with vscalefps; t at or below -125
// (-inf included) gives exactly 0. The softmaxes' exp (prefill and decode attention): inline, where at::vec's exp()
// calls Sleef. Ten instructions against at::vec's exp_u20's twenty; without AVX-512, exp_u20 (within 20 ulp) of
// t ln 2. No lane ever computes a result below fp32's normal range: on Intel cores an instruction whose result
// underflows (a denormal, or a tiny value flushed to 0) takes a microcode assist of ~150 cycles unless FTZ is set,
// and torch leaves it clear. Every causally masked score (-inf) used to go through scalef(p, -200): on a Xeon with
// AMX (2 threads) the softmax was a third of 4 x 128-token prefill attention, and the call 0.39 ms against 0.21 ms
// once the masked lanes are zeroed by the mask instead.
inline fVec exp2_bounded(const fVec& t) {
  const fVec lowest(-125.f);  // 2^-125 times the polynomial's least (2^-0.5) is still a normal float
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = _mm512_max_ps(t, lowest);
  const __mmask16 normal = _mm512_cmp_ps_mask(t, lowest, _CMP_GT_OQ);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.0013266970636323094f), _mm512_set1_ps(0.009675459936261177f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.05550742521882057f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.24022121727466583f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.6931469440460205f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_maskz_scalef_ps(normal, p, n);
#else
  const fVec e = (at::vec::maximum(t, lowest) * fVec(0.6931471805599453f)).exp_u20();
  return fVec::blendv(fVec(0.f), e, t > lowest);
#endif
}

// tanh and erf as odd rational functions z P(z^2) / Q(z^2) on a clamped range (Eigen's fast tanh and erf
// coefficients), beyond which both are 1 to float precision: within 1e-7 of the exact functions, in FMAs and one
// division, inline, where at::vec's tanh() and erf() call Sleef's exp. The GEMM's GELU epilogue and attention's
// soft-capping. In the epilogue of a [7700, 768] x [768, 3072] bf16 product (a BERT-base MLP's step, weights scaled
// 1/sqrt(K)) at::vec's erf added 4.4-5.3 ms and its tanh 12-14 ms to the GEMM's 34-36, these 1.7-2.1 ms (AMD EPYC
// Zen 5, avx2 avx512f avx512_bf16, 2 threads).
template <class Vec, size_t P, size_t Q>
inline Vec odd_rational(Vec z, const float (&p)[P], const float (&q)[Q]) {
  const Vec z2 = z * z;
  Vec num(p[P - 1]), den(q[Q - 1]);
  for (size_t i = P - 1; i-- > 0;) num = at::vec::fmadd(num, z2, Vec(p[i]));
  for (size_t i = Q - 1; i-- > 0;) den = at::vec::fmadd(den, z2, Vec(q[i]));
  return z * num / den;
}

constexpr float kErfP[7] = {-1.60960333262415e-02f, -2.95459980854025e-03f, -7.34990630326855e-04f,
                            -5.69250639462346e-05f, -2.10102402082508e-06f, 2.77068142495902e-08f,
                            -2.72614225801306e-10f};
constexpr float kErfQ[5] = {-1.42647390514189e-02f, -7.37332916720468e-03f, -1.68282697438203e-03f,
                            -2.13374055278905e-04f, -1.45660718464996e-05f};
constexpr float kTanhP[7] = {4.89352455891786e-03f, 6.37261928875436e-04f, 1.48572235717979e-05f,
                             5.12229709037114e-08f, -8.60467152213735e-11f, 2.00018790482477e-13f,
                             -2.76076847742355e-16f};
constexpr float kTanhQ[4] = {4.89352518554385e-03f, 2.26843463243900e-03f, 1.18534705686654e-04f,
                             1.19825839466702e-06f};

template <class Vec> inline Vec erf_rational(Vec x) {
  return odd_rational(at::vec::clamp(x, Vec(-4.f), Vec(4.f)), kErfP, kErfQ);
}
template <class Vec> inline Vec tanh_rational(Vec x) {
  return odd_rational(at::vec::clamp(x, Vec(-9.f), Vec(9.f)), kTanhP, kTanhQ);
}

// An FP8 KV cache stores bytes; these tags say how to read them. Bytes are widened through fp16 bit
// patterns: e5m2 is an fp16's top byte; e4m3's exponent and mantissa moved into fp16's place read as the value
// times 2^-8 (bias 7 against 15, subnormals included). decode_attention_by_cache folds that 2^8 into the
// scales, so a row widens with no multiply. Saturated writes mean e4m3's NaN pattern never occurs.
struct E4M3 { uint8_t bits; };
struct E5M2 { uint8_t bits; };
template <typename T> constexpr bool is_fp8 = std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>;

template <typename T> inline uint16_t fp8_to_fp16_bits(uint8_t b) {
  if constexpr (std::is_same_v<T, E5M2>) {
    return static_cast<uint16_t>(b) << 8;
  } else {
    return static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8));
  }
}

template <typename T> inline float fp8_to_float(uint8_t b) {
  return static_cast<float>(c10::Half(fp8_to_fp16_bits<T>(b), c10::Half::from_bits()));
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2) || defined(__AVX512F__)
// e4m3 bytes, each in the high byte of a 16-bit lane (the low byte anything), as fp16 bit patterns
// (fp8_to_fp16_bits): an arithmetic shift right by 1 puts the sign in bits 15 and 14 and the exponent and mantissa
// in bits 13-7, and the mask clears bit 14 and the low byte's bits left in 6-0. Two ops where moving the sign and the
// rest apart took five. 8 lanes, and 16 with AVX-512.
inline __m128i e4m3_high_bytes_as_half(__m128i w) {
  return _mm_and_si128(_mm_srai_epi16(w, 1), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
}
// 8 FP8 bytes at p as fp32 lanes through fp16 bit patterns: exact, e4m3's values times 2^-8.
template <typename T> inline __m256 fp8_8_as_float(const void* p) {
  const __m128i w = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(p))), 8);
  return _mm256_cvtph_ps(std::is_same_v<T, E5M2> ? w : e4m3_high_bytes_as_half(w));
}
#endif
#if defined(__AVX512F__)
inline __m256i e4m3_high_bytes_as_half(__m256i w) {
  return _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
}
// 16 FP8 bytes (tag T; in a register, or at p) as fp32 lanes, as fp8_8_as_float.
template <typename T> inline __m512 fp8_bytes_as_float(__m128i bytes) {
  const __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);  // each byte in its lane's high byte
  return _mm512_cvtph_ps(std::is_same_v<T, E5M2> ? w : e4m3_high_bytes_as_half(w));
}
template <typename T> inline __m512 fp8_16_as_float(const void* p) {
  return fp8_bytes_as_float<T>(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
#endif

// n FP8 values as fp32 (e4m3's times 2^-8), a vector at a time: one at a time they went through c10::Half.
template <typename T> inline void fp8_row_as_float(const T* src, float* dst, int64_t n) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, fp8_16_as_float<T>(bytes + i));
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fp8_8_as_float<T>(bytes + i));
#endif
  for (; i < n; ++i) dst[i] = fp8_to_float<T>(bytes[i]);
}

// Rows are converted to fp32 scratch once and worked on there (at::vec's generic convert is scalar for
// 16-bit -> fp32, so the widening is spelled out with Vectorized<T>; the narrowing one is vectorized).
template <typename T> inline void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (is_fp8<T>) {
    fp8_row_as_float(src, dst, n);
  } else {
    using bVec = at::vec::Vectorized<T>;
    int64_t i = 0;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(bVec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + fVec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// 2W fp32 values (two vectors) rounded to nearest even as one vector of a 16-bit T. For bf16 on a CPU with
// AVX512-BF16 that is the hardware's vcvtne2ps2bf16, one instruction where at::vec's rounding takes about ten a
// vector: the same results, except that it reads fp32 denormals as zero and quiets NaNs with their payload. RMSNorm
// spent most of its time rounding: [512, 576] bf16 add_rms_norm 73 -> 44-48 us (Xeon with AMX, 2 threads, timed
// alone; torch.add of the same rows 35 us).
template <typename T> inline at::vec::Vectorized<T> narrow_pair(const fVec& lo, const fVec& hi) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);
    return at::vec::Vectorized<T>(reinterpret_cast<const __m512i&>(both));
  }
#endif
  return at::vec::convert_from_float<T>(lo, hi);
}

template <typename T> inline void store_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    constexpr int64_t W = fVec::size();
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) narrow_pair<T>(fVec::loadu(src + i), fVec::loadu(src + i + W)).store(dst + i);
    if (i < n) at::vec::convert(src + i, dst + i, n - i);
  } else {
    at::vec::convert(src, dst, n);
  }
}

inline void scale_row(float* x, float alpha, int64_t n) {
  const fVec a(alpha);
  int64_t i = 0;
  for (; i + fVec::size() <= n; i += fVec::size()) (fVec::loadu(x + i) * a).store(x + i);
  for (; i < n; ++i) x[i] *= alpha;
}

// The larger of two vectors lane by lane with the plain max instruction: NaN is not propagated (at::vec::maximum
// checks for it, several instructions more), so only for values that hold none.
inline fVec max_of(const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_max_ps(a, b);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_max_ps(a, b);
#else
  return at::vec::maximum(a, b);
#endif
}

#if defined(__AVX512F__)  // the instruction set, not torch's capability: cpu_gemm's bf16 kernels use it under either
// 16 bf16 values, as their bits, in fp32 lanes: exact (the bits moved up 16).
inline __m512 bf16_bits_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_bf16_as_float(const void* p) {
  return bf16_bits_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// One cache line fetched ahead of use, into L1 (Level 1) or L2 (Level 2), where the call stands: an asm statement,
// which the compiler keeps in place and in order. GCC moves __builtin_prefetch freely, and prefill attention's
// prefetches, spread between tiles, ran 25-35% slower that way.
template <int Level> inline void prefetch_line(const void* p) {
  static_assert(Level == 1 || Level == 2, "prefetch_line: into L1 or L2");
#if defined(__x86_64__)
  if constexpr (Level == 1) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  __builtin_prefetch(p, 0, Level == 1 ? 3 : 2);
#endif
}

// Whether this is an AMD CPU (cpuid's vendor string "AuthenticAMD"): where a kernel's best choice was measured to
// differ between AMD's cores and Intel's (cpu_gemm's rows_without_prefetch).
inline bool cpu_is_amd() {
#if defined(__x86_64__)
  static const bool amd = [] {
    unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &ebx, 4), std::memcpy(vendor + 4, &edx, 4), std::memcpy(vendor + 8, &ecx, 4);
    return std::strcmp(vendor, "AuthenticAMD") == 0;
  }();
  return amd;
#else
  return false;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX tiles (Intel Sapphire Rapids and later; cpu_gemm's bf16 GEMM, prefill attention's products). Linux lends a
// process the tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), as oneDNN does
// before its own AMX kernels; false where the kernel refuses (the kernels then take their AVX-512 paths).
inline bool amx_ready() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// Tile t as rows[t] rows of 64 bytes (16 fp32 sums, or 32 bf16 values: 16 pairs); 0 rows leaves it unused.
inline void configure_tiles(const int (&rows)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.rows[t] = rows[t], config.bytes_per_row[t] = rows[t] > 0 ? 64 : 0;
  // GCC 12 does not count _tile_loadconfig as reading the struct, and dropped the stores above (a zero config: a
  // fault) until the struct's address escapes here
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#endif

// What multiplies bf16 values in the kernels that can choose (cpu_gemm's bf16 panels, decode attention over a bf16
// cache): AMX tiles where the CPU lends them, else vdpbf16ps on AMD's cores, where it has the FMAs' rate in two
// products' work, and fp32 FMAs on values widened to fp32 on Intel's: on an Intel Xeon with AVX512-BF16 and no AMX
// tiles, one vdpbf16ps took as long as four FMAs (two products a lane against one: half the rate), and the bf16 GEMM
// ran at 140-146 GFLOP/s on vdpbf16ps against 207-262 on FMAs (2 threads, hot shapes).
// ASERVE_BF16_PRODUCTS=amx|dpbf16|fma overrides (amx only where the tiles are lent); gemm_bf16_products reads and
// sets it (tests, A/B runs). One choice for the whole extension: an inline function's static is one object.
enum class Products { kAmx, kDpbf16, kFma };
inline bool amx_tiles() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_ready();
#else
  return false;
#endif
}
inline Products& bf16_products() {
  static Products chosen = [] {
    const char* asked = std::getenv("ASERVE_BF16_PRODUCTS");
    if (asked != nullptr && std::strcmp(asked, "dpbf16") == 0) return Products::kDpbf16;
    if (asked != nullptr && std::strcmp(asked, "fma") == 0) return Products::kFma;
    if (amx_tiles()) return Products::kAmx;
    return cpu_is_amd() ? Products::kDpbf16 : Products::kFma;
  }();
  return chosen;
}

inline float reduce_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
}

}  // namespace aserve_kernels
