// Baton's CPU kernels as torch operators (namespace "baton").
//
// The C kernels (*.c beside this file) are compiled once per CPU kind, each
// with its own instruction-set flags and a _<kind> suffix on every name, and
// linked with this file into one library. Each operator takes the kind to run
// as its last argument (the execution plan's choice, backends/execution.py),
// checks that this CPU can run it, checks dtypes, shapes and devices, and
// calls that kind's kernel. Registered through TORCH_LIBRARY, the operators
// go through torch's dispatcher: the profiler records them by name, and
// torch.compile treats them as opaque calls (their fake implementations are
// registered in Python, backends/kernels/__init__.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>


#include <cmath>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <cstdint>
#include <optional>
#include <tuple>

extern "C" {
#define BATON_DECLARE(kind)                                                                  \
  int baton_rms_norm_f32_##kind(float*, const float*, const float*, float*, int64_t, int64_t, \
                                float, int);                                                 \
  int baton_rms_norm_bf16_##kind(uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,     \
                                 int64_t, int64_t, float, int);                              \
  int baton_silu_mul_f32_##kind(const float*, float*, int64_t, int64_t, int);               \
  int baton_silu_mul_bf16_##kind(const uint16_t*, uint16_t*, int64_t, int64_t, int);        \
  int baton_qkv_rope_store_f32_##kind(const float*, int64_t, int64_t, int64_t, int64_t,     \
                                      const int64_t*, const float*, const float*,           \
                                      const float*, const float*, float, const int64_t*,    \
                                      void*, void*, int, float*, int);                      \
  int baton_qkv_rope_store_bf16_##kind(const uint16_t*, int64_t, int64_t, int64_t, int64_t, \
                                       const int64_t*, const uint16_t*, const uint16_t*,    \
                                       const uint16_t*, const uint16_t*, float,             \
                                       const int64_t*, void*, void*, int, uint16_t*, int);  \
  int baton_paged_decode_attention_f32_##kind(const float*, const void*, const void*, int,  \
                                              const int64_t*, const int64_t*, float*,       \
                                              float*, int64_t, int64_t, int64_t, int64_t, int64_t,  \
                                              int64_t, int64_t, float, int);                \
  int baton_paged_decode_attention_bf16_##kind(const uint16_t*, const void*, const void*,   \
                                               int, const int64_t*, const int64_t*,         \
                                               uint16_t*, float*, int64_t, int64_t, int64_t,        \
                                               int64_t, int64_t, int64_t, int64_t, float,   \
                                               int);                                        \
  int baton_gemv_bf16_##kind(const float*, const uint16_t*, const float*, float*, int64_t,  \
                             int64_t, int64_t, int);                                        \
  int baton_gemv_bf16_act16_##kind(const uint16_t*, const uint16_t*, const uint16_t*,       \
                                   uint16_t*, int64_t, int64_t, int64_t, int);              \
  int baton_gemv_bf16_max_rows_##kind(void);                                                 \
  int baton_amx_bf16_ready_##kind(void);                                                     \
  int baton_linear_amx_bf16_##kind(const uint16_t*, const uint16_t*, const uint16_t*,       \
                                   uint16_t*, int64_t, int64_t, int64_t, int);              \
  int baton_attention_amx_##kind(int);                                                       \
  int baton_int4_linear_##kind(const float*, const uint8_t*, const float*, const float*,      \
                               const float*, float*, int64_t, int64_t, int64_t, int64_t, int);\
  int baton_int4_decode_##kind(const uint8_t*, const float*, const float*, float*, int64_t,   \
                               int64_t, int64_t, int);                                       \
  int baton_int4_linear_q8_##kind(const float*, const uint8_t*, const void*, const void*, int,\
                                  const float*, float*, int64_t, int64_t, int64_t, int64_t, int);\
  int baton_int8_linear_q8_##kind(const float*, const int8_t*, const void*, int, const float*, \
                                  float*, int64_t, int64_t, int64_t, int);                    \
  int baton_kernels_avx2_##kind(void);
BATON_DECLARE(portable)
BATON_DECLARE(avx2)
BATON_DECLARE(avx512)
BATON_DECLARE(avx512_bf16)
}

