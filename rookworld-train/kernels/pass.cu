// The kernels of rookworld-train's CUDA backend (rookworld-train/src/cuda/): every
// operation of the pass but the matrix products (cuBLAS), f32 storage. Each one's CPU
// reference is the CPU backend's kernel of the same name (rookworld-train/src/cpu/), which
// the debug mode (rookworld-train/src/compare.rs) compares it with buffer by buffer.
//
// Every sum is in a fixed order, so a pass gives the same bits every run: sums over rows
// as partial sums over fixed blocks of rows, then the partials in order (column_partials /
// column_finish, layer_norm_partials / layer_norm_finish); the scatters (the embedding's
// backward, the predicting rows' gradients) grouped by destination on the host first
// (scatter_add_planned). No atomics.
//
// Attention: a group's rows are its prompt, then each completion; query row r sees the
// prefix rows [meta.p0, meta.p1) (its group's prompt, for a completion row; none for a
// prompt row) and its own rows [meta.o0, r]; key row r is seen by the query rows
// [r, meta.q_end) (the rest of its group for a prompt row, of its completion otherwise).
// qkv rows are [q | k | v], head h at columns h·D..(h+1)·D of each part.

#include <cuda_bf16.h>
#include <math.h>
#include <mma.h>
#include <stdint.h>

#define WARP 32
#define ROWS_PER_BLOCK 8   // warps per block of the warp-per-row kernels
#define SUM_ROWS 256       // rows per partial sum of column_partials
#define LN_CHUNK 32        // rows per partial sum of layer_norm_partials
#define HEAD_THREADS 512   // threads per row of the head's kernels

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

#define GRID_STRIDE(i, n)                                                                  \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)(n);         \
         i += (size_t)blockDim.x * gridDim.x)

// out (R, E) = wte[ids[r]] + wpe[pos[r]].
extern "C" __global__ void embedding_fwd(float *__restrict__ out, const uint32_t *__restrict__ ids,
                                         const uint32_t *__restrict__ pos,
                                         const float *__restrict__ wte,
                                         const float *__restrict__ wpe, int R, int E) {
    GRID_STRIDE(i, (size_t)R * E) {
        const size_t r = i / E, c = i % E;
        out[i] = wte[(size_t)ids[r] * E + c] + wpe[(size_t)pos[r] * E + c];
    }
}

// dst (·, E) rows targets[k] += Σ src rows sources[offsets[k]..offsets[k + 1]], summed in
// that order (rookworld_train::batch::ScatterPlan): the embedding's backward (by token, by
// position) and the predicting rows' gradients, the same bits every run.
extern "C" __global__ void scatter_add_planned(float *__restrict__ dst,
                                               const float *__restrict__ src,
                                               const uint32_t *__restrict__ targets,
                                               const uint32_t *__restrict__ offsets,
                                               const uint32_t *__restrict__ sources, int K,
                                               int E) {
    GRID_STRIDE(i, (size_t)K * E) {
        const size_t k = i / E, c = i % E;
        float s = 0.f;
        for (uint32_t j = offsets[k]; j < offsets[k + 1]; ++j) s += src[(size_t)sources[j] * E + c];
        dst[(size_t)targets[k] * E + c] += s;
    }
}

// Every row of out (R, N) = bias (N).
extern "C" __global__ void broadcast_rows(float *__restrict__ out, const float *__restrict__ bias,
                                          int R, int N) {
    GRID_STRIDE(i, (size_t)R * N) { out[i] = bias[i % N]; }
}

// partial (ceil(R / SUM_ROWS), N): block row k of m (R, N) summed over its rows, in order.
// Grid (ceil(N / 256), ceil(R / SUM_ROWS)), block 256.
extern "C" __global__ void column_partials(const float *__restrict__ m, float *__restrict__ partial,
                                           int R, int N) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, k = blockIdx.y;
    if (c >= N) return;
    const int end = min(R, (k + 1) * SUM_ROWS);
    float s = 0.f;
    for (int r = k * SUM_ROWS; r < end; ++r) s += m[(size_t)r * N + c];
    partial[(size_t)k * N + c] = s;
}

// acc (N) += Σ_k partial[k] (K, N), k in order.
extern "C" __global__ void column_finish(float *__restrict__ acc, const float *__restrict__ partial,
                                         int K, int N) {
    GRID_STRIDE(c, N) {
        float s = 0.f;
        for (int k = 0; k < K; ++k) s += partial[(size_t)k * N + c];
        acc[c] += s;
    }
}

// out = a + b.
extern "C" __global__ void add(float *__restrict__ out, const float *__restrict__ a,
                               const float *__restrict__ b, int n) {
    GRID_STRIDE(i, n) { out[i] = a[i] + b[i]; }
}

__device__ __forceinline__ float gelu_tanh(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return tanhf(u);
}

// out = gelu_new(x) = x/2 (1 + tanh(√(2/π) (x + 0.044715 x³))).
extern "C" __global__ void gelu_fwd(float *__restrict__ out, const float *__restrict__ x, int n) {
    GRID_STRIDE(i, n) { out[i] = 0.5f * x[i] * (1.f + gelu_tanh(x[i])); }
}

// d *= gelu_new'(x).
extern "C" __global__ void gelu_bwd(float *__restrict__ d, const float *__restrict__ x, int n) {
    GRID_STRIDE(i, n) {
        const float v = x[i], t = gelu_tanh(v);
        const float local = 0.5f * (1.f + t) +
                            0.5f * v * (1.f - t * t) * 0.7978845608028654f *
                                (1.f + 3.f * 0.044715f * v * v);
        d[i] *= local;
    }
}

// y (M, E) = (x − μ) σ̂ w + b per row, with μ and σ̂ = 1/√(var + eps) saved (M). A warp per
// row, the statistics in two passes. Grid ceil(M / 8), block 256.
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)
    pass_layer_norm_fwd(float *__restrict__ y, float *__restrict__ mean,
                        float *__restrict__ rstd, const float *__restrict__ x,
                        const float *__restrict__ w, const float *__restrict__ b, int M, int E,
                        float eps) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (r >= M) return;
    const float *row = x + (size_t)r * E;
    float s = 0.f;
    for (int i = lane; i < E; i += WARP) s += row[i];
    const float m = warp_sum(s) / E;
    float v = 0.f;
    for (int i = lane; i < E; i += WARP) {
        const float d = row[i] - m;
        v += d * d;
    }
    const float rs = rsqrtf(warp_sum(v) / E + eps);
    float *out = y + (size_t)r * E;
    for (int i = lane; i < E; i += WARP) out[i] = (row[i] - m) * rs * w[i] + b[i];
    if (lane == 0) {
        mean[r] = m;
        rstd[r] = rs;
    }
}

// dx += σ̂ (g − mean(g) − x̂ mean(g x̂)) per row, g = dy w. Grid ceil(M / 8), block 256.
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)
    pass_layer_norm_dx(float *__restrict__ dx, const float *__restrict__ dy,
                       const float *__restrict__ x, const float *__restrict__ mean,
                       const float *__restrict__ rstd, const float *__restrict__ w, int M,
                       int E) {
    const int r = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (r >= M) return;
    const float *row = x + (size_t)r * E, *g_row = dy + (size_t)r * E;
    const float m = mean[r], rs = rstd[r];
    float sg = 0.f, sgx = 0.f;
    for (int i = lane; i < E; i += WARP) {
        const float g = g_row[i] * w[i];
        sg += g;
        sgx += g * (row[i] - m) * rs;
    }
    const float mean_g = warp_sum(sg) / E, mean_gx = warp_sum(sgx) / E;
    float *out = dx + (size_t)r * E;
    for (int i = lane; i < E; i += WARP) {
        const float xhat = (row[i] - m) * rs;
        out[i] += rs * (g_row[i] * w[i] - mean_g - xhat * mean_gx);
    }
}

