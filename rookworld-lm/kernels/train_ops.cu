// The training forward's custom ops and their backwards, f32 (each op's module under
// rookworld-lm/src/train_ops/ holds its CPU implementation, the reference these are checked
// against on a GPU, and the formulas in its doc comments):
// - layer_norm_fwd / layer_norm_dx: a warp per row, statistics in f32 over the row;
// - layer_norm_params: the weight's and bias's gradients as partial sums over 32-row
//   chunks (one block each), summed on the host side in a fixed order: deterministic,
//   no atomics;
// - bias_gelu_bwd: dz = dy * gelu_new'(x + b), element-wise;
// - masked_softmax_fwd / softmax_bwd: attention's softmax(scale * s + bias) and its
//   backward, a warp per row;
// - target_logprobs_fwd: log softmax(logits / T)[y], a block per row (online max/sum);
// - target_logprobs_bwd: g/T * (1[v = y] - p), element-wise over (N, V) blocks, p
//   recovered from the forward's result (nothing (N, V) kept between them);
// - adamw_moments / adamw_param: one AdamW step of a parameter on the device, its moments
//   in place (rookworld-lm/src/train_ops/adamw.rs);
// - adamw_many / square_sums_many: every parameter's AdamW step (and its bfloat16 copy)
//   and every gradient's sum of squares in one launch each, over a table of tensors cut
//   into chunks (rookworld-lm/src/train_ops/adamw.rs);
// - bias_rows: every row of an (M, N) output set to the bias, which the mixed-precision
//   linear's product is then added onto (rookworld-lm/src/train_ops/linear.rs).

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#define WARP 32
#define ROWS_PER_BLOCK 8 // warps per block in the row-wise kernels
#define PARAM_CHUNK 32   // rows per block of layer_norm_params (PARAM_CHUNK in cpu.rs)
#define REDUCE_THREADS 512

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Mean and 1/sqrt(var + eps) of one row of E, by a whole warp (two passes).
__device__ __forceinline__ void row_stats(const float *row, int E, float eps, float *mean,
                                          float *rstd) {
    const int lane = threadIdx.x % WARP;
    float s = 0.f;
    for (int i = lane; i < E; i += WARP) s += row[i];
    const float m = warp_sum(s) / E;
    float v = 0.f;
    for (int i = lane; i < E; i += WARP) {
        const float d = row[i] - m;
        v += d * d;
    }
    *mean = m;
    *rstd = rsqrtf(warp_sum(v) / E + eps);
}

// x, y: (M, E); w, b: (E). Grid ceil(M / 8), block 256.
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)
    layer_norm_fwd(const float *__restrict__ x, const float *__restrict__ w,
                   const float *__restrict__ b, float *__restrict__ y, int M, int E, float eps) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (r >= M) return;
    const float *row = x + (size_t)r * E;
    float mean, rstd;
    row_stats(row, E, eps, &mean, &rstd);
    float *out = y + (size_t)r * E;
    for (int i = lane; i < E; i += WARP) out[i] = (row[i] - mean) * rstd * w[i] + b[i];
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w. Grid ceil(M / 8), block 256.
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)
    layer_norm_dx(const float *__restrict__ x, const float *__restrict__ w,
                  const float *__restrict__ dy, float *__restrict__ dx, int M, int E, float eps) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (r >= M) return;
    const float *row = x + (size_t)r * E, *g_row = dy + (size_t)r * E;
    float mean, rstd;
    row_stats(row, E, eps, &mean, &rstd);
    float sg = 0.f, sgx = 0.f;
    for (int i = lane; i < E; i += WARP) {
        const float g = g_row[i] * w[i];
        sg += g;
        sgx += g * (row[i] - mean) * rstd;
    }
    const float mean_g = warp_sum(sg) / E, mean_gx = warp_sum(sgx) / E;
    float *out = dx + (size_t)r * E;
    for (int i = lane; i < E; i += WARP) {
        const float xhat = (row[i] - mean) * rstd;
        out[i] = rstd * (g_row[i] * w[i] - mean_g - xhat * mean_gx);
    }
}

// out: (C, 2, E), C = ceil(M / 32): [c][0] = sum dy * xhat, [c][1] = sum dy over chunk c's
// rows. Grid C, block 256: the 8 warps compute the chunk's row statistics into shared
// memory, then each thread sums its columns over the chunk's rows in row order.
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)
    layer_norm_params(const float *__restrict__ x, const float *__restrict__ dy,
                      float *__restrict__ out, int M, int E, float eps) {
    __shared__ float means[PARAM_CHUNK], rstds[PARAM_CHUNK];
    const int first = blockIdx.x * PARAM_CHUNK;
    const int rows = min(PARAM_CHUNK, M - first);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    for (int k = warp; k < rows; k += ROWS_PER_BLOCK) {
        float mean, rstd;
        row_stats(x + (size_t)(first + k) * E, E, eps, &mean, &rstd);
        if (lane == 0) {
            means[k] = mean;
            rstds[k] = rstd;
        }
    }
    __syncthreads();
    float *part = out + (size_t)blockIdx.x * 2 * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float dw = 0.f, db = 0.f;
        for (int k = 0; k < rows; ++k) {
            const size_t at = (size_t)(first + k) * E + i;
            dw += dy[at] * (x[at] - means[k]) * rstds[k];
            db += dy[at];
        }
        part[i] = dw;
        part[E + i] = db;
    }
}