namespace {

// Kinds in the order of backends.execution.CPU_KINDS.
constexpr int kNumKinds = 4;
const char* const kKindNames[kNumKinds] = {"portable", "avx2", "avx512", "avx512_bf16"};

// The library holds the kinds it was built for (backends/kernels: those the
// building CPU runs, or all with BATON_KERNEL_KINDS=all), each announced by
// -DBATON_HAS_<KIND>; a kind it lacks has no entries and is refused.
#ifdef BATON_HAS_AVX2
#define BATON_AVX2(fn) fn##_avx2
constexpr bool kHasAvx2 = true;
#else
#define BATON_AVX2(fn) nullptr
constexpr bool kHasAvx2 = false;
#endif
#ifdef BATON_HAS_AVX512
#define BATON_AVX512(fn) fn##_avx512
constexpr bool kHasAvx512 = true;
#else
#define BATON_AVX512(fn) nullptr
constexpr bool kHasAvx512 = false;
#endif
#ifdef BATON_HAS_AVX512_BF16
#define BATON_AVX512_BF16(fn) fn##_avx512_bf16
constexpr bool kHasAvx512Bf16 = true;
#else
#define BATON_AVX512_BF16(fn) nullptr
constexpr bool kHasAvx512Bf16 = false;
#endif
#define BATON_TABLE(fn) {fn##_portable, BATON_AVX2(fn), BATON_AVX512(fn), BATON_AVX512_BF16(fn)}
constexpr bool kind_built[] = {true, kHasAvx2, kHasAvx512, kHasAvx512Bf16};
decltype(&baton_rms_norm_f32_portable) const rms_norm_f32[] = BATON_TABLE(baton_rms_norm_f32);
decltype(&baton_rms_norm_bf16_portable) const rms_norm_bf16[] =
    BATON_TABLE(baton_rms_norm_bf16);
decltype(&baton_silu_mul_f32_portable) const silu_mul_f32[] = BATON_TABLE(baton_silu_mul_f32);
decltype(&baton_silu_mul_bf16_portable) const silu_mul_bf16[] =
    BATON_TABLE(baton_silu_mul_bf16);
decltype(&baton_qkv_rope_store_f32_portable) const qkv_f32[] =
    BATON_TABLE(baton_qkv_rope_store_f32);
decltype(&baton_qkv_rope_store_bf16_portable) const qkv_bf16[] =
    BATON_TABLE(baton_qkv_rope_store_bf16);
decltype(&baton_paged_decode_attention_f32_portable) const attention_f32[] =
    BATON_TABLE(baton_paged_decode_attention_f32);
decltype(&baton_paged_decode_attention_bf16_portable) const attention_bf16[] =
    BATON_TABLE(baton_paged_decode_attention_bf16);
decltype(&baton_gemv_bf16_portable) const gemv_bf16[] = BATON_TABLE(baton_gemv_bf16);
decltype(&baton_gemv_bf16_act16_portable) const gemv_bf16_act16[] =
    BATON_TABLE(baton_gemv_bf16_act16);
decltype(&baton_gemv_bf16_max_rows_portable) const gemv_max_rows[] =
    BATON_TABLE(baton_gemv_bf16_max_rows);

decltype(&baton_amx_bf16_ready_portable) const amx_ready_fn[] =
    BATON_TABLE(baton_amx_bf16_ready);
decltype(&baton_attention_amx_portable) const attention_amx_fn[] =
    BATON_TABLE(baton_attention_amx);
decltype(&baton_kernels_avx2_portable) const kernels_avx2_fn[] = BATON_TABLE(baton_kernels_avx2);
decltype(&baton_linear_amx_bf16_portable) const linear_amx_fn[] =
    BATON_TABLE(baton_linear_amx_bf16);
decltype(&baton_int4_linear_portable) const int4_linear_fn[] = BATON_TABLE(baton_int4_linear);
decltype(&baton_int4_decode_portable) const int4_decode_fn[] = BATON_TABLE(baton_int4_decode);
decltype(&baton_int4_linear_q8_portable) const int4_linear_q8_fn[] =
    BATON_TABLE(baton_int4_linear_q8);
decltype(&baton_int8_linear_q8_portable) const int8_linear_q8_fn[] =
    BATON_TABLE(baton_int8_linear_q8);

bool cpu_runs(int kind) {
#if !(defined(__x86_64__) || defined(__i386__))
  return kind == 0;
#endif
  switch (kind) {
    case 0: return true;
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 2: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   cpu_runs(1);
    case 3: return cpu_runs(2) && __builtin_cpu_supports("avx512bf16");
    default: return false;
  }
}

int check_kind(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind < kNumKinds, "baton: unknown CPU kind ", kind);
  static const bool runs[kNumKinds] = {cpu_runs(0), cpu_runs(1) && kind_built[1],
                                       cpu_runs(2) && kind_built[2],
                                       cpu_runs(3) && kind_built[3]};
  TORCH_CHECK(runs[kind], "baton: this CPU cannot run the ", kKindNames[kind], " kernels");
  return static_cast<int>(kind);
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "baton: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "baton: ", name, " must be contiguous");
}