// partial (ceil(M / LN_CHUNK), 2, E): over block k's rows, Σ dy x̂ and Σ dy, in order.
// Grid ceil(M / LN_CHUNK), block 256.
extern "C" __global__ void layer_norm_partials(float *__restrict__ partial,
                                               const float *__restrict__ dy,
                                               const float *__restrict__ x,
                                               const float *__restrict__ mean,
                                               const float *__restrict__ rstd, int M, int E) {
    const int first = blockIdx.x * LN_CHUNK, end = min(M, first + LN_CHUNK);
    float *part = partial + (size_t)blockIdx.x * 2 * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        float dw = 0.f, db = 0.f;
        for (int r = first; r < end; ++r) {
            const float g = dy[(size_t)r * E + i];
            dw += g * (x[(size_t)r * E + i] - mean[r]) * rstd[r];
            db += g;
        }
        part[i] = dw;
        part[E + i] = db;
    }
}

// dw += Σ_k partial[k][0], db += Σ_k partial[k][1], k in order.
extern "C" __global__ void layer_norm_finish(float *__restrict__ dw, float *__restrict__ db,
                                             const float *__restrict__ partial, int K, int E) {
    GRID_STRIDE(i, E) {
        float sw = 0.f, sb = 0.f;
        for (int k = 0; k < K; ++k) {
            sw += partial[(size_t)k * 2 * E + i];
            sb += partial[(size_t)k * 2 * E + E + i];
        }
        dw[i] += sw;
        db[i] += sb;
    }
}

// out (N, E) = rows[n] of x (·, E).
extern "C" __global__ void gather_rows(float *__restrict__ out, const float *__restrict__ x,
                                       const uint32_t *__restrict__ rows, int N, int E) {
    GRID_STRIDE(i, (size_t)N * E) {
        out[i] = x[(size_t)rows[i / E] * E + i % E];
    }
}

// One row's attention metadata (see the top of the file).
struct RowMeta {
    int p0, p1, o0, q_end;
};

// The visible key rows of query r, in order: the prefix, then its own rows up to r.
__device__ __forceinline__ int key_at(const RowMeta &m, int j) {
    const int prefix = m.p1 - m.p0;
    return j < prefix ? m.p0 + j : m.o0 + (j - prefix);
}

__device__ __forceinline__ int keys_of(const RowMeta &m, int r) {
    return (m.p1 - m.p0) + (r - m.o0 + 1);
}

// The attention kernels are instantiated per head width D = 32·PER (PER = 1, 2, 4: each
// lane holds PER of a row's D values in registers): attention_fwd_d64 and so on.

// y (R, E) and lse (R, H): softmax(q·k/√D) over the visible keys, one warp per (row,
// head), online max and sum. Grid ceil(R·H / 8), block 256.
template <int per>
__device__ void attention_fwd(float *__restrict__ y, float *__restrict__ lse,
                              const float *__restrict__ qkv, const int4 *__restrict__ meta, int R,
                              int H) {
    const int task = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (task >= R * H) return;
    const int D = per * WARP, r = task / H, h = task % H, E = H * D;
    const int4 mv = meta[r];
    const RowMeta m = {mv.x, mv.y, mv.z, mv.w};
    const float scale = rsqrtf((float)D);
    float q[per], acc[per];
    for (int t = 0; t < per; ++t) {
        q[t] = qkv[(size_t)r * 3 * E + h * D + lane + t * WARP] * scale;
        acc[t] = 0.f;
    }
    float mx = -INFINITY, sum = 0.f;
    const int n = keys_of(m, r);
    for (int j = 0; j < n; ++j) {
        const float *k = qkv + (size_t)key_at(m, j) * 3 * E + E + h * D;
        float s = 0.f;
        for (int t = 0; t < per; ++t) s += q[t] * k[lane + t * WARP];
        s = warp_sum(s);
        const float nm = fmaxf(mx, s), old = __expf(mx - nm), p = __expf(s - nm);
        const float *v = k + E;
        for (int t = 0; t < per; ++t) acc[t] = acc[t] * old + p * v[lane + t * WARP];
        sum = sum * old + p;
        mx = nm;
    }
    const float inv = 1.f / sum;
    for (int t = 0; t < per; ++t) y[(size_t)r * E + h * D + lane + t * WARP] = acc[t] * inv;
    if (lane == 0) lse[task] = mx + logf(sum);
}

// dq part of dqkv (R, 3E): dq = Σ_j p_j (dy·v_j − Δ) k_j / √D, Δ = dy·y, p_j recomputed from
// lse. A warp per (row, head). Grid ceil(R·H / 8), block 256.
template <int per>
__device__ void attention_bwd_dq(float *__restrict__ dqkv, const float *__restrict__ dy,
                                 const float *__restrict__ y, const float *__restrict__ qkv,
                                 const float *__restrict__ lse, const int4 *__restrict__ meta,
                                 int R, int H) {
    const int task = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (task >= R * H) return;
    const int D = per * WARP, r = task / H, h = task % H, E = H * D;
    const int4 mv = meta[r];
    const RowMeta m = {mv.x, mv.y, mv.z, mv.w};
    const float scale = rsqrtf((float)D);
    float q[per], g[per], dq[per];
    float delta = 0.f;
    for (int t = 0; t < per; ++t) {
        const size_t at = (size_t)r * E + h * D + lane + t * WARP;
        q[t] = qkv[(size_t)r * 3 * E + h * D + lane + t * WARP] * scale;
        g[t] = dy[at];
        delta += g[t] * y[at];
        dq[t] = 0.f;
    }
    delta = warp_sum(delta);
    const float l = lse[task];
    const int n = keys_of(m, r);
    for (int j = 0; j < n; ++j) {
        const float *k = qkv + (size_t)key_at(m, j) * 3 * E + E + h * D, *v = k + E;
        float s = 0.f, dp = 0.f;
        for (int t = 0; t < per; ++t) {
            s += q[t] * k[lane + t * WARP];
            dp += g[t] * v[lane + t * WARP];
        }
        s = warp_sum(s);
        dp = warp_sum(dp);
        const float ds = __expf(s - l) * (dp - delta) * scale;
        for (int t = 0; t < per; ++t) dq[t] += ds * k[lane + t * WARP];
    }
    for (int t = 0; t < per; ++t) dqkv[(size_t)r * 3 * E + h * D + lane + t * WARP] = dq[t];
}

