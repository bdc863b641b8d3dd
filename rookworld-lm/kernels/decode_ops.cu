// The decode step's small fused ops (rookworld-lm/src/fused_ops.rs holds each one's CPU
// implementation, the reference they are checked against on a GPU):
// - qkv_split: one part (q, k or v) of c_attn's (B, 3E) output plus its bias, written as
//   (B, H, ·, D) at column `col` of a buffer with C columns: q into its own (B, H, 1, D),
//   k and v straight into the grouped cache's suffix at the cursor (no copies, no padding
//   rows, no allocation);
// - bias_gelu: gelu_new(x + b), the MLP's first bias and activation in one pass;
// - add_layer_norm: s = x + (y + c) and layer_norm(s), the bias of the matmul that made
//   y, the residual add and the next layer norm in one pass (statistics in f32), written
//   as (2, M, E): s, then the norm.
// For a captured decode step (src/cuda/graph.rs), whose launches cannot change from step
// to step, two more read what changes from device memory (`step`: live rows, cursor):
// - qkv_split_step: qkv_split at the column step[1];
// - embed_rows: each row's token and position embeddings, ids and positions in device
//   memory, written as two (B, E) matrices (add_layer_norm then sums and norms them).

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float round_to(float, float x) { return x; }
__device__ __forceinline__ float round_to(__nv_bfloat16, float x) {
    return __bfloat162float(__float2bfloat16(x));
}
__device__ __forceinline__ void store(float *p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float x) { *p = __float2bfloat16(x); }

// Grid-stride over B * E elements. qkv: (B, 3E); bias: (3E); dst: (B, H, C, D).
template <typename T>
__device__ void qkv_split(const T *__restrict__ qkv, const T *__restrict__ bias,
                          T *__restrict__ dst, int part, int B, int H, int D, int C, int col) {
    const int E = H * D;
    const size_t n = (size_t)B * E;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const int r = i / E, hd = i % E, h = hd / D, d = hd % D;
        const float v = to_f32(qkv[(size_t)r * 3 * E + part * E + hd]) + to_f32(bias[part * E + hd]);
        store(&dst[(((size_t)r * H + h) * C + col) * D + d], v);
    }
}

// ids, positions: (B); wte: (V, E); wpe: (P, E); tok, pos: (B, E).
template <typename T>
__device__ void embed_rows(const T *__restrict__ wte, const T *__restrict__ wpe,
                           const uint32_t *__restrict__ ids,
                           const uint32_t *__restrict__ positions, T *__restrict__ tok,
                           T *__restrict__ pos, int B, int E) {
    const size_t n = (size_t)B * E;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / E, e = i % E;
        tok[i] = wte[(size_t)ids[r] * E + e];
        pos[i] = wpe[(size_t)positions[r] * E + e];
    }
}

// x: (M, N); bias: (N); out: (M, N). gelu_new(u) = u/2 (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))).
template <typename T>
__device__ void bias_gelu(const T *__restrict__ x, const T *__restrict__ bias,
                          T *__restrict__ out, int M, int N) {
    const size_t n = (size_t)M * N;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float u = to_f32(x[i]) + to_f32(bias[i % N]);
        const float inner = 0.7978845608028654f * (u + 0.044715f * u * u * u);
        store(&out[i], 0.5f * u * (1.f + tanhf(inner)));
    }
}

template <typename T>
__device__ float block_sum(float v, float *scratch) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

// One block per row. x, y: (M, E); c, w, b: (E); out: (2, M, E) = (s, layer_norm(s)) for
// s = x + (y + c), each addition rounded to T as the unfused ops round it.
template <typename T>
__device__ void add_layer_norm(const T *__restrict__ x, const T *__restrict__ y,
                               const T *__restrict__ c, const T *__restrict__ w,
                               const T *__restrict__ b, T *__restrict__ out, int M, int E,
                               float eps) {
    extern __shared__ float s_row[];  // E values, then 32 for the reductions
    float *scratch = s_row + E;
    const int row = blockIdx.x;
    const size_t base = (size_t)row * E;
    float part = 0.f;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        const float yc = round_to(T(), to_f32(y[base + i]) + to_f32(c[i]));
        const float s = round_to(T(), to_f32(x[base + i]) + yc);
        s_row[i] = s;
        store(&out[base + i], s);
        part += s;
    }
    const float mean = block_sum<T>(part, scratch) / E;
    part = 0.f;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        const float c = s_row[i] - mean;
        part += c * c;
    }
    const float inv = rsqrtf(block_sum<T>(part, scratch) / E + eps);
    T *norm = out + (size_t)M * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x)
        store(&norm[base + i], (s_row[i] - mean) * inv * to_f32(w[i]) + to_f32(b[i]));
}

// Threads per block of the layer norm (`THREADS` in src/cuda/ops.rs).
#define NORM_THREADS 256

#define DECODE_OPS(SUFFIX, T)                                                                \
    extern "C" __global__ void qkv_split_##SUFFIX(const T *qkv, const T *bias, T *dst,       \
                                                  int part, int B, int H, int D, int C,      \
                                                  int col) {                                 \
        qkv_split<T>(qkv, bias, dst, part, B, H, D, C, col);                                 \
    }                                                                                        \
    extern "C" __global__ void qkv_split_step_##SUFFIX(const T *qkv, const T *bias, T *dst,  \
                                                       int part, int B, int H, int D, int C, \
                                                       const uint32_t *step) {               \
        qkv_split<T>(qkv, bias, dst, part, B, H, D, C, (int)step[1]);                        \
    }                                                                                        \
    extern "C" __global__ void embed_rows_##SUFFIX(const T *wte, const T *wpe,               \
                                                   const uint32_t *ids,                      \
                                                   const uint32_t *positions, T *tok,        \
                                                   T *pos, int B, int E) {                   \
        embed_rows<T>(wte, wpe, ids, positions, tok, pos, B, E);                             \
    }                                                                                        \
    extern "C" __global__ void bias_gelu_##SUFFIX(const T *x, const T *bias, T *out, int M,  \
                                                  int N) {                                   \
        bias_gelu<T>(x, bias, out, M, N);                                                    \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                               \
        add_layer_norm_##SUFFIX(const T *x, const T *y, const T *c, const T *w, const T *b,  \
                                T *out, int M, int E, float eps) {                           \
        add_layer_norm<T>(x, y, c, w, b, out, M, E, eps);                                    \
    }

DECODE_OPS(f32, float)
DECODE_OPS(bf16, __nv_bfloat16)