void check_act(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "baton: ",
              name, " must be float32 or bfloat16, got ", t.scalar_type());
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "baton: ", name, " must be ",
              ref.scalar_type(), ", got ", t.scalar_type());
}

void check_long(const at::Tensor& t, const char* name, int64_t numel) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, "baton: ", name, " must be int64");
  TORCH_CHECK(t.numel() == numel, "baton: ", name, " must hold ", numel, " values, got ",
              t.numel());
}

int kv_bf16(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t kvh, int64_t d) {
  check_cpu(k_cache, "k_cache");
  check_like(v_cache, k_cache, "v_cache");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
              "baton: the KV cache must be float32 or bfloat16");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == kvh && k_cache.size(2) == d &&
                  v_cache.sizes() == k_cache.sizes(),
              "baton: the KV caches must be [slots, ", kvh, ", ", d, "]");
  return k_cache.scalar_type() == at::kBFloat16;
}

int threads() { return at::get_num_threads(); }

void check_rc(int rc, const char* what) {
  TORCH_CHECK(rc == 0, "baton: ", what, " kernel failed (code ", rc, ")");
}

at::Tensor rms_norm(at::Tensor residual, const std::optional<at::Tensor>& delta,
                    const at::Tensor& weight, double eps, int64_t kind) {
  const int k = check_kind(kind);
  check_act(residual, "residual");
  TORCH_CHECK(residual.dim() == 2, "baton: rms_norm takes [tokens, hidden]");
  const int64_t t = residual.size(0), n = residual.size(1);
  check_like(weight, residual, "weight");
  TORCH_CHECK(weight.numel() == n, "baton: rms_norm weight must hold ", n, " values");
  if (delta) {
    check_like(*delta, residual, "delta");
    TORCH_CHECK(delta->sizes() == residual.sizes(), "baton: delta must match the residual");
  }
  at::Tensor out = at::empty_like(residual);
  int rc;
  if (residual.scalar_type() == at::kFloat)
    rc = rms_norm_f32[k](residual.data_ptr<float>(),
                         delta ? delta->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                         out.data_ptr<float>(), t, n, static_cast<float>(eps), threads());
  else
    rc = rms_norm_bf16[k](static_cast<uint16_t*>(residual.data_ptr()),
                          delta ? static_cast<const uint16_t*>(delta->data_ptr()) : nullptr,
                          static_cast<const uint16_t*>(weight.data_ptr()),
                          static_cast<uint16_t*>(out.data_ptr()), t, n,
                          static_cast<float>(eps), threads());
  check_rc(rc, "rms_norm");
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t kind) {
  const int k = check_kind(kind);
  check_act(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "baton: silu_mul takes [tokens, 2 * intermediate]");
  const int64_t t = gate_up.size(0), i = gate_up.size(1) / 2;
  at::Tensor out = at::empty({t, i}, gate_up.options());
  int rc;
  if (gate_up.scalar_type() == at::kFloat)
    rc = silu_mul_f32[k](gate_up.data_ptr<float>(), out.data_ptr<float>(), t, i, threads());
  else
    rc = silu_mul_bf16[k](static_cast<const uint16_t*>(gate_up.data_ptr()),
                          static_cast<uint16_t*>(out.data_ptr()), t, i, threads());
  check_rc(rc, "silu_mul");
  return out;
}