// dk and dv parts of dqkv (R, 3E) for key row j: over the query rows i in [j, q_end) that
// see it, dk_j = Σ_i ds_ij q_i / √D and dv_j = Σ_i p_ij dy_i, with p, ds as in
// attention_bwd_dq (Δ_i recomputed). A warp per (key row, head), no atomics.
// Grid ceil(R·H / 8), block 256.
template <int per>
__device__ void attention_bwd_dkv(float *__restrict__ dqkv, const float *__restrict__ dy,
                                  const float *__restrict__ y, const float *__restrict__ qkv,
                                  const float *__restrict__ lse, const int4 *__restrict__ meta,
                                  int R, int H) {
    const int task = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (task >= R * H) return;
    const int D = per * WARP, j = task / H, h = task % H, E = H * D;
    const float scale = rsqrtf((float)D);
    float k[per], v[per], dk[per], dv[per];
    for (int t = 0; t < per; ++t) {
        k[t] = qkv[(size_t)j * 3 * E + E + h * D + lane + t * WARP];
        v[t] = qkv[(size_t)j * 3 * E + 2 * E + h * D + lane + t * WARP];
        dk[t] = 0.f;
        dv[t] = 0.f;
    }
    const int q_end = meta[j].w;
    for (int i = j; i < q_end; ++i) {
        const float *q = qkv + (size_t)i * 3 * E + h * D;
        const float *g = dy + (size_t)i * E + h * D, *yi = y + (size_t)i * E + h * D;
        float s = 0.f, dp = 0.f, delta = 0.f;
        for (int t = 0; t < per; ++t) {
            const int c = lane + t * WARP;
            s += q[c] * k[t];
            dp += g[c] * v[t];
            delta += g[c] * yi[c];
        }
        s = warp_sum(s) * scale;
        dp = warp_sum(dp);
        delta = warp_sum(delta);
        const float p = __expf(s - lse[(size_t)i * H + h]), ds = p * (dp - delta) * scale;
        for (int t = 0; t < per; ++t) {
            const int c = lane + t * WARP;
            dk[t] += ds * q[c];
            dv[t] += p * g[c];
        }
    }
    for (int t = 0; t < per; ++t) {
        dqkv[(size_t)j * 3 * E + E + h * D + lane + t * WARP] = dk[t];
        dqkv[(size_t)j * 3 * E + 2 * E + h * D + lane + t * WARP] = dv[t];
    }
}

#define ATTENTION_KERNELS(PER, SUFFIX)                                                       \
    extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)                      \
        attention_fwd_##SUFFIX(float *y, float *lse, const float *qkv, const int4 *meta, int R, \
                               int H) {                                                      \
        attention_fwd<PER>(y, lse, qkv, meta, R, H);                                         \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)                      \
        attention_bwd_dq_##SUFFIX(float *dqkv, const float *dy, const float *y,               \
                                  const float *qkv, const float *lse, const int4 *meta, int R, \
                                  int H) {                                                   \
        attention_bwd_dq<PER>(dqkv, dy, y, qkv, lse, meta, R, H);                            \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)                      \
        attention_bwd_dkv_##SUFFIX(float *dqkv, const float *dy, const float *y,              \
                                   const float *qkv, const float *lse, const int4 *meta,      \
                                   int R, int H) {                                           \
        attention_bwd_dkv<PER>(dqkv, dy, y, qkv, lse, meta, R, H);                           \
    }

ATTENTION_KERNELS(1, d32)
ATTENTION_KERNELS(2, d64)
ATTENTION_KERNELS(4, d128)

// ---------------------------------------------------------------------------------------
// Tiled attention (the trial family step_attention_tiles): a block per (tile, head), a tile
// being up to TILE consecutive rows of one segment (a prompt, or one completion: rows that
// share their metadata), 8 warps of 4 rows each. The forward and dq walk the tile's keys
// (the prefix, then its own rows up to the tile's last) CHUNK at a time through shared
// memory, each chunk read from device memory once for the whole tile instead of once per
// row; dkv walks the query rows that see the tile's keys likewise. Within a chunk a lane
// takes one key (or query row) for the scores, read from a row padded to D + 1 floats (no
// bank conflicts), and one value of D for the sums. The same maths as the warp kernels
// above, in the same f32: only the order of some sums differs. D = 32 or 64.
// TILE is rookworld_train's `cuda::attention::TILE` (the rows of Packed::row_tiles), and
// TILE_THREADS its `TILE_THREADS`.
#define TILE 32
#define CHUNK 32
#define TILE_THREADS 256
#define TILE_ROWS_PER_WARP (TILE / (TILE_THREADS / WARP))
// rows[] (CHUNK entries) also holds a tile's rows; the first TILE threads write them; the
// warps share the tile's rows evenly.
static_assert(TILE <= CHUNK, "rows[] holds a tile's rows");
static_assert(TILE <= TILE_THREADS, "a thread per row of the tile writes rows[]");
static_assert(TILE % (TILE_THREADS / WARP) == 0, "every warp takes as many rows");

// `count` rows of D floats into shared memory at `dst` (`stride` apart), row i being
// `src` row rows[i] times `scale`, zeros from row `n` on. Every thread of the block takes
// a share.
template <int D>
__device__ __forceinline__ void load_rows(float *dst, int stride, const float *__restrict__ src,
                                          int src_stride, const int *rows, int n, int count,
                                          float scale) {
    for (int i = threadIdx.x; i < count * D; i += TILE_THREADS) {
        const int r = i / D, d = i % D;
        dst[r * stride + d] = r < n ? src[(size_t)rows[r] * src_stride + d] * scale : 0.f;
    }
}

// Row index of the tile's k-th visible key: the prefix p0..p1, then o0.. .
__device__ __forceinline__ int tile_key(const RowMeta &m, int k) {
    const int prefix = m.p1 - m.p0;
    return k < prefix ? m.p0 + k : m.o0 + (k - prefix);
}

// The block's tile (tiles[blockIdx.x]): rows first..first + n of one segment, their
// metadata, and the keys they see (the prefix, then their own rows up to the last).
struct TileRows {
    int first, n;
    RowMeta m;
    int prefix, keys;
};

__device__ __forceinline__ TileRows tile_rows(const int4 *__restrict__ meta,
                                              const int2 *__restrict__ tiles) {
    const int2 t = tiles[blockIdx.x];
    const int4 mv = meta[t.x];
    const RowMeta m = {mv.x, mv.y, mv.z, mv.w};
    const int prefix = m.p1 - m.p0;
    return {t.x, t.y, m, prefix, prefix + (t.x + t.y - m.o0)};
}

