// The flat forward's layer loop in C++: torch.classes.aserve.DecoderStack runs a Llama-family decoder stack's layers
// for one step in one call, the ops of models/flat_forward.py's loop in the same order on the same tensors.
//
// Why: a bench-model step is ~16 ops x 30 layers, and from Python each op costs its call (argument parsing, the
// dispatcher, the loop's own bytecode) on top of its work: ~1 ms of a ~8 ms batch-1 decode step (AMD EPYC Zen 5, 2
// threads), time in which no weight is read. Here each op is a call of its kernel through a dispatcher handle found
// once. The result is the Python loop's bit for bit (tests/test_flat_forward.py); the Python loop stays for the
// steps this does not run: LoRA adapters in the step, or a projection that is not one of the kinds below.
//
// A projection is one of the linear kernels the quantization methods bind (LinearMethod.native_projection): dense
// weights packed for aserve's GEMM (gemm_packed) or for oneDNN's (mkldnn::_linear_pointwise, where cpu_gemm.gemm_for
// picks it), int8 tiles (int8_linear up to `kernel_rows` rows, gemm_int8 above) or GPTQ/AWQ int4 tiles (int4_linear
// / gemm_int4, the inputs permuted first for act-order checkpoints).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "step_team.h"

namespace {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

template <class Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// oneDNN's packed linear, called boxed: its schema (mkldnn::_linear_pointwise, registered by torch's CPU build where
// oneDNN is in it) is torch's own, and its C++ signature has changed between releases where the boxed one has not.
// `op` is none where torch has no oneDNN (no projection of that kind is then ever packed); the constant arguments
// (no post-op, no scalars, no algorithm) are made once, not at every call.
struct OneDnnLinear {
  std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""});
  c10::IValue attr{std::string("none")}, scalars{c10::List<std::optional<at::Scalar>>()}, algorithm{std::string("")};

  Tensor operator()(const Tensor& x, const Tensor& weight, const OptTensor& bias) const {
    torch::jit::Stack stack{x, weight, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), attr, scalars, algorithm};
    op->callBoxed(stack);
    return stack[0].toTensor();
  }
};

// The kernels the loop calls, with the signatures their files register. Looked up when a stack is made: at load
// time the other files' registrations may not have run yet.
struct Kernels {
  using Norm = Tensor(const Tensor&, const Tensor&, double);
  using AddNorm = Tensor(const Tensor&, Tensor, const Tensor&, double);
  using Rotary = void(const Tensor&, Tensor, Tensor, const Tensor&, const Tensor&, int64_t);
  using WriteKV = void(const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&, double, double, int64_t, bool);
  using Decode = void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                      int64_t, double, double, double, int64_t);
  using Prefill = void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       double, int64_t, double, double, double, int64_t);
  using Activation = Tensor(const Tensor&, int64_t);  // last: the gate and up blocks' width (0: halves)
  using Gemm = Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t, int64_t);  // last: activation
  using Int8Linear = Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t);
  using GemmInt8 = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t, int64_t);
  using Int4Linear = Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t);
  using GemmInt4 = Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t, int64_t);

  c10::TypedOperatorHandle<Norm> rms_norm = handle<Norm>("aserve::rms_norm");
  c10::TypedOperatorHandle<AddNorm> add_rms_norm = handle<AddNorm>("aserve::add_rms_norm");
  c10::TypedOperatorHandle<Rotary> rotary = handle<Rotary>("aserve::rotary_embedding");
  c10::TypedOperatorHandle<WriteKV> write_kv = handle<WriteKV>("aserve::write_kv");
  c10::TypedOperatorHandle<Decode> decode = handle<Decode>("aserve::paged_decode_attention");
  c10::TypedOperatorHandle<Prefill> prefill = handle<Prefill>("aserve::paged_prefill_attention");
  c10::TypedOperatorHandle<Activation> silu_and_mul = handle<Activation>("aserve::silu_and_mul");
  c10::TypedOperatorHandle<Gemm> gemm = handle<Gemm>("aserve::gemm_packed");
  c10::TypedOperatorHandle<Int8Linear> int8_linear = handle<Int8Linear>("aserve::int8_linear");
  c10::TypedOperatorHandle<GemmInt8> gemm_int8 = handle<GemmInt8>("aserve::gemm_int8");
  c10::TypedOperatorHandle<Int4Linear> int4_linear = handle<Int4Linear>("aserve::int4_linear");
  c10::TypedOperatorHandle<GemmInt4> gemm_int4 = handle<GemmInt4>("aserve::gemm_int4");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> greedy_rows = handle<Tensor(const Tensor&)>("aserve::greedy_rows");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> argmax_rows = handle<Tensor(const Tensor&)>("aserve::argmax_rows");
  c10::TypedOperatorHandle<int64_t(const Tensor&)> count_nonfinite_rows =
      handle<int64_t(const Tensor&)>("aserve::count_nonfinite_rows");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)> sample_inverse_cdf =
      handle<Tensor(const Tensor&, const Tensor&)>("aserve::sample_inverse_cdf");
  OneDnnLinear onednn_linear;
};