at::Tensor qkv_rope_store(const at::Tensor& qkv, int64_t h, int64_t kvh, int64_t d,
                          const at::Tensor& positions, const at::Tensor& cos_table,
                          const at::Tensor& sin_table, const std::optional<at::Tensor>& q_norm,
                          const std::optional<at::Tensor>& k_norm, double eps,
                          const at::Tensor& slot_mapping, at::Tensor k_cache,
                          at::Tensor v_cache, int64_t kind) {
  const int k = check_kind(kind);
  check_act(qkv, "qkv");
  TORCH_CHECK(d <= 1024 && d % 2 == 0, "baton: head_dim must be even and at most 1024");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (h + 2 * kvh) * d,
              "baton: qkv must be [tokens, ", (h + 2 * kvh) * d, "]");
  const int64_t t = qkv.size(0);
  check_long(positions, "positions", t);
  check_long(slot_mapping, "slot_mapping", t);
  check_like(cos_table, qkv, "cos_table");
  check_like(sin_table, qkv, "sin_table");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == d &&
                  sin_table.sizes() == cos_table.sizes(),
              "baton: rotary tables must be [positions, ", d, "]");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "baton: q_norm and k_norm go together");
  if (q_norm) {
    check_like(*q_norm, qkv, "q_norm");
    check_like(*k_norm, qkv, "k_norm");
    TORCH_CHECK(q_norm->numel() == d && k_norm->numel() == d, "baton: q/k norms hold head_dim");
  }
  const int bf16_kv = kv_bf16(k_cache, v_cache, kvh, d);
  at::Tensor q = at::empty({t, h, d}, qkv.options());
  int rc;
  if (qkv.scalar_type() == at::kFloat)
    rc = qkv_f32[k](qkv.data_ptr<float>(), t, h, kvh, d, positions.data_ptr<int64_t>(),
                    cos_table.data_ptr<float>(), sin_table.data_ptr<float>(),
                    q_norm ? q_norm->data_ptr<float>() : nullptr,
                    k_norm ? k_norm->data_ptr<float>() : nullptr, static_cast<float>(eps),
                    slot_mapping.data_ptr<int64_t>(), k_cache.data_ptr(), v_cache.data_ptr(),
                    bf16_kv, q.data_ptr<float>(), threads());
  else
    rc = qkv_bf16[k](static_cast<const uint16_t*>(qkv.data_ptr()), t, h, kvh, d,
                     positions.data_ptr<int64_t>(),
                     static_cast<const uint16_t*>(cos_table.data_ptr()),
                     static_cast<const uint16_t*>(sin_table.data_ptr()),
                     q_norm ? static_cast<const uint16_t*>(q_norm->data_ptr()) : nullptr,
                     k_norm ? static_cast<const uint16_t*>(k_norm->data_ptr()) : nullptr,
                     static_cast<float>(eps), slot_mapping.data_ptr<int64_t>(),
                     k_cache.data_ptr(), v_cache.data_ptr(), bf16_kv,
                     static_cast<uint16_t*>(q.data_ptr()), threads());
  check_rc(rc, "qkv_rope_store");
  return q;
}

// lse: a [tokens, heads] float32 tensor for each head's log-sum-exp, or none.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t max_seq_len, int64_t block_size,
                            double scale, int64_t kind, float* lse) {
  const int k = check_kind(kind);
  check_act(q, "q");
  TORCH_CHECK(q.dim() == 3, "baton: q must be [tokens, heads, head_dim]");
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t kvh = k_cache.dim() == 3 ? k_cache.size(1) : 0;
  TORCH_CHECK(kvh >= 1 && h % kvh == 0, "baton: heads must be a multiple of kv heads");
  const int bf16_kv = kv_bf16(k_cache, v_cache, kvh, d);
  check_cpu(block_tables, "block_tables");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == t,
              "baton: block_tables must be int64 [tokens, blocks]");
  check_long(seq_lens, "seq_lens", t);
  TORCH_CHECK(block_size >= 1 && block_tables.size(1) * block_size >= max_seq_len,
              "baton: block tables too short for max_seq_len");
  TORCH_CHECK(k_cache.size(0) % block_size == 0, "baton: cache slots not whole blocks");
  at::Tensor out = at::empty_like(q);
  int rc;
  if (q.scalar_type() == at::kFloat)
    rc = attention_f32[k](q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), bf16_kv,
                          block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                          out.data_ptr<float>(), lse, t, h, kvh, d, block_tables.size(1),
                          block_size, max_seq_len, static_cast<float>(scale), threads());
  else
    rc = attention_bf16[k](static_cast<const uint16_t*>(q.data_ptr()), k_cache.data_ptr(),
                           v_cache.data_ptr(), bf16_kv, block_tables.data_ptr<int64_t>(),
                           seq_lens.data_ptr<int64_t>(), static_cast<uint16_t*>(out.data_ptr()),
                           lse, t, h, kvh, d, block_tables.size(1), block_size, max_seq_len,
                           static_cast<float>(scale), threads());
  check_rc(rc, "paged_decode_attention");
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, int64_t max_seq_len,
                                  int64_t block_size, double scale, int64_t kind) {
  return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, block_size,
                          scale, kind, nullptr);
}