template <int D>
__device__ void attention_tile_fwd(float *__restrict__ y, float *__restrict__ lse,
                                   const float *__restrict__ qkv, const int4 *__restrict__ meta,
                                   const int2 *__restrict__ tiles, int H) {
    constexpr int PER = D / WARP;
    __shared__ float sq[TILE * D], sk[CHUNK * (D + 1)], sv[CHUNK * D];
    __shared__ int rows[CHUNK];
    const auto [first, n, m, prefix, keys] = tile_rows(meta, tiles);
    const int h = blockIdx.y, E = H * D;
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const float scale = rsqrtf((float)D);
    if (threadIdx.x < TILE) rows[threadIdx.x] = first + threadIdx.x;
    __syncthreads();
    load_rows<D>(sq, D, qkv + h * D, 3 * E, rows, n, TILE, scale);
    float mx[TILE_ROWS_PER_WARP], sum[TILE_ROWS_PER_WARP], acc[TILE_ROWS_PER_WARP][PER];
    #pragma unroll
    for (int a = 0; a < TILE_ROWS_PER_WARP; ++a) {
        mx[a] = -INFINITY;
        sum[a] = 0.f;
        #pragma unroll
        for (int t = 0; t < PER; ++t) acc[a][t] = 0.f;
    }
    for (int c0 = 0; c0 < keys; c0 += CHUNK) {
        const int count = min(CHUNK, keys - c0);
        __syncthreads();  // the last chunk's readers are done, and sq is written
        if (threadIdx.x < CHUNK) rows[threadIdx.x] = tile_key(m, c0 + min((int)threadIdx.x, count - 1));
        __syncthreads();
        load_rows<D>(sk, D + 1, qkv + E + h * D, 3 * E, rows, count, CHUNK, 1.f);
        load_rows<D>(sv, D, qkv + 2 * E + h * D, 3 * E, rows, count, CHUNK, 1.f);
        __syncthreads();
        const int key = c0 + lane;  // this lane's key of the chunk
        const int key_row = lane < count ? tile_key(m, key) : 0;
        #pragma unroll
        for (int a = 0; a < TILE_ROWS_PER_WARP; ++a) {
            const int q = w * TILE_ROWS_PER_WARP + a;
            if (q >= n) continue;  // warp-uniform (and so are the rows after it)
            const int r = first + q;
            float s = 0.f;
            for (int d = 0; d < D; ++d) s += sq[q * D + d] * sk[lane * (D + 1) + d];
            const bool visible = lane < count && (key < prefix || key_row <= r);
            s = visible ? s : -INFINITY;
            const float nm = fmaxf(mx[a], warp_max(s));
            if (nm == -INFINITY) continue;  // no key of this row yet
            const float p = visible ? __expf(s - nm) : 0.f, old = __expf(mx[a] - nm);
            sum[a] = sum[a] * old + warp_sum(p);
            #pragma unroll
            for (int t = 0; t < PER; ++t) acc[a][t] *= old;
            for (int j = 0; j < count; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
                #pragma unroll
                for (int t = 0; t < PER; ++t) acc[a][t] += pj * sv[j * D + lane + t * WARP];
            }
            mx[a] = nm;
        }
    }
    #pragma unroll
    for (int a = 0; a < TILE_ROWS_PER_WARP; ++a) {
        const int q = w * TILE_ROWS_PER_WARP + a;
        if (q >= n) continue;
        const int r = first + q;
        const float inv = 1.f / sum[a];
        #pragma unroll
        for (int t = 0; t < PER; ++t) y[(size_t)r * E + h * D + lane + t * WARP] = acc[a][t] * inv;
        if (lane == 0) lse[(size_t)r * H + h] = mx[a] + logf(sum[a]);
    }
}

// dq of the tile's rows (as attention_bwd_dq), the keys a chunk at a time.
template <int D>
__device__ void attention_tile_dq(float *__restrict__ dqkv, const float *__restrict__ dy,
                                  const float *__restrict__ y, const float *__restrict__ qkv,
                                  const float *__restrict__ lse, const int4 *__restrict__ meta,
                                  const int2 *__restrict__ tiles, int H) {
    constexpr int PER = D / WARP;
    __shared__ float sq[TILE * D], sg[TILE * D], sk[CHUNK * (D + 1)], sv[CHUNK * (D + 1)];
    __shared__ int rows[CHUNK];
    const auto [first, n, m, prefix, keys] = tile_rows(meta, tiles);
    const int h = blockIdx.y, E = H * D;
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const float scale = rsqrtf((float)D);
    if (threadIdx.x < TILE) rows[threadIdx.x] = first + threadIdx.x;
    __syncthreads();
    load_rows<D>(sq, D, qkv + h * D, 3 * E, rows, n, TILE, scale);
    load_rows<D>(sg, D, dy + h * D, E, rows, n, TILE, 1.f);
    float delta[TILE_ROWS_PER_WARP], l[TILE_ROWS_PER_WARP], dq[TILE_ROWS_PER_WARP][PER];
    #pragma unroll
    for (int a = 0; a < TILE_ROWS_PER_WARP; ++a) {
        const int q = min(w * TILE_ROWS_PER_WARP + a, n - 1), r = first + q;
        float dl = 0.f;
        #pragma unroll
        for (int t = 0; t < PER; ++t) {
            const size_t at = (size_t)r * E + h * D + lane + t * WARP;
            dl += dy[at] * y[at];
            dq[a][t] = 0.f;
        }
        delta[a] = warp_sum(dl);
        l[a] = lse[(size_t)r * H + h];
    }
    for (int c0 = 0; c0 < keys; c0 += CHUNK) {
        const int count = min(CHUNK, keys - c0);
        __syncthreads();
        if (threadIdx.x < CHUNK) rows[threadIdx.x] = tile_key(m, c0 + min((int)threadIdx.x, count - 1));
        __syncthreads();
        load_rows<D>(sk, D + 1, qkv + E + h * D, 3 * E, rows, count, CHUNK, 1.f);
        load_rows<D>(sv, D + 1, qkv + 2 * E + h * D, 3 * E, rows, count, CHUNK, 1.f);
        __syncthreads();
        const int key = c0 + lane;
        const int key_row = lane < count ? tile_key(m, key) : 0;
        #pragma unroll
        for (int a = 0; a < TILE_ROWS_PER_WARP; ++a) {
            const int q = w * TILE_ROWS_PER_WARP + a;
            if (q >= n) continue;
            const int r = first + q;
            float s = 0.f, dp = 0.f;
            for (int d = 0; d < D; ++d) {
                s += sq[q * D + d] * sk[lane * (D + 1) + d];
                dp += sg[q * D + d] * sv[lane * (D + 1) + d];
            }
            const bool visible = lane < count && (key < prefix || key_row <= r);
            const float ds = visible ? __expf(s - l[a]) * (dp - delta[a]) * scale : 0.f;
            for (int j = 0; j < count; ++j) {
                const float dsj = __shfl_sync(0xffffffffu, ds, j);
                #pragma unroll
                for (int t = 0; t < PER; ++t) dq[a][t] += dsj * sk[j * (D + 1) + lane + t * WARP];
            }
        }
    }
    #pragma unroll
    for (int a = 0; a < TILE_ROWS_PER_WARP; ++a) {
        const int q = w * TILE_ROWS_PER_WARP + a;
        if (q >= n) continue;
        const int r = first + q;
        #pragma unroll
        for (int t = 0; t < PER; ++t) dqkv[(size_t)r * 3 * E + h * D + lane + t * WARP] = dq[a][t];
    }
}