enum Kind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2, kOneDnn = 3 };
constexpr int64_t kSiluMul = 3;  // gemm_packed's SiLU-and-mul epilogue (cpu_gemm.cpp's Activation)
constexpr int64_t kGateBlock = 16;  // int8 and int4 gate | up tiles: 16 gates, then their 16 ups (quantization)

// x [rows, in] -> x W^T + b, as the method's Python projection computes it (quantization/*.py). `activation`:
// kSiluMul for a gate | up weight packed for the GEMM's SwiGLU epilogue, dense, int8 or int4 (the projection then
// gives silu(gate) * up, [rows, out / 2]; the int8 and int4 row kernels give the product, its gates and ups in
// alternate blocks of 16, which silu_and_mul then combines), else 0.
struct Projection {
  int64_t kind, out_features, group, kernel_rows, activation;
  Tensor weight, scales, perm;  // scales: int8's per-channel scales or int4's scales and zeros; perm: act-order
  OptTensor bias;

  Tensor operator()(const Kernels& k, const Tensor& x) const {
    switch (kind) {
      case kDense:
        return k.gemm.call(x, weight, bias, out_features, activation);
      case kOneDnn:
        return k.onednn_linear(x, weight, bias);
      case kInt8:
        if (x.size(0) <= kernel_rows) {
          const Tensor out = with_bias(k.int8_linear.call(x.contiguous(), weight, scales, out_features));
          return activation == kSiluMul ? k.silu_and_mul.call(out, kGateBlock) : out;
        }
        return k.gemm_int8.call(x, weight, scales, bias, out_features, activation);
      default: {
        const Tensor in = perm.defined() ? x.index_select(1, perm) : x;
        if (in.size(0) <= kernel_rows) {
          const Tensor out = with_bias(k.int4_linear.call(in.contiguous(), weight, scales, group, out_features));
          return activation == kSiluMul ? k.silu_and_mul.call(out, kGateBlock) : out;
        }
        return k.gemm_int4.call(in, weight, scales, group, bias, out_features, activation);
      }
    }
  }

  Tensor with_bias(Tensor out) const { return bias.has_value() ? out.add_(*bias) : out; }
};

// One pre-norm layer: x + attn(norm_in(x)), then + the SwiGLU MLP of norm_post(.) (flat_forward.FlatLayer).
struct Layer {
  Tensor norm_in, q_norm, k_norm, norm_post;  // q_norm, k_norm: Qwen3's per-head norms, else undefined
  double eps_in, q_eps, k_eps, eps_post;
  int64_t qkv, o, gate_up, down;  // indexes of the stack's projections
  int64_t q_size, kv_size, heads, kv_heads, head_dim, window;
  double scale, k_scale, v_scale;
};