// The same attention, with each (row, head)'s log-sum-exp of its scaled
// scores (float32 [tokens, heads]): what merges it with attention over
// other positions (cascade attention over a shared prefix).
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_lse(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t max_seq_len,
    int64_t block_size, double scale, int64_t kind) {
  TORCH_CHECK(q.dim() == 3, "baton: q must be [tokens, heads, head_dim]");
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  at::Tensor out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len,
                                    block_size, scale, kind, lse.data_ptr<float>());
  return {out, lse};
}

// The gemv's tiled bf16 weights of a [out_features, kk] matrix (kernels.h:
// blocks of 16 rows by 32 columns; at least out_features rows when
// any_extra_tiles, else exactly the blocks out_features needs) and an
// optional bias like x.
void check_tiled_weights(const at::Tensor& w_tiled, int64_t out_features, int64_t kk,
                         bool any_extra_tiles, const std::optional<at::Tensor>& bias,
                         const at::Tensor& x) {
  check_cpu(w_tiled, "w_tiled");
  TORCH_CHECK(w_tiled.scalar_type() == at::kBFloat16 && w_tiled.dim() == 4 &&
                  w_tiled.size(0) * 16 >= out_features &&
                  (any_extra_tiles || w_tiled.size(0) * 16 < out_features + 16) &&
                  w_tiled.size(1) * 32 == (kk + 31) / 32 * 32 &&
                  w_tiled.size(2) == 16 && w_tiled.size(3) == 32 && w_tiled.is_contiguous(),
              "baton: w_tiled must be the tiled bf16 layout of a [", out_features, ", ", kk,
              "] matrix");
  if (bias) {
    check_like(*bias, x, "bias");
    TORCH_CHECK(bias->numel() == out_features, "baton: bias must hold out_features values");
  }
}

// x float32: y float32. x bfloat16 (a model run in bf16): y bfloat16, rounded
// once from the float32 sum, as oneDNN's bf16 linear rounds.
at::Tensor gemv_bf16_op(const at::Tensor& x, const at::Tensor& w_tiled, int64_t out_features,
                        const std::optional<at::Tensor>& bias, int64_t kind) {
  const int k = check_kind(kind);
  check_cpu(x, "x");
  const bool act16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || act16) && x.dim() == 2,
              "baton: x must be float32 or bfloat16 [M, K]");
  const int64_t m = x.size(0), kk = x.size(1);
  TORCH_CHECK(m >= 1 && m <= gemv_max_rows[k](), "baton: gemv_bf16 takes 1 to ",
              gemv_max_rows[k](), " rows, got ", m);
  check_tiled_weights(w_tiled, out_features, kk, true, bias, x);
  at::Tensor y = at::empty({m, out_features}, x.options());
  const auto* w = static_cast<const uint16_t*>(w_tiled.data_ptr());
  int rc;
  if (act16) {
    rc = gemv_bf16_act16[k](static_cast<const uint16_t*>(x.data_ptr()), w,
                            bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                            static_cast<uint16_t*>(y.data_ptr()), m, out_features, kk,
                            threads());
  } else {
    rc = gemv_bf16[k](x.data_ptr<float>(), w, bias ? bias->data_ptr<float>() : nullptr,
                      y.data_ptr<float>(), m, out_features, kk, threads());
  }
  check_rc(rc, "gemv_bf16");
  return y;
}