// dk and dv of the tile's rows as keys (as attention_bwd_dkv): the query rows that see them,
// first..q_end of the segment's metadata (row i sees key j when i ≥ j), a chunk at a time.
template <int D>
__device__ void attention_tile_dkv(float *__restrict__ dqkv, const float *__restrict__ dy,
                                   const float *__restrict__ y, const float *__restrict__ qkv,
                                   const float *__restrict__ lse, const int4 *__restrict__ meta,
                                   const int2 *__restrict__ tiles, int H) {
    constexpr int PER = D / WARP;
    __shared__ float sk[TILE * D], sv[TILE * D], sq[CHUNK * (D + 1)], sg[CHUNK * (D + 1)];
    __shared__ float sl[CHUNK], sdelta[CHUNK];
    __shared__ int rows[CHUNK];
    const TileRows tile = tile_rows(meta, tiles);
    const int h = blockIdx.y, E = H * D, first = tile.first, n = tile.n, q_end = tile.m.q_end;
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const float scale = rsqrtf((float)D);
    if (threadIdx.x < TILE) rows[threadIdx.x] = first + threadIdx.x;
    __syncthreads();
    load_rows<D>(sk, D, qkv + E + h * D, 3 * E, rows, n, TILE, 1.f);
    load_rows<D>(sv, D, qkv + 2 * E + h * D, 3 * E, rows, n, TILE, 1.f);
    float dk[TILE_ROWS_PER_WARP][PER], dv[TILE_ROWS_PER_WARP][PER];
    #pragma unroll
    for (int a = 0; a < TILE_ROWS_PER_WARP; ++a)
        #pragma unroll
        for (int t = 0; t < PER; ++t) dk[a][t] = dv[a][t] = 0.f;
    for (int c0 = first; c0 < q_end; c0 += CHUNK) {
        const int count = min(CHUNK, q_end - c0);
        __syncthreads();
        if (threadIdx.x < CHUNK) rows[threadIdx.x] = c0 + min((int)threadIdx.x, count - 1);
        __syncthreads();
        load_rows<D>(sq, D + 1, qkv + h * D, 3 * E, rows, count, CHUNK, scale);
        load_rows<D>(sg, D + 1, dy + h * D, E, rows, count, CHUNK, 1.f);
        // Each query row's lse and Δ = dy · y (a warp per row).
        for (int i = w; i < CHUNK; i += TILE_THREADS / WARP) {
            float dl = 0.f;
            if (i < count) {
                #pragma unroll
                for (int t = 0; t < PER; ++t) {
                    const size_t at = (size_t)(c0 + i) * E + h * D + lane + t * WARP;
                    dl += dy[at] * y[at];
                }
            }
            dl = warp_sum(dl);
            if (lane == 0) {
                sdelta[i] = dl;
                sl[i] = i < count ? lse[(size_t)(c0 + i) * H + h] : 0.f;
            }
        }
        __syncthreads();
        const int qrow = c0 + lane;  // this lane's query row of the chunk
        #pragma unroll
        for (int a = 0; a < TILE_ROWS_PER_WARP; ++a) {
            const int k = w * TILE_ROWS_PER_WARP + a;
            if (k >= n) continue;
            const int j = first + k;
            float s = 0.f, dp = 0.f;
            for (int d = 0; d < D; ++d) {
                s += sq[lane * (D + 1) + d] * sk[k * D + d];
                dp += sg[lane * (D + 1) + d] * sv[k * D + d];
            }
            const bool visible = lane < count && qrow >= j;
            const float p = visible ? __expf(s - sl[lane]) : 0.f;
            const float ds = p * (dp - sdelta[lane]);  // × √D·(1/√D): sq holds q / √D
            for (int i = 0; i < count; ++i) {
                const float pi = __shfl_sync(0xffffffffu, p, i);
                const float dsi = __shfl_sync(0xffffffffu, ds, i);
                #pragma unroll
                for (int t = 0; t < PER; ++t) {
                    dv[a][t] += pi * sg[i * (D + 1) + lane + t * WARP];
                    dk[a][t] += dsi * sq[i * (D + 1) + lane + t * WARP];
                }
            }
        }
    }
    #pragma unroll
    for (int a = 0; a < TILE_ROWS_PER_WARP; ++a) {
        const int k = w * TILE_ROWS_PER_WARP + a;
        if (k >= n) continue;
        const int j = first + k;
        #pragma unroll
        for (int t = 0; t < PER; ++t) {
            dqkv[(size_t)j * 3 * E + E + h * D + lane + t * WARP] = dk[a][t];
            dqkv[(size_t)j * 3 * E + 2 * E + h * D + lane + t * WARP] = dv[a][t];
        }
    }
}

#define TILE_KERNELS(D)                                                                      \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS, 2)                            \
        attention_tile_fwd_d##D(float *y, float *lse, const float *qkv, const int4 *meta,    \
                                const int2 *tiles, int H) {                                  \
        attention_tile_fwd<D>(y, lse, qkv, meta, tiles, H);                                  \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS, 2)                            \
        attention_tile_dq_d##D(float *dqkv, const float *dy, const float *y, const float *qkv, \
                               const float *lse, const int4 *meta, const int2 *tiles, int H) { \
        attention_tile_dq<D>(dqkv, dy, y, qkv, lse, meta, tiles, H);                         \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(TILE_THREADS, 2)                            \
        attention_tile_dkv_d##D(float *dqkv, const float *dy, const float *y,                \
                                const float *qkv, const float *lse, const int4 *meta,        \
                                const int2 *tiles, int H) {                                  \
        attention_tile_dkv<D>(dqkv, dy, y, qkv, lse, meta, tiles, H);                        \
    }

TILE_KERNELS(32)
TILE_KERNELS(64)

// ---------------------------------------------------------------------------------------
// Attention on tensor cores (the trial family step_attention_mma): the tiled kernels' walk
// (a block per (tile, head), each chunk of keys — or, for the keys' gradients, of query
// rows — read once for the tile), with every product a warp matrix product of BF16
// operands and f32 sums (wmma, 16 × 16 × 16): Q·Kᵀ and dO·Vᵀ, P·V, dS·K, Pᵀ·dO and dSᵀ·Q.
// The operands are rounded to BF16 as they are staged in shared memory (q already times
// 1/√D; the probabilities P and the scores' gradients dS as they are written there); the
// softmax, its running max and sum, Δ = dO · O, and every accumulator stay f32. The sum
// of a row's probabilities is the sum of the rounded P that multiply V, so each output
// row is a weighted mean of the values. D = 16, 32 or 64 (rookworld_train's
// `launch::MMA_WIDTHS`: at 128 the forward's staging passes 48 KiB of shared memory).
//
// Fragments are read, multiplied and written whole, never element by element (CUDA
// leaves their layout to the GPU): per-row work goes through shared memory. Every
// fragment's address is 32-byte aligned and its leading dimension a multiple of 16 bytes:
// bf16 rows of D + 8, f32 score rows of CHUNK + 4, bf16 probability rows of CHUNK + 8,
// f32 output rows of D + 4 (the padding also spreads a fragment's rows across banks).
// Needs sm_80 (BF16 wmma); built for an older GPU the kernels are absent, and the family's
// start-up check turns the trial off.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define MMA_THREADS 128
#define MMA_WARPS (MMA_THREADS / WARP)
#define MMA_ROWS_PER_WARP (TILE / MMA_WARPS)
static_assert(TILE == 32 && CHUNK == 32, "a tile and a chunk are two fragments of 16 rows");