struct DecoderStack : torch::CustomClassHolder {
  Kernels kernels;
  Tensor cos, sin;
  int64_t rotary_dim;
  std::vector<Projection> projections;
  std::vector<Layer> layers;
  std::vector<Tensor> caches;  // layer i's keys at 2i, values at 2i + 1
  int64_t kv_format = 0;       // the caches' storage: 0 the model's dtype, else an FP8 format's code (kv_quant)
  // Steps of up to this many rows run their layers as one StepTeam (step_team.h): the kernels' parallel regions of a
  // small step are short enough for their start and end to show. Not with a oneDNN projection, whose own OpenMP
  // regions would run on one thread inside the team's.
  int64_t team_rows = 8;
  bool uses_onednn = false;
  int64_t team_steps = 0;  // steps run as a team (fewer than asked where there is one thread, or threads than CPUs;
                           // decode_steps counts each of its steps)

  DecoderStack(Tensor cos, Tensor sin, int64_t rotary_dim)
      : cos(std::move(cos)), sin(std::move(sin)), rotary_dim(rotary_dim) {}

  int64_t add_projection(int64_t kind, Tensor weight, OptTensor scales, OptTensor bias, OptTensor perm, int64_t group,
                         int64_t out_features, int64_t kernel_rows, int64_t activation) {
    TORCH_CHECK(kind >= kDense && kind <= kOneDnn, "DecoderStack: unknown projection kind ", kind);
    TORCH_CHECK(activation == 0 || (activation == kSiluMul && kind != kOneDnn),
                "DecoderStack: only a dense, int8 or int4 projection applies an activation (SiLU and mul)");
    TORCH_CHECK(kind != kOneDnn || kernels.onednn_linear.op.has_value(), "DecoderStack: torch has no oneDNN here");
    TORCH_CHECK(kind == kDense || kind == kOneDnn || scales.has_value(),
                "DecoderStack: int8 and int4 projections need their scales");
    uses_onednn = uses_onednn || kind == kOneDnn;
    projections.push_back({kind, out_features, group, kernel_rows, activation, std::move(weight),
                           scales.value_or(Tensor()), perm.value_or(Tensor()), std::move(bias)});
    return static_cast<int64_t>(projections.size()) - 1;
  }

  void add_layer(Tensor norm_in, double eps_in, int64_t qkv, int64_t q_size, int64_t kv_size, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, double scale, int64_t window, double k_scale, double v_scale,
                 OptTensor q_norm, double q_eps, OptTensor k_norm, double k_eps, int64_t o, Tensor norm_post,
                 double eps_post, int64_t gate_up, int64_t down) {
    const auto count = static_cast<int64_t>(projections.size());
    for (int64_t p : {qkv, o, gate_up, down}) TORCH_CHECK(p >= 0 && p < count, "DecoderStack: no projection ", p);
    for (int64_t p : {qkv, o, down})
      TORCH_CHECK(projections[p].activation == 0, "DecoderStack: only gate_up may apply SiLU and mul");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecoderStack: q_norm and k_norm come together");
    layers.push_back({std::move(norm_in), q_norm.value_or(Tensor()), k_norm.value_or(Tensor()), std::move(norm_post),
                      eps_in, q_eps, k_eps, eps_post, qkv, o, gate_up, down, q_size, kv_size, heads, kv_heads,
                      head_dim, window, scale, k_scale, v_scale});
  }

  void set_caches(std::vector<Tensor> flat) {
    TORCH_CHECK(flat.size() == 2 * layers.size(), "DecoderStack: a key and a value cache per layer");
    caches = std::move(flat);
  }

  // An FP8 cache: its format's code and every layer's key and value scales (k0, v0, k1, v1, ...), as they stand
  // once each layer has them (a layer may estimate its own from its first batch, after the stack was built).
  void set_kv_format(int64_t format, std::vector<double> scales) {
    TORCH_CHECK(scales.size() == 2 * layers.size(), "DecoderStack: a key and a value scale per layer");
    for (size_t i = 0; i < layers.size(); ++i) layers[i].k_scale = scales[2 * i], layers[i].v_scale = scales[2 * i + 1];
    kv_format = format;
  }

  void set_team_rows(int64_t rows) { team_rows = rows; }
  int64_t get_team_rows() const { return team_rows; }
  int64_t get_team_steps() const { return team_steps; }