bool kind_runs(int64_t kind);

// y = x @ W^T (+ bias) for float32 rows x [M, K] and 4-bit weights in groups
// of `group` along K (int4_linear.c): codes uint8 [N, K/2], scales and mins
// float32 [N, K/group], w = q * scale + min; bias float32 [N] or none. Up to
// kInt4NativeRows rows decode W in registers; more take slices of W decoded
// to float32 (about 8 MB at a time) through torch's float32 matmul, where a
// row's sums run in that library's order. q8: rows rounded to int8 in blocks
// of 32 and integer products (baton_int4_linear_q8), at every row count; its
// scales and mins may be float16 instead (both, exact values widened).
constexpr int64_t kInt4NativeRows = 48;

// Scales or mins [n, groups], float32 or float16 like `like`; true for float16.
bool check_scales(const at::Tensor& t, const at::Tensor& like, int64_t n, int64_t groups) {
  check_cpu(t, "scales and mins");
  TORCH_CHECK(t.scalar_type() == like.scalar_type() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf),
              "baton: scales and mins must be float32 or float16, both the same, got ",
              t.scalar_type(), " and ", like.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == groups,
              "baton: scales and mins must be [", n, ", ", groups, "]");
  return t.scalar_type() == at::kHalf;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, const std::optional<at::Tensor>& bias,
                       int64_t group, int64_t kind, bool q8) {
  const int k = check_kind(kind);
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "baton: x must be float32 [M, K]");
  const int64_t m = x.size(0), kk = x.size(1);
  check_cpu(codes, "codes");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(1) * 2 == kk,
              "baton: codes must be uint8 [N, ", kk / 2, "]");
  const int64_t n = codes.size(0);
  TORCH_CHECK(group >= 32 && group % 32 == 0 && kk % group == 0,
              "baton: the group size must be a multiple of 32 dividing ", kk);
  const bool half = check_scales(scales, mins, n, kk / group);
  check_scales(mins, scales, n, kk / group);
  TORCH_CHECK(!half || (q8 && group == 32),
              "baton: float16 scales are for the 8-bit rows (q8) with groups of 32 only");
  if (bias) {
    check_like(*bias, x, "bias");
    TORCH_CHECK(bias->numel() == n, "baton: bias must hold ", n, " values");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  if (q8) {
    TORCH_CHECK(group <= 256, "baton: 8-bit rows take groups of at most 256");
    check_rc(int4_linear_q8_fn[k](x.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                                  scales.data_ptr(), mins.data_ptr(), half,
                                  bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
                                  m, n, kk, group, threads()),
             "int4_linear_q8");
    return y;
  }
  if (m > kInt4NativeRows) {
    const int64_t slice = std::min<int64_t>(n, std::max<int64_t>(16, (int64_t{1} << 21) / kk));
    at::Tensor w = at::empty({slice, kk}, x.options());
    const int64_t groups = kk / group;
    for (int64_t n0 = 0; n0 < n; n0 += slice) {
      const int64_t rows = std::min(slice, n - n0);
      at::Tensor ws = w.narrow(0, 0, rows);
      check_rc(int4_decode_fn[k](codes.data_ptr<uint8_t>() + n0 * (kk / 2),
                                 scales.data_ptr<float>() + n0 * groups,
                                 mins.data_ptr<float>() + n0 * groups, ws.data_ptr<float>(), rows,
                                 kk, group, threads()),
               "int4_decode");
      if (rows == n) at::mm_out(y, x, ws.t());
      else y.narrow(1, n0, rows).copy_(at::mm(x, ws.t()));
    }
    if (bias) y.add_(*bias);
    return y;
  }
  check_rc(int4_linear_fn[k](x.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                             scales.data_ptr<float>(), mins.data_ptr<float>(),
                             bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), m, n,
                             kk, group, threads()),
           "int4_linear");
  return y;
}