namespace mma_attention {

using namespace nvcuda;
using Bf16 = __nv_bfloat16;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
using RowA = wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major>;
using RowB = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::row_major>;
using ColB = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::col_major>;

constexpr int LS = CHUNK + 4;  // f32 rows of a (TILE, CHUNK) block of scores
constexpr int LP = CHUNK + 8;  // bf16 rows of a (TILE, CHUNK) block of P or dS
template <int D> __host__ __device__ constexpr int ld() { return D + 8; }  // bf16 rows of D values
template <int D> __host__ __device__ constexpr int lo() { return D + 4; }  // f32 rows of D values
// Output blocks of 16 × 16 of a (TILE, D) product, and how many each warp takes.
template <int D> __host__ __device__ constexpr int blocks() { return (TILE / 16) * (D / 16); }
template <int D> __host__ __device__ constexpr int per_warp() { return (blocks<D>() + MMA_WARPS - 1) / MMA_WARPS; }

// `count` rows of D floats into shared memory as BF16, `LD` apart, row i being `src` row
// rows[i] times `scale`, zeros from row `n` on. Every thread of the block takes a share.
template <int D>
__device__ __forceinline__ void stage(Bf16 *dst, const float *__restrict__ src, int src_stride,
                                      const int *rows, int n, int count, float scale) {
    for (int i = threadIdx.x; i < count * D; i += MMA_THREADS) {
        const int r = i / D, d = i % D;
        dst[r * ld<D>() + d] =
            __float2bfloat16(r < n ? src[(size_t)rows[r] * src_stride + d] * scale : 0.f);
    }
}

// The chunk of the tile's visible keys from key c0 (of `keys`): their rows into rows[]
// and their K and V (qkv's columns E.. and 2E.. from `head`, the head's q columns) staged
// into sk and sv, with a barrier before (the last chunk's readers are done) and after.
// Returns the chunk's keys.
template <int D>
__device__ __forceinline__ int stage_keys(Bf16 *sk, Bf16 *sv, int *rows,
                                          const float *__restrict__ head, const RowMeta &m,
                                          int c0, int keys, int E) {
    const int count = min(CHUNK, keys - c0);
    __syncthreads();
    if (threadIdx.x < CHUNK) rows[threadIdx.x] = tile_key(m, c0 + min((int)threadIdx.x, count - 1));
    __syncthreads();
    stage<D>(sk, head + E, 3 * E, rows, count, CHUNK, 1.f);
    stage<D>(sv, head + 2 * E, 3 * E, rows, count, CHUNK, 1.f);
    __syncthreads();
    return count;
}

// The (TILE, CHUNK) block a·bᵀ of two (·, D) BF16 operands staged row by row, into `out`
// (f32, LS apart): warp w the 16 × 16 block (w / 2, w % 2).
template <int D>
__device__ __forceinline__ void scores(float *out, const Bf16 *a, const Bf16 *b) {
    const int w = threadIdx.x / WARP, i0 = (w / 2) * 16, j0 = (w % 2) * 16;
    Acc s;
    wmma::fill_fragment(s, 0.f);
#pragma unroll
    for (int k = 0; k < D; k += 16) {
        RowA fa;
        ColB fb;
        wmma::load_matrix_sync(fa, a + i0 * ld<D>() + k, ld<D>());
        wmma::load_matrix_sync(fb, b + j0 * ld<D>() + k, ld<D>());
        wmma::mma_sync(s, fa, fb, s);
    }
    wmma::store_matrix_sync(out + i0 * LS + j0, s, LS, wmma::mem_row_major);
}

// acc[t] += p · v for the output blocks f = w + t · MMA_WARPS of the (TILE, D) product of
// p (TILE, CHUNK; BF16, LP apart) and v (CHUNK, D; BF16, ld apart): block f is rows
// (f % 2) · 16, columns (f / 2) · 16.
template <int D>
__device__ __forceinline__ void accumulate(Acc (&acc)[per_warp<D>()], const Bf16 *p,
                                           const Bf16 *v) {
    const int w = threadIdx.x / WARP;
#pragma unroll
    for (int t = 0; t < per_warp<D>(); ++t) {
        const int f = w + t * MMA_WARPS;
        if (f >= blocks<D>()) break;  // warp-uniform
        const int i0 = (f % 2) * 16, d0 = (f / 2) * 16;
#pragma unroll
        for (int k = 0; k < CHUNK; k += 16) {
            RowA fa;
            RowB fb;
            wmma::load_matrix_sync(fa, p + i0 * LP + k, LP);
            wmma::load_matrix_sync(fb, v + k * ld<D>() + d0, ld<D>());
            wmma::mma_sync(acc[t], fa, fb, acc[t]);
        }
    }
}

// The accumulators' blocks into `out` (f32, lo apart), as accumulate numbers them.
template <int D>
__device__ __forceinline__ void unload(float *out, const Acc (&acc)[per_warp<D>()]) {
    const int w = threadIdx.x / WARP;
#pragma unroll
    for (int t = 0; t < per_warp<D>(); ++t) {
        const int f = w + t * MMA_WARPS;
        if (f >= blocks<D>()) break;
        const int i0 = (f % 2) * 16, d0 = (f / 2) * 16;
        wmma::store_matrix_sync(out + i0 * lo<D>() + d0, acc[t], lo<D>(), wmma::mem_row_major);
    }
}

template <int D>
__device__ __forceinline__ void clear(Acc (&acc)[per_warp<D>()]) {
#pragma unroll
    for (int t = 0; t < per_warp<D>(); ++t) wmma::fill_fragment(acc[t], 0.f);
}

// y (R, E) and lse (R, H) of the tile's rows, as attention_tile_fwd. The output rows stay
// in shared memory (f32), rescaled there by each chunk's change of its row's running max
// before P·V is added: a fragment's rows are not a lane's to scale.
template <int D>
__device__ void fwd(float *__restrict__ y, float *__restrict__ lse, const float *__restrict__ qkv,
                    const int4 *__restrict__ meta, const int2 *__restrict__ tiles, int H) {
    __shared__ __align__(32) Bf16 sq[TILE * ld<D>()], sk[CHUNK * ld<D>()], sv[CHUNK * ld<D>()];
    __shared__ __align__(32) Bf16 sp[TILE * LP];
    __shared__ __align__(32) float ss[TILE * LS], so[TILE * lo<D>()];
    __shared__ float scorr[TILE], ssum[TILE];
    __shared__ int rows[CHUNK];
    const auto [first, n, m, prefix, keys] = tile_rows(meta, tiles);
    const int h = blockIdx.y, E = H * D;
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (threadIdx.x < TILE) rows[threadIdx.x] = first + threadIdx.x;
    for (int i = threadIdx.x; i < TILE * lo<D>(); i += MMA_THREADS) so[i] = 0.f;
    __syncthreads();
    stage<D>(sq, qkv + h * D, 3 * E, rows, n, TILE, rsqrtf((float)D));
    // Each warp's rows' running max and sum (the same on every lane).
    float mx[MMA_ROWS_PER_WARP], sum[MMA_ROWS_PER_WARP];
#pragma unroll
    for (int a = 0; a < MMA_ROWS_PER_WARP; ++a) mx[a] = -INFINITY, sum[a] = 0.f;
    for (int c0 = 0; c0 < keys; c0 += CHUNK) {
        const int count = stage_keys<D>(sk, sv, rows, qkv + h * D, m, c0, keys, E);
        scores<D>(ss, sq, sk);
        __syncthreads();
        // The online softmax, a warp per row, lane j the chunk's key j.
        const int key = c0 + lane;
        const int key_row = lane < count ? tile_key(m, key) : 0;
#pragma unroll
        for (int a = 0; a < MMA_ROWS_PER_WARP; ++a) {
            const int q = w * MMA_ROWS_PER_WARP + a, r = first + q;
            const bool visible = q < n && lane < count && (key < prefix || key_row <= r);
            const float s = visible ? ss[q * LS + lane] : -INFINITY;
            const float nm = fmaxf(mx[a], warp_max(s));
            float p = 0.f, corr = 1.f;
            if (nm != -INFINITY) {  // warp-uniform: a row with no key yet keeps its zeros
                p = visible ? __expf(s - nm) : 0.f;
                corr = __expf(mx[a] - nm);  // 0 while mx is -inf
                mx[a] = nm;
            }
            const Bf16 pb = __float2bfloat16(p);
            sp[q * LP + lane] = pb;
            sum[a] = sum[a] * corr + warp_sum(__bfloat162float(pb));
            if (lane == 0) scorr[q] = corr;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < TILE * D; i += MMA_THREADS)
            so[(i / D) * lo<D>() + i % D] *= scorr[i / D];
        __syncthreads();
        Acc o[per_warp<D>()];
#pragma unroll
        for (int t = 0; t < per_warp<D>(); ++t) {
            const int f = w + t * MMA_WARPS;
            if (f >= blocks<D>()) break;
            wmma::load_matrix_sync(o[t], so + (f % 2) * 16 * lo<D>() + (f / 2) * 16, lo<D>(),
                                   wmma::mem_row_major);
        }
        accumulate<D>(o, sp, sv);
        unload<D>(so, o);
    }
#pragma unroll
    for (int a = 0; a < MMA_ROWS_PER_WARP; ++a) {
        const int q = w * MMA_ROWS_PER_WARP + a;
        if (lane == 0) ssum[q] = sum[a];
        if (lane == 0 && q < n) lse[(size_t)(first + q) * H + h] = mx[a] + logf(sum[a]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n * D; i += MMA_THREADS) {
        const int q = i / D, d = i % D;
        y[(size_t)(first + q) * E + h * D + d] = so[q * lo<D>() + d] / ssum[q];
    }
}

// Each of `count` rows' lse and Δ = dO · O (f32, from device memory), a warp per row, into
// sl and sdelta; rows from `count` on get zeros.
template <int D>
__device__ __forceinline__ void row_terms(float *sl, float *sdelta, const float *__restrict__ dy,
                                          const float *__restrict__ y,
                                          const float *__restrict__ lse, int first, int count,
                                          int h, int H) {
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP, E = H * D;
    for (int i = w; i < TILE; i += MMA_WARPS) {
        float dl = 0.f;
        if (i < count)
            for (int d = lane; d < D; d += WARP) {
                const size_t at = (size_t)(first + i) * E + h * D + d;
                dl += dy[at] * y[at];
            }
        dl = warp_sum(dl);
        if (lane == 0) {
            sdelta[i] = dl;
            sl[i] = i < count ? lse[(size_t)(first + i) * H + h] : 0.f;
        }
    }
}

// Rows [0, n) of a (TILE, D) f32 block (lo apart) times `scale` into dqkv's columns
// `column`.. of rows first.., 3E apart.
template <int D>
__device__ __forceinline__ void write_rows(float *__restrict__ dqkv, const float *block, int first,
                                           int n, int column, int E, float scale) {
    for (int i = threadIdx.x; i < n * D; i += MMA_THREADS) {
        const int q = i / D, d = i % D;
        dqkv[(size_t)(first + q) * 3 * E + column + d] = block[q * lo<D>() + d] * scale;
    }
}

// dq of the tile's rows, as attention_tile_dq: per chunk of keys S = Q·Kᵀ and dP = dO·Vᵀ,
// dS = P ∘ (dP − Δ) with P = exp(S − lse) where visible, then dQ += dS·K (in registers).
template <int D>
__device__ void dq(float *__restrict__ dqkv, const float *__restrict__ dy,
                   const float *__restrict__ y, const float *__restrict__ qkv,
                   const float *__restrict__ lse, const int4 *__restrict__ meta,
                   const int2 *__restrict__ tiles, int H) {
    static_assert(TILE * lo<D>() <= 2 * TILE * LS, "the output's staging fits the scores'");
    __shared__ __align__(32) Bf16 sq[TILE * ld<D>()], sg[TILE * ld<D>()], sk[CHUNK * ld<D>()],
        sv[CHUNK * ld<D>()], sds[TILE * LP];
    __shared__ __align__(32) float sf[2 * TILE * LS];  // S and dP, then the output's staging
    __shared__ float sl[TILE], sdelta[TILE];
    __shared__ int rows[CHUNK];
    float *ss = sf, *sdp = sf + TILE * LS;
    const auto [first, n, m, prefix, keys] = tile_rows(meta, tiles);
    const int h = blockIdx.y, E = H * D;
    const float scale = rsqrtf((float)D);
    if (threadIdx.x < TILE) rows[threadIdx.x] = first + threadIdx.x;
    __syncthreads();
    stage<D>(sq, qkv + h * D, 3 * E, rows, n, TILE, scale);
    stage<D>(sg, dy + h * D, E, rows, n, TILE, 1.f);
    row_terms<D>(sl, sdelta, dy, y, lse, first, n, h, H);
    Acc acc[per_warp<D>()];
    clear<D>(acc);
    for (int c0 = 0; c0 < keys; c0 += CHUNK) {
        const int count = stage_keys<D>(sk, sv, rows, qkv + h * D, m, c0, keys, E);
        scores<D>(ss, sq, sk);
        scores<D>(sdp, sg, sv);
        __syncthreads();
        for (int i = threadIdx.x; i < TILE * CHUNK; i += MMA_THREADS) {
            const int q = i / CHUNK, j = i % CHUNK, key = c0 + j;
            float ds = 0.f;
            if (q < n && j < count && (key < prefix || tile_key(m, key) <= first + q))
                ds = __expf(ss[q * LS + j] - sl[q]) * (sdp[q * LS + j] - sdelta[q]);
            sds[q * LP + j] = __float2bfloat16(ds);
        }
        __syncthreads();
        accumulate<D>(acc, sds, sk);
    }
    __syncthreads();  // the last chunk's scores are read: sf becomes the staging
    unload<D>(sf, acc);
    __syncthreads();
    write_rows<D>(dqkv, sf, first, n, h * D, E, scale);
}

// dk and dv of the tile's rows as keys, as attention_tile_dkv: per chunk of the query
// rows that see them (first..q_end), Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, Pᵀ = exp(Sᵀ − lse) where
// visible and dSᵀ = Pᵀ ∘ (dPᵀ − Δ), then dV += Pᵀ·dO and dK += dSᵀ·Q (q already times
// 1/√D), both in registers.
template <int D>
__device__ void dkv(float *__restrict__ dqkv, const float *__restrict__ dy,
                    const float *__restrict__ y, const float *__restrict__ qkv,
                    const float *__restrict__ lse, const int4 *__restrict__ meta,
                    const int2 *__restrict__ tiles, int H) {
    static_assert(TILE * lo<D>() <= 2 * TILE * LS, "the output's staging fits the scores'");
    __shared__ __align__(32) Bf16 sk[TILE * ld<D>()], sv[TILE * ld<D>()], sq[CHUNK * ld<D>()],
        sg[CHUNK * ld<D>()], sp[TILE * LP], sds[TILE * LP];
    __shared__ __align__(32) float sf[2 * TILE * LS];  // Sᵀ and dPᵀ, then the staging
    __shared__ float sl[CHUNK], sdelta[CHUNK];
    __shared__ int rows[CHUNK];
    float *ss = sf, *sdp = sf + TILE * LS;
    const TileRows tile = tile_rows(meta, tiles);
    const int h = blockIdx.y, E = H * D, first = tile.first, n = tile.n, q_end = tile.m.q_end;
    const float scale = rsqrtf((float)D);
    if (threadIdx.x < TILE) rows[threadIdx.x] = first + threadIdx.x;
    __syncthreads();
    stage<D>(sk, qkv + E + h * D, 3 * E, rows, n, TILE, 1.f);
    stage<D>(sv, qkv + 2 * E + h * D, 3 * E, rows, n, TILE, 1.f);
    Acc dk[per_warp<D>()], dv[per_warp<D>()];
    clear<D>(dk);
    clear<D>(dv);
    for (int c0 = first; c0 < q_end; c0 += CHUNK) {
        const int count = min(CHUNK, q_end - c0);
        __syncthreads();
        if (threadIdx.x < CHUNK) rows[threadIdx.x] = c0 + min((int)threadIdx.x, count - 1);
        __syncthreads();
        stage<D>(sq, qkv + h * D, 3 * E, rows, count, CHUNK, scale);
        stage<D>(sg, dy + h * D, E, rows, count, CHUNK, 1.f);
        row_terms<D>(sl, sdelta, dy, y, lse, c0, count, h, H);
        __syncthreads();
        scores<D>(ss, sk, sq);
        scores<D>(sdp, sv, sg);
        __syncthreads();
        for (int i = threadIdx.x; i < TILE * CHUNK; i += MMA_THREADS) {
            const int k = i / CHUNK, j = i % CHUNK;
            float p = 0.f, ds = 0.f;
            if (k < n && j < count && c0 + j >= first + k) {
                p = __expf(ss[k * LS + j] - sl[j]);
                ds = p * (sdp[k * LS + j] - sdelta[j]);
            }
            sp[k * LP + j] = __float2bfloat16(p);
            sds[k * LP + j] = __float2bfloat16(ds);
        }
        __syncthreads();
        accumulate<D>(dv, sp, sg);
        accumulate<D>(dk, sds, sq);
    }
    __syncthreads();
    unload<D>(sf, dk);
    __syncthreads();
    write_rows<D>(dqkv, sf, first, n, E + h * D, E, 1.f);
    __syncthreads();
    unload<D>(sf, dv);
    __syncthreads();
    write_rows<D>(dqkv, sf, first, n, 2 * E + h * D, E, 1.f);
}

}  // namespace mma_attention

#define MMA_KERNELS(D)                                                                       \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                \
        attention_mma_fwd_d##D(float *y, float *lse, const float *qkv, const int4 *meta,     \
                               const int2 *tiles, int H) {                                   \
        mma_attention::fwd<D>(y, lse, qkv, meta, tiles, H);                                  \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                \
        attention_mma_dq_d##D(float *dqkv, const float *dy, const float *y, const float *qkv, \
                              const float *lse, const int4 *meta, const int2 *tiles, int H) { \
        mma_attention::dq<D>(dqkv, dy, y, qkv, lse, meta, tiles, H);                         \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                \
        attention_mma_dkv_d##D(float *dqkv, const float *dy, const float *y,                 \
                               const float *qkv, const float *lse, const int4 *meta,         \
                               const int2 *tiles, int H) {                                   \
        mma_attention::dkv<D>(dqkv, dy, y, qkv, lse, meta, tiles, H);                        \
    }