// dz = dy * gelu_new'(x + b) over M * N elements (grid-stride); b: (N).
extern "C" __global__ void bias_gelu_bwd(const float *__restrict__ x, const float *__restrict__ b,
                                         const float *__restrict__ dy, float *__restrict__ dz,
                                         int M, int N) {
    const size_t n = (size_t)M * N;
    const float a = 0.7978845608028654f, c = 0.044715f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float z = x[i] + b[i % N];
        const float t = tanhf(a * (z + c * z * z * z));
        const float grad = 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * a * (1.f + 3.f * c * z * z);
        dz[i] = dy[i] * grad;
    }
}

// p = softmax(scale * s + bias) per row of S; s, p: (B, H, T, S) as rows; bias: (BB, 1, T, S)
// with BB 1 or B. A row with every key masked gets zeros. Grid ceil(rows / 8), block 256.
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)
    masked_softmax_fwd(const float *__restrict__ s, const float *__restrict__ bias,
                       float *__restrict__ p, int rows, int H, int T, int S, int BB,
                       float scale) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (r >= rows) return;
    const float *row = s + (size_t)r * S;
    const float *mask = bias + ((size_t)((r / (H * T)) % BB) * T + r % T) * S;
    float *out = p + (size_t)r * S;
    float m = -INFINITY;
    for (int j = lane; j < S; j += WARP) m = fmaxf(m, scale * row[j] + mask[j]);
    m = warp_max(m);
    if (m == -INFINITY) {
        for (int j = lane; j < S; j += WARP) out[j] = 0.f;
        return;
    }
    float sum = 0.f;
    for (int j = lane; j < S; j += WARP) sum += __expf(scale * row[j] + mask[j] - m);
    const float inv = 1.f / warp_sum(sum);
    for (int j = lane; j < S; j += WARP) out[j] = __expf(scale * row[j] + mask[j] - m) * inv;
}

// ds = scale * p * (dp - sum(p * dp)) per row of S. Grid ceil(rows / 8), block 256.
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)
    softmax_bwd(const float *__restrict__ p, const float *__restrict__ dp,
                float *__restrict__ ds, int rows, int S, float scale) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (r >= rows) return;
    const float *pr = p + (size_t)r * S, *dr = dp + (size_t)r * S;
    float dot = 0.f;
    for (int j = lane; j < S; j += WARP) dot += pr[j] * dr[j];
    dot = warp_sum(dot);
    float *out = ds + (size_t)r * S;
    for (int j = lane; j < S; j += WARP) out[j] = scale * pr[j] * (dr[j] - dot);
}

// Combines two (max, sum of exp(. - max)) pairs.
__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2) {
    const float top = fmaxf(m, m2);
    if (top == -INFINITY) return;
    s = s * __expf(m - top) + s2 * __expf(m2 - top);
    m = top;
}

// out[n] = logits[n, y_n] / T - logsumexp(logits[n] / T). Grid N, block 512.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)
    target_logprobs_fwd(const float *__restrict__ logits, const uint32_t *__restrict__ targets,
                        float *__restrict__ out, int N, int V, float inv_t) {
    __shared__ float ms[REDUCE_THREADS / WARP], ss[REDUCE_THREADS / WARP];
    const int n = blockIdx.x;
    const float *row = logits + (size_t)n * V;
    float m = -INFINITY, s = 0.f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float z = row[j] * inv_t;
        if (z == -INFINITY) continue;
        if (z > m) {
            s = s * __expf(m - z) + 1.f;
            m = z;
        } else {
            s += __expf(z - m);
        }
    }
    for (int o = 16; o > 0; o /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (lane == 0) {
        ms[warp] = m;
        ss[warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float tm = ms[0], ts = ss[0];
        for (int w = 1; w < (int)(blockDim.x / WARP); ++w) lse_merge(tm, ts, ms[w], ss[w]);
        const uint32_t y = min(targets[n], (uint32_t)(V - 1));
        out[n] = row[y] * inv_t - (tm + logf(ts));
    }
}

// d[n, v] = g_n / T * (1[v = y_n] - exp(logits[n, v] / T - lse_n)), lse_n = logits[n, y_n]/T
// - lp_n; rg: (N, 2) of (lp_n, g_n). Grid (ceil(V / 256), min(N, 65535)), block 256, rows
// grid-strided.
extern "C" __global__ void target_logprobs_bwd(const float *__restrict__ logits,
                                               const uint32_t *__restrict__ targets,
                                               const float *__restrict__ rg,
                                               float *__restrict__ d, int N, int V,
                                               float inv_t) {
    const int v = blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= V) return;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const float *row = logits + (size_t)n * V;
        const uint32_t y = min(targets[n], (uint32_t)(V - 1));
        const float lse = row[y] * inv_t - rg[2 * n], scale = rg[2 * n + 1] * inv_t;
        const float p = __expf(row[v] * inv_t - lse);
        d[(size_t)n * V + v] = scale * ((v == (int)y ? 1.f : 0.f) - p);
    }
}

