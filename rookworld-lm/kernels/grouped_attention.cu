// The decode step's attention over the grouped cache (rookworld-lm/src/grouped.rs), one
// launch per layer: each row attends to its prompt's keys (the prefix pool, shared by the
// group's rows) and to its own suffix, under one softmax, in f32.
//
// Grid (N groups, H heads, ceil(R / ROWS_PER_BLOCK)); block (32, ROWS_PER_BLOCK): one
// warp per row slot of the group. The block walks its group's prefix in tiles of 32 keys
// staged in shared memory once, so a prompt's keys and values are read from memory once
// per group and head (per 16 rows), not once per row. Each warp then walks its own row's
// suffix straight from memory. Both walks use the online softmax (running max m, sum l,
// output accumulator rescaled by exp(m_old - m_new)), lane j of a warp scoring key j of a
// tile, each lane accumulating output dims lane, lane + 32, ...
//
// The CPU reference is rookworld-lm/src/cpu_attention.rs (decode_attention): same
// geometry, one plain softmax per row and head.

#include <cuda_bf16.h>
#include <stdint.h>

#define WARP 32
#define ROWS_PER_BLOCK 16
#define MAX_D 128
#define MAX_PER_LANE (MAX_D / WARP)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float *p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float x) { *p = __float2bfloat16(x); }

__device__ __forceinline__ float warp_max(float x) {
    for (int o = WARP / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = WARP / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Online-softmax state of one (row, head): running max, running sum, output dims of a lane.
struct Online {
    float m, l;
    float acc[MAX_PER_LANE];
};

// Folds one tile of up to 32 scores (lane j holds key j's score, -inf when absent) into
// the state; value(j, i) is output dim lane + 32 i of key j.
template <typename Value>
__device__ __forceinline__ void fold_tile(Online &st, float s, int per_lane, Value value) {
    const float m_new = fmaxf(st.m, warp_max(s));
    if (m_new == -INFINITY) return;  // nothing visible yet
    const float corr = st.m == -INFINITY ? 0.f : __expf(st.m - m_new);
    const float p = s == -INFINITY ? 0.f : __expf(s - m_new);
    st.l = st.l * corr + warp_sum(p);
    // Loops to MAX_PER_LANE, unrolled, so the accumulator stays in registers.
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; ++i)
        if (i < per_lane) st.acc[i] *= corr;
    for (int j = 0; j < WARP; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
        if (pj == 0.f) continue;  // warp-uniform: pj is the same on every lane
#pragma unroll
        for (int i = 0; i < MAX_PER_LANE; ++i)
            if (i < per_lane) st.acc[i] += pj * value(j, i);
    }
    st.m = m_new;
}

// q: (B, H, D); pk, pv: (N, H, L, D); sk, sv: (cap, H, C, D); out: (B, H, D).
// scatter: (N * R) row of slot (g, k), B for an empty slot; row_start: (B) first suffix
// column of each row; group_pad: (N) padded columns at the start of each prefix.
template <typename T>
__device__ __forceinline__ void grouped_attention(const T *__restrict__ q, const T *__restrict__ pk,
                                  const T *__restrict__ pv, const T *__restrict__ sk,
                                  const T *__restrict__ sv, const uint32_t *__restrict__ scatter,
                                  const uint32_t *__restrict__ row_start,
                                  const uint32_t *__restrict__ group_pad, T *__restrict__ out,
                                  int B, int H, int D, int L, int C, int R, int cursor,
                                  float scale) {
    __shared__ float s_q[ROWS_PER_BLOCK][MAX_D];
    __shared__ float s_k[WARP][MAX_D + 1];  // +1: lanes read rows, avoid bank conflicts
    __shared__ float s_v[WARP][MAX_D];

    const int g = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.y, lane = threadIdx.x;
    const int warps = blockDim.y;
    const int tid = warp * WARP + lane, threads = warps * WARP;
    const int slot = blockIdx.z * warps + warp;
    const uint32_t row = slot < R ? scatter[g * R + slot] : (uint32_t)B;
    const bool live = row < (uint32_t)B;
    const int per_lane = D / WARP;

    if (live)
        for (int d = lane; d < D; d += WARP) s_q[warp][d] = to_f32(q[((size_t)row * H + h) * D + d]) * scale;
    __syncwarp();  // every lane reads the whole query (also when no prefix tile syncs the block)

    Online st;
    st.m = -INFINITY;
    st.l = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; ++i) st.acc[i] = 0.f;

    // The group's prefix, shared by the block's rows.
    const size_t prefix_base = ((size_t)g * H + h) * L * D;
    for (int j0 = group_pad[g]; j0 < L; j0 += WARP) {
        const int n = min(WARP, L - j0);
        __syncthreads();  // the previous tile is consumed (and s_q written, first time)
        for (int e = tid; e < n * D; e += threads) {
            const int j = e / D, d = e % D;
            const size_t at = prefix_base + (size_t)(j0 + j) * D + d;
            s_k[j][d] = to_f32(pk[at]);
            s_v[j][d] = to_f32(pv[at]);
        }
        __syncthreads();
        if (!live) continue;
        float s = -INFINITY;
        if (lane < n) {
            s = 0.f;
            for (int d = 0; d < D; ++d) s += s_q[warp][d] * s_k[lane][d];
        }
        fold_tile(st, s, per_lane, [&](int j, int i) { return s_v[j][lane + WARP * i]; });
    }
    if (!live) return;

    // The row's own suffix, columns row_start..=cursor.
    const size_t suffix_base = ((size_t)row * H + h) * C * D;
    for (int c0 = row_start[row]; c0 <= cursor; c0 += WARP) {
        const int c = c0 + lane;
        float s = -INFINITY;
        if (c <= cursor) {
            s = 0.f;
            const T *key = sk + suffix_base + (size_t)c * D;
            for (int d = 0; d < D; ++d) s += s_q[warp][d] * to_f32(key[d]);
        }
        fold_tile(st, s, per_lane, [&](int j, int i) {
            return to_f32(sv[suffix_base + (size_t)(c0 + j) * D + lane + WARP * i]);
        });
    }

    const float inv = st.l > 0.f ? 1.f / st.l : 0.f;
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; ++i)
        if (i < per_lane) store(&out[((size_t)row * H + h) * D + lane + WARP * i], st.acc[i] * inv);
}

#define GROUPED_ATTENTION(NAME, T)                                                          \
    extern "C" __global__ void __launch_bounds__(WARP * ROWS_PER_BLOCK)                     \
        NAME(const T *q, const T *pk, const T *pv, const T *sk, const T *sv,               \
             const uint32_t *scatter, const uint32_t *row_start, const uint32_t *group_pad, \
             T *out, int B, int H, int D, int L, int C, int R, int cursor, float scale) {   \
        grouped_attention<T>(q, pk, pv, sk, sv, scatter, row_start, group_pad, out, B, H,   \
                             D, L, C, R, cursor, scale);                                    \
    }

GROUPED_ATTENTION(grouped_attention_f32, float)
GROUPED_ATTENTION(grouped_attention_bf16, __nv_bfloat16)