MMA_KERNELS(16)
MMA_KERNELS(32)
MMA_KERNELS(64)
#endif

// A block's sum and max of one value per thread (a multiple of 32 threads, at most
// HEAD_THREADS); every thread gets the result.
__device__ float block_sum(float v, float *shared) {
    v = warp_sum(v);
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    __syncthreads();
    if (lane == 0) shared[w] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / WARP) ? shared[lane] : 0.f;
    return warp_sum(v);
}

__device__ float block_max(float v, float *shared) {
    v = warp_max(v);
    const int w = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    __syncthreads();
    if (lane == 0) shared[w] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / WARP) ? shared[lane] : -INFINITY;
    return warp_max(v);
}

// One row of the head's logits (V, before the temperature) as z = logits / τ: its max and
// Σ exp(z − max), and (with `want_sz`) Σ exp(z − max) z, every thread getting them.
__device__ void head_row_stats(const float *__restrict__ row, int V, float inv_t, float *shared,
                               float &mx, float &s, float &sz, bool want_sz) {
    mx = -INFINITY;
    for (int v = threadIdx.x; v < V; v += HEAD_THREADS) mx = fmaxf(mx, row[v] * inv_t);
    mx = block_max(mx, shared);
    s = 0.f;
    sz = 0.f;
    for (int v = threadIdx.x; v < V; v += HEAD_THREADS) {
        const float z = row[v] * inv_t, e = __expf(z - mx);
        s += e;
        if (want_sz) sz += e * z;
    }
    s = block_sum(s, shared);
    if (want_sz) sz = block_sum(sz, shared);
}