  // The layers over a step's rows (decode rows first, then prefill chunks): (the last layer's output, the running
  // sum), as flat_forward.FlatForward runs them. `residual` undefined at the first stage.
  std::tuple<Tensor, Tensor> forward(Tensor x, OptTensor residual_in, Tensor positions, Tensor slots,
                                     int64_t num_decode, OptTensor decode_tables, OptTensor decode_context,
                                     OptTensor prefill_tables, OptTensor prefill_starts, OptTensor prefill_contexts) {
    TORCH_CHECK(caches.size() == 2 * layers.size(), "DecoderStack: set_caches first");
    TORCH_CHECK(num_decode == 0 || (decode_tables.has_value() && decode_context.has_value()),
                "DecoderStack: decode rows need their block tables and context lengths");
    Tensor residual = residual_in.value_or(Tensor());
    const auto run = [&] {
      run_layers(x, residual, positions, slots, num_decode, decode_tables, decode_context, prefill_tables,
                 prefill_starts, prefill_contexts);
    };
    if (x.size(0) <= team_rows && !uses_onednn)
      team_steps += aserve_kernels::StepTeam::run(run);
    else
      run();
    return {x, residual};
  }

  // The model's last norm and its logits projection (an index of the stack's projections), and the token
  // embedding: what decode_steps needs beyond the layers.
  void set_head(Tensor embed, Tensor norm, double eps, int64_t projection) {
    TORCH_CHECK(projection >= 0 && projection < static_cast<int64_t>(projections.size()) &&
                    projections[projection].activation == 0,
                "DecoderStack: no plain projection ", projection, " for the head");
    TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(),
                "DecoderStack: the embedding must be contiguous [vocab, hidden]");
    head_embed = std::move(embed), head_norm = std::move(norm), head_eps = eps, head = projection;
  }

  // Decode steps of a batch of decode rows, all of them in this one call: the tokens [rows] embedded, the layers,
  // the last norm, the logits and the next tokens, each step's the next one's input. Greedy (no `uniforms`): the
  // argmax, sampling.cpp's greedy_rows. Drawn: `uniforms` [steps, drawn rows] (the sampler's draws for each step,
  // in its order), the drawn rows' logits divided by `temperatures` [drawn rows] where given (widened to fp32
  // first, as the sampler does where a temperature is not 1), then sample_inverse_cdf; `drawn` [drawn rows]: the
  // rows drawn where some are greedy (their argmax, argmax_rows), every row where undefined. positions, slots and
  // context lengths are [steps, rows] (step i's in row i), the block tables [rows, width] hold every step's blocks.
  // The kernels are the ones a step through FlatForward, the model's compute_logits and the sampler call, on the
  // same tensors, so the tokens are theirs. Returns [steps, rows]: the steps run, then -1s. The steps end at the
  // first one with a row the sampler would find unusable (greedy: its -1; drawn: any logit not finite, and that
  // step is all -1s); the caller runs that step again the usual way, whose sampler then reports the row's error.
  //
  // Why: at batch 1 with 8 steps a scheduling, each step's Python around the layers (the stack's call, the last
  // norm, the head's call, the sampler, the metadata) was ~0.2 ms of a ~2.1 ms GPTQ token (AMD EPYC Zen 5), and
  // the head ran outside the step team, its threads woken from OpenMP's pool every step.
  Tensor decode_steps(Tensor tokens, Tensor positions, Tensor slots, Tensor tables, Tensor contexts,
                      OptTensor uniforms, OptTensor temperatures, OptTensor drawn) {
    TORCH_CHECK(caches.size() == 2 * layers.size(), "DecoderStack: set_caches first");
    TORCH_CHECK(head >= 0, "DecoderStack: set_head first");
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "DecoderStack: tokens must be int64 [rows]");
    const int64_t rows = tokens.size(0), steps = positions.size(0);
    for (const Tensor* t : {&positions, &slots, &contexts})
      TORCH_CHECK(t->dim() == 2 && t->size(0) == steps && t->size(1) == rows && t->scalar_type() == at::kLong,
                  "DecoderStack: positions, slots and context lengths must be int64 [steps, rows]");
    const int64_t draws = drawn.has_value() ? drawn->size(0) : rows;
    TORCH_CHECK(!drawn.has_value() ||
                    (uniforms.has_value() && drawn->dim() == 1 && drawn->scalar_type() == at::kLong),
                "DecoderStack: the drawn rows are int64 [drawn rows], with uniforms");
    TORCH_CHECK(!uniforms.has_value() || (uniforms->dim() == 2 && uniforms->size(0) == steps &&
                                          uniforms->size(1) == draws && uniforms->scalar_type() == at::kFloat),
                "DecoderStack: uniforms must be float32 [steps, drawn rows]");
    TORCH_CHECK(!temperatures.has_value() || (uniforms.has_value() && temperatures->dim() == 1 &&
                                              temperatures->size(0) == draws),
                "DecoderStack: temperatures [drawn rows] go with uniforms");
    Tensor out = at::full({steps, rows}, -1, tokens.options());
    int64_t ran = 0;
    const auto run = [&] {
      Tensor input = tokens;
      for (int64_t i = 0; i < steps; ++i, ++ran) {
        Tensor x = embed_rows(input), residual;
        const OptTensor context = contexts[i];
        run_layers(x, residual, positions[i], slots[i], rows, tables, context, {}, {}, {});
        const Tensor normed = kernels.add_rms_norm.call(x, residual, head_norm, head_eps);
        const Tensor logits = projections[head](kernels, normed);
        Tensor next;
        if (!uniforms.has_value()) {
          next = kernels.greedy_rows.call(logits);
        } else {
          if (kernels.count_nonfinite_rows.call(logits) > 0) break;
          const Tensor sub = drawn.has_value() ? logits.index_select(0, *drawn) : logits;
          const Tensor sampled = kernels.sample_inverse_cdf.call(
              temperatures.has_value() ? sub.to(at::kFloat).div(temperatures->unsqueeze(1)) : sub, (*uniforms)[i]);
          if (drawn.has_value()) {
            next = kernels.argmax_rows.call(logits);
            next.index_copy_(0, *drawn, sampled);
          } else {
            next = sampled;
          }
        }
        std::copy_n(next.data_ptr<int64_t>(), rows, out.data_ptr<int64_t>() + i * rows);
        const int64_t* picked = next.data_ptr<int64_t>();
        if (std::any_of(picked, picked + rows, [](int64_t t) { return t < 0; })) break;
        input = next;
      }
    };
    if (rows > team_rows || uses_onednn)
      run();
    else if (aserve_kernels::StepTeam::run(run))
      team_steps += ran;
    return out;
  }

 private:
  Tensor head_embed, head_norm;
  double head_eps = 0;
  int64_t head = -1;

  // The embedding's rows of `tokens`, as nn.functional.embedding gives them. at::index_select took ~11 us a step
  // inside the team against ~4 like this, and out[i].copy_ of a step's tokens ~8 us against ~0.6 for decode_steps'
  // std::copy_n (TSC timers, GPTQ batch 1, AMD EPYC Zen 5; since removed).
  Tensor embed_rows(const Tensor& tokens) const {
    const int64_t rows = tokens.size(0), vocab = head_embed.size(0);
    const int64_t width = head_embed.size(1) * head_embed.element_size();
    Tensor x = at::empty({rows, head_embed.size(1)}, head_embed.options());
    const int64_t* ids = tokens.data_ptr<int64_t>();
    const char* table = static_cast<const char*>(head_embed.data_ptr());
    char* to = static_cast<char*>(x.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(ids[r] >= 0 && ids[r] < vocab, "DecoderStack: token ", ids[r], " is outside the embedding");
      std::memcpy(to + r * width, table + ids[r] * width, width);
    }
    return x;
  }

  void run_layers(Tensor& x, Tensor& residual, const Tensor& positions, const Tensor& slots, int64_t num_decode,
                  const OptTensor& decode_tables, const OptTensor& decode_context, const OptTensor& prefill_tables,
                  const OptTensor& prefill_starts, const OptTensor& prefill_contexts) {
    const bool prefill = prefill_tables.has_value() && prefill_starts.has_value() && prefill_contexts.has_value();
    const Kernels& k = kernels;
    const int64_t T = x.size(0);
    // Attention's output, made once and written by every layer of its shape: only that layer's o projection reads it.
    Tensor attended;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      const Tensor &k_cache = caches[2 * i], &v_cache = caches[2 * i + 1];
      if (!residual.defined()) {
        residual = x;
        x = k.rms_norm.call(x, L.norm_in, L.eps_in);
      } else {
        x = k.add_rms_norm.call(x, residual, L.norm_in, L.eps_in);
      }
      const Tensor qkv = projections[L.qkv](k, x);
      // q, k and v as views of qkv's row parts: three tensors made where a split and its views made six, ~0.9 us
      // a layer against ~2.1 at batch 1 (Intel Xeon, avx512_bf16, no AMX; TSC timers in the loop, since removed)
      TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "DecoderStack: a qkv projection gave no [rows, out] rows");
      const int64_t row = qkv.stride(0), at = qkv.storage_offset();
      Tensor q = qkv.as_strided({T, L.heads, L.head_dim}, {row, L.head_dim, 1}, at);
      Tensor key = qkv.as_strided({T, L.kv_heads, L.head_dim}, {row, L.head_dim, 1}, at + L.q_size);
      const Tensor value =
          qkv.as_strided({T, L.kv_heads, L.head_dim}, {row, L.head_dim, 1}, at + L.q_size + L.kv_size);
      if (L.q_norm.defined()) {
        q = k.rms_norm.call(q.reshape({-1, L.head_dim}), L.q_norm, L.q_eps).view({T, L.heads, L.head_dim});
        key = k.rms_norm.call(key.reshape({-1, L.head_dim}), L.k_norm, L.k_eps).view({T, L.kv_heads, L.head_dim});
      }
      k.rotary.call(positions, q, key, cos, sin, rotary_dim);
      k.write_kv.call(key, value, k_cache, v_cache, slots, L.k_scale, L.v_scale, kv_format, true);  // paired keys
      if (!attended.defined() || attended.size(1) != L.heads || attended.size(2) != L.head_dim)
        attended = at::empty({T, L.heads, L.head_dim}, x.options());
      Tensor out = attended;
      if (num_decode == T)  // a decode-only step: the whole tensors, not slices of them
        k.decode.call(out, q, k_cache, v_cache, *decode_tables, *decode_context, L.scale, L.window, 0.0, L.k_scale,
                      L.v_scale, kv_format);
      else if (num_decode > 0)
        k.decode.call(out.slice(0, 0, num_decode), q.slice(0, 0, num_decode), k_cache, v_cache, *decode_tables,
                      *decode_context, L.scale, L.window, 0.0, L.k_scale, L.v_scale, kv_format);
      if (prefill)
        k.prefill.call(out.slice(0, num_decode), q.slice(0, num_decode), k_cache, v_cache, *prefill_tables,
                       *prefill_starts, *prefill_contexts, L.scale, L.window, 0.0, L.k_scale, L.v_scale,
                       kv_format);
      out = out.view({T, L.heads * L.head_dim});
      x = k.add_rms_norm.call(projections[L.o](k, out), residual, L.norm_post, L.eps_post);
      const Projection& gate_up = projections[L.gate_up];  // silu(gate) * up in its GEMM's epilogue, or after it
      const Tensor act = gate_up.activation == kSiluMul ? gate_up(k, x) : k.silu_and_mul.call(gate_up(k, x), 0);
      x = projections[L.down](k, act);
    }
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<Tensor, Tensor, int64_t>())
      .def("add_projection", &DecoderStack::add_projection)
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_caches", &DecoderStack::set_caches)
      .def("set_kv_format", &DecoderStack::set_kv_format)
      .def("set_team_rows", &DecoderStack::set_team_rows)
      .def("team_rows", &DecoderStack::get_team_rows)
      .def("team_steps", &DecoderStack::get_team_steps)
      .def("forward", &DecoderStack::forward)
      .def("set_head", &DecoderStack::set_head)
      .def("decode_steps", &DecoderStack::decode_steps);
}