// AdamW's moments, in place: mv = (m, v), each of n; g' = gs * g,
// m = b1 m + (1 - b1) g', v = b2 v + (1 - b2) g'^2 (grid-stride).
extern "C" __global__ void adamw_moments(float *__restrict__ mv, const float *__restrict__ g,
                                         size_t n, float b1, float b2, float gs) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float gi = g[i] * gs;
        mv[i] = b1 * mv[i] + (1.f - b1) * gi;
        mv[n + i] = b2 * mv[n + i] + (1.f - b2) * gi * gi;
    }
}

// AdamW's parameter update, in place: p = p * shrink - lr * ((m s1) / (sqrt(v s2) + eps))
// (grid-stride).
extern "C" __global__ void adamw_param(float *__restrict__ p, const float *__restrict__ mv,
                                       size_t n, float lr, float eps, float shrink, float s1,
                                       float s2) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        p[i] = p[i] * shrink - lr * ((mv[i] * s1) / (sqrtf(mv[n + i] * s2) + eps));
    }
}

// out[r, j] = b[j] for an (M, N) output, M * N elements (grid-stride): the rows a
// product with beta = 1 adds onto.
extern "C" __global__ void bias_rows(float *__restrict__ out, const float *__restrict__ b,
                                     size_t n, int N) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = b[i % N];
    }
}

// One tensor of a multi-tensor launch (ManyTensor in adamw.rs, the same layout): its
// parameter p (n), gradient g (n), moments mv (2, n), where its updated values go as
// bfloat16 bits (null: nowhere), and its decay factor.
struct ManyTensor {
    float *p;
    const float *g;
    float *mv;
    uint16_t *out;
    unsigned long long n;
    float shrink;
    float unused;
};

#define MANY_CHUNK 65536 // elements of a chunk (MANY_CHUNK in adamw.rs)
#define MANY_THREADS 256

// Chunk c covers elements chunk[c].y * MANY_CHUNK .. + MANY_CHUNK of tensor chunk[c].x.
__device__ __forceinline__ void chunk_range(const ManyTensor &t, int2 c, size_t *start,
                                            size_t *end) {
    *start = (size_t)c.y * MANY_CHUNK;
    const size_t stop = *start + MANY_CHUNK;
    *end = stop < t.n ? stop : (size_t)t.n;
}

// AdamW of every tensor of the table, as adamw_moments then adamw_param on each (the same
// f32 expressions, the moments stored and the parameter updated from them), and the
// updated parameter's bfloat16 bits (round to nearest even) where out is set. Grid: any;
// block MANY_THREADS; chunks grid-strided.
extern "C" __global__ void __launch_bounds__(MANY_THREADS)
    adamw_many(const ManyTensor *__restrict__ tensors, const int2 *__restrict__ chunks,
               int n_chunks, float b1, float b2, float gs, float lr, float eps, float s1,
               float s2) {
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const int2 ch = chunks[c];
        const ManyTensor t = tensors[ch.x];
        size_t start, end;
        chunk_range(t, ch, &start, &end);
        for (size_t i = start + threadIdx.x; i < end; i += blockDim.x) {
            const float gi = t.g[i] * gs;
            const float m = b1 * t.mv[i] + (1.f - b1) * gi;
            const float v = b2 * t.mv[t.n + i] + (1.f - b2) * gi * gi;
            t.mv[i] = m;
            t.mv[t.n + i] = v;
            const float p = t.p[i] * t.shrink - lr * ((m * s1) / (sqrtf(v * s2) + eps));
            t.p[i] = p;
            if (t.out) t.out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(p));
        }
    }
}

// partial[c] = the sum of g^2 over chunk c, in a fixed order (each thread's strided sum,
// then a tree over the block): the same bits every run. Grid n_chunks, block MANY_THREADS.
extern "C" __global__ void __launch_bounds__(MANY_THREADS)
    square_sums_many(const ManyTensor *__restrict__ tensors, const int2 *__restrict__ chunks,
                     int n_chunks, float *__restrict__ partial) {
    __shared__ float sums[MANY_THREADS];
    const int c = blockIdx.x;
    if (c >= n_chunks) return;
    const int2 ch = chunks[c];
    const ManyTensor t = tensors[ch.x];
    size_t start, end;
    chunk_range(t, ch, &start, &end);
    float s = 0.f;
    for (size_t i = start + threadIdx.x; i < end; i += blockDim.x) s += t.g[i] * t.g[i];
    sums[threadIdx.x] = s;
    __syncthreads();
    for (int half = MANY_THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[c] = sums[0];
}