// One block of rows of the head: logits (m, V; rows ld apart) (h · Wᵀ, before the
// temperature) → for each row n, logp[n] = z_y − lse and (entropy ≠ null) entropy[n] =
// lse − Σ p z, z = logits / τ. A block per row. Grid m, block HEAD_THREADS.
extern "C" __global__ void __launch_bounds__(HEAD_THREADS)
    head_logprobs(const float *__restrict__ logits, const uint32_t *__restrict__ targets,
                  float *__restrict__ logp, float *__restrict__ entropy, int V, int ld,
                  float inv_t) {
    __shared__ float shared[HEAD_THREADS / WARP];
    const int n = blockIdx.x;
    const float *row = logits + (size_t)n * ld;
    float mx, s, sz;
    head_row_stats(row, V, inv_t, shared, mx, s, sz, entropy != nullptr);
    if (threadIdx.x == 0) {
        const float lse = mx + logf(s);
        logp[n] = row[targets[n]] * inv_t - lse;
        if (entropy) entropy[n] = lse - sz / s;
    }
}

// head_logprobs, and then the row's probabilities p = softmax(logits / τ) in place of its
// logits, kept for head_grad_kept (the trial family step_head_kept). Grid m, block
// HEAD_THREADS.
extern "C" __global__ void __launch_bounds__(HEAD_THREADS)
    head_probs(float *__restrict__ logits, const uint32_t *__restrict__ targets,
               float *__restrict__ logp, float *__restrict__ entropy, int V, int ld, float inv_t) {
    __shared__ float shared[HEAD_THREADS / WARP];
    const int n = blockIdx.x;
    float *row = logits + (size_t)n * ld;
    float mx, s, sz;
    head_row_stats(row, V, inv_t, shared, mx, s, sz, entropy != nullptr);
    const float target = row[targets[n]];
    __syncthreads();  // every thread has read the target's logit before it is overwritten
    if (threadIdx.x == 0) {
        const float lse = mx + logf(s);
        logp[n] = target * inv_t - lse;
        if (entropy) entropy[n] = lse - sz / s;
    }
    const float inv = 1.f / s;
    for (int v = threadIdx.x; v < V; v += HEAD_THREADS) row[v] = __expf(row[v] * inv_t - mx) * inv;
}

// In place, one block of rows: logits (m, V; rows ld apart) → d_{n,v} = g_n (1[v = y_n] −
// p_{n,v}) / τ, p = softmax(logits / τ) recomputed. A block per row. Grid m, block
// HEAD_THREADS.
extern "C" __global__ void __launch_bounds__(HEAD_THREADS)
    head_grad(float *__restrict__ logits, const uint32_t *__restrict__ targets,
              const float *__restrict__ g, int V, int ld, float inv_t) {
    __shared__ float shared[HEAD_THREADS / WARP];
    const int n = blockIdx.x;
    float *row = logits + (size_t)n * ld;
    float mx, s, sz;
    head_row_stats(row, V, inv_t, shared, mx, s, sz, false);
    const float inv = 1.f / s, gn = g[n] * inv_t;
    const uint32_t y = targets[n];
    for (int v = threadIdx.x; v < V; v += HEAD_THREADS) {
        const float p = __expf(row[v] * inv_t - mx) * inv;
        row[v] = gn * ((v == (int)y ? 1.f : 0.f) - p);
    }
}

// In place, rows of probabilities kept by head_probs (m, V; rows ld apart) → d_{n,v} =
// g_n (1[v = y_n] − p_{n,v}) / τ: one read and one write of each, nothing recomputed.
// Grid-stride over the m·V elements: grid ceil(m·V / 256) (at most 65,536), block 256.
extern "C" __global__ void head_grad_kept(float *__restrict__ probs,
                                          const uint32_t *__restrict__ targets,
                                          const float *__restrict__ g, int m, int V, int ld,
                                          float inv_t) {
    GRID_STRIDE(i, (size_t)m * V) {
        const size_t n = i / V;
        const int v = (int)(i % V);
        const float gn = g[n] * inv_t;
        float *p = probs + n * ld + v;
        *p = gn * ((v == (int)targets[n] ? 1.f : 0.f) - *p);
    }
}