// y = x @ W^T (+ bias) for float32 rows x [M, K] and Q8_0 weights
// (int4_linear.c, baton_int8_linear_q8): int8 codes [N, K] in the 8-bit rows'
// pair layout, scales float32 or float16 [N, K/32]; x rounded to int8 blocks of 32.
at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const std::optional<at::Tensor>& bias, int64_t kind) {
  const int k = check_kind(kind);
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "baton: x must be float32 [M, K]");
  const int64_t m = x.size(0), kk = x.size(1);
  check_cpu(codes, "codes");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.size(1) == kk,
              "baton: codes must be int8 [N, ", kk, "]");
  TORCH_CHECK(kk % 32 == 0, "baton: the input width must be a multiple of 32");
  const int64_t n = codes.size(0);
  const bool half = check_scales(scales, scales, n, kk / 32);
  if (bias) {
    check_like(*bias, x, "bias");
    TORCH_CHECK(bias->numel() == n, "baton: bias must hold ", n, " values");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  check_rc(int8_linear_q8_fn[k](x.data_ptr<float>(), codes.data_ptr<int8_t>(),
                                scales.data_ptr(), half, bias ? bias->data_ptr<float>() : nullptr,
                                y.data_ptr<float>(), m, n, kk, threads()),
           "int8_linear_q8");
  return y;
}

// y = x @ W^T (+ bias) on AMX tiles (amx_bf16.c) for bf16 rows x [M, K] and
// the gemv's tiled bf16 weights; y bf16, rounded once from the float32 sum.
// Only the avx512_bf16 kind has the tile code, and only where amx_ready says
// the CPU and the OS allow tile data.
at::Tensor linear_amx_op(const at::Tensor& x, const at::Tensor& w_tiled, int64_t out_features,
                         const std::optional<at::Tensor>& bias, int64_t kind) {
  const int k = check_kind(kind);
  TORCH_CHECK(amx_ready_fn[k](), "baton: the ", kKindNames[k],
              " kernels have no AMX tile linear on this CPU");
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "baton: linear_amx takes bfloat16 x [M, K]");
  const int64_t m = x.size(0), kk = x.size(1);
  check_tiled_weights(w_tiled, out_features, kk, false, bias, x);
  at::Tensor y = at::empty({m, out_features}, x.options());
  if (m == 0) return y;
  const int rc = linear_amx_fn[k](static_cast<const uint16_t*>(x.data_ptr()),
                                  static_cast<const uint16_t*>(w_tiled.data_ptr()),
                                  bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                                  static_cast<uint16_t*>(y.data_ptr()), m, out_features, kk,
                                  threads());
  check_rc(rc, "linear_amx");
  return y;
}

// Weights reordered once for oneDNN (torch.ops.mkldnn._reorder_linear_weight)
// are opaque tensors that torch.compile cannot trace (no strides, no fake
// tensor): the operators take them by a number handed out here instead, so a
// compiled step sees an int and an opaque call. hold_weight keeps the tensor
// alive until drop_weight (the Python owner's finaliser).
std::mutex held_mutex;
std::unordered_map<int64_t, at::Tensor> held_weights;
int64_t next_held = 1;

int64_t hold_weight(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(held_mutex);
  held_weights[next_held] = weight;
  return next_held++;
}

void drop_weight(int64_t handle) {
  std::lock_guard<std::mutex> lock(held_mutex);
  held_weights.erase(handle);
}

at::Tensor held_weight(int64_t handle) {
  std::lock_guard<std::mutex> lock(held_mutex);
  auto found = held_weights.find(handle);
  TORCH_CHECK(found != held_weights.end(), "baton: no held weight ", handle);
  return found->second;
}

// oneDNN's linear on a held weight (the handle hold_weight gave it).
at::Tensor packed_linear(const at::Tensor& x, int64_t packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, c10::string_view,
                                         c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  at::Tensor y = op.call(x, held_weight(packed), bias, "none",
                         c10::List<std::optional<at::Scalar>>(), std::nullopt);
  TORCH_CHECK(y.size(-1) == out_features, "baton: held weight ", packed, " has ", y.size(-1),
              " outputs, not ", out_features);
  return y;
}

// A linear layer over the gemv's tiled bf16 weights, the kernel chosen by
// the number of rows in C++ (so a compiled step has no branch on its token
// count): none -> empty; up to gemv_rows -> the gemv; up to amx_rows -> the
// AMX tile linear; more -> oneDNN on its packed copy (packed) or, without
// one, at::linear on the plain weight (a quantized model's tied output
// projection). x float32 or bfloat16, y in x's dtype.
at::Tensor linear_tiled(const at::Tensor& x, const at::Tensor& w_tiled,
                        int64_t packed, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, int64_t out_features,
                        int64_t gemv_rows, int64_t amx_rows, int64_t kind) {
  TORCH_CHECK(x.dim() == 2, "baton: linear_tiled takes x [M, K]");
  const int64_t m = x.size(0);
  if (m == 0) return at::empty({0, out_features}, x.options());
  const at::Tensor xc = x.contiguous();
  if (m <= gemv_rows) return gemv_bf16_op(xc, w_tiled, out_features, bias, kind);
  if (m <= amx_rows) return linear_amx_op(xc, w_tiled, out_features, bias, kind);
  if (packed) return packed_linear(xc, packed, bias, out_features);
  TORCH_CHECK(weight.has_value(), "baton: linear_tiled needs packed or weight for ", m,
              " rows");
  return at::linear(xc, *weight, bias);
}

// Whether kind's decode attention takes its bf16 scores on AMX tiles: mode 1
// lets it (the default), 0 keeps them on VDPBF16PS (tests force each path),
// -1 only asks. Process-wide.
int64_t attention_amx(int64_t kind, int64_t mode) {
  const int k = check_kind(kind);
  return attention_amx_fn[k](static_cast<int>(mode));
}

// Whether kind's build was compiled with AVX2 (the portable one is not).
bool kind_has_avx2(int64_t kind) { return kernels_avx2_fn[check_kind(kind)]() != 0; }

bool amx_ready(int64_t kind) { return kind_runs(kind) && amx_ready_fn[kind](); }

bool kind_runs(int64_t kind) {
  return kind >= 0 && kind < kNumKinds && kind_built[kind] && cpu_runs(kind);
}

}  // namespace

TORCH_LIBRARY(baton, m) {
  m.def("rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps, int kind) "
        "-> Tensor");
  m.def("silu_mul(Tensor gate_up, int kind) -> Tensor");
  m.def("qkv_rope_store(Tensor qkv, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor positions, Tensor cos_table, Tensor sin_table, Tensor? q_norm, "
        "Tensor? k_norm, float eps, Tensor slot_mapping, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int kind) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, SymInt max_seq_len, int block_size, float scale, "
        "int kind) -> Tensor");
  m.def("paged_decode_attention_lse(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, int max_seq_len, int block_size, float scale, "
        "int kind) -> (Tensor, Tensor)");
  m.def("gemv_bf16(Tensor x, Tensor w_tiled, int out_features, Tensor? bias, int kind) "
        "-> Tensor");
  m.def("linear_amx(Tensor x, Tensor w_tiled, int out_features, Tensor? bias, int kind) "
        "-> Tensor");
  m.def("hold_weight(Tensor weight) -> int", hold_weight);
  m.def("drop_weight(int handle) -> ()", drop_weight);
  m.def("packed_linear(Tensor x, int packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_tiled(Tensor x, Tensor w_tiled, int packed, Tensor? weight, Tensor? bias, "
        "int out_features, int gemv_rows, int amx_rows, int kind) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias, "
        "int group, int kind, bool q8=False) -> Tensor");
  m.def("int8_linear_q8(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int kind) -> Tensor");
  m.def("attention_amx(int kind, int mode) -> int", attention_amx);
  m.def("kind_has_avx2(int kind) -> bool", kind_has_avx2);
  m.def("kind_runs(int kind) -> bool", kind_runs);
  m.def("amx_ready(int kind) -> bool", amx_ready);
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("qkv_rope_store", qkv_rope_store);
  m.impl("paged_decode_attention", paged_decode_attention);
  m.impl("paged_decode_attention_lse", paged_decode_attention_lse);
  m.impl("gemv_bf16", gemv_bf16_op);
  m.impl("linear_amx", linear_amx_op);
  m.impl("packed_linear", packed_linear);
  m.impl("linear_tiled", linear_tiled);
  m.impl("int4_linear", int4_linear);
  m.impl("int8_linear_q8", int8_linear_q8);
}
