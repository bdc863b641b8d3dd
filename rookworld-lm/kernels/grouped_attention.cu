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

// ---------------------------------------------------------------------------------------
// grouped_attention_split: the same attention with every key of a row split across the
// warps of a block and read in 16-byte loads, for a cache walk near the memory bandwidth.
//
// Grid (N groups, H heads, R row slots); block (32, SPLIT_WARPS): one block per (row,
// head). A row's keys are its prompt's (prefix columns group_pad..L-1, shared by the
// group's rows: read again by each row, from L2) then its own suffix (row_start..=cursor),
// numbered t = 0, 1, ... A key is LPK = D / VEC lanes (VEC elements of 16 bytes each: 8
// bf16 or 4 f32), so a warp reads KPW = 32 / LPK keys per pass, and the block's warps
// take interleaved passes, two at a time (both passes' loads issued before either is
// used). Each group of LPK lanes keeps its own online softmax over the keys it sees
// (running max m, sum l, its VEC output dims); the states are merged across the warp's
// key groups with shuffles, then across warps in shared memory, and lanes 0..LPK-1 of the
// first warp write the row's output. Same arguments as grouped_attention; the host
// launches it when D / VEC is a power of two up to 32 and every buffer is 16-byte
// aligned, else grouped_attention.

#define SPLIT_WARPS 4
#define SPLIT_MAX_D 256
#define FULL_MASK 0xffffffffu

// VEC elements of T at p (16-byte aligned) as f32.
__device__ __forceinline__ void load16(const float *p, float (&out)[4]) {
    const float4 v = *reinterpret_cast<const float4 *>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
__device__ __forceinline__ void load16(const __nv_bfloat16 *p, float (&out)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4 *>(p);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 pair;
        memcpy(&pair, &words[i], sizeof pair);
        const float2 f = __bfloat1622float2(pair);
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void store16(float *p, const float (&v)[4]) {
    *reinterpret_cast<float4 *>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store16(__nv_bfloat16 *p, const float (&v)[8]) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        memcpy(&words[i], &pair, sizeof pair);
    }
    *reinterpret_cast<uint4 *>(p) = make_uint4(words[0], words[1], words[2], words[3]);
}

// Online-softmax state of one key group's lane: running max, sum, VEC output dims.
template <int VEC>
struct Split {
    float m, l, acc[VEC];
};

// Folds key score s with value dims v into st (s finite).
template <int VEC>
__device__ __forceinline__ void fold_key(Split<VEC> &st, float s, const float (&v)[VEC]) {
    const float m_new = fmaxf(st.m, s);
    const float corr = __expf(st.m - m_new);  // 0 while st.m is -inf
    const float p = __expf(s - m_new);
    st.l = st.l * corr + p;
#pragma unroll
    for (int i = 0; i < VEC; ++i) st.acc[i] = st.acc[i] * corr + p * v[i];
    st.m = m_new;
}

// Merges state (m2, l2, acc2) into st; either may have seen no key (m = -inf).
template <int VEC>
__device__ __forceinline__ void merge(Split<VEC> &st, float m2, float l2, const float (&acc2)[VEC]) {
    const float m = fmaxf(st.m, m2);
    const float c1 = st.m == -INFINITY ? 0.f : __expf(st.m - m);
    const float c2 = m2 == -INFINITY ? 0.f : __expf(m2 - m);
    st.l = st.l * c1 + l2 * c2;
#pragma unroll
    for (int i = 0; i < VEC; ++i) st.acc[i] = st.acc[i] * c1 + acc2[i] * c2;
    st.m = m;
}

// Row `row` (of group g, its prompt's first `pad` pool columns padding, its suffix from
// column `start`) at head blockIdx.y: the block's share of both kernels below.
template <typename T>
__device__ __forceinline__ void split_row(const T *__restrict__ q, const T *__restrict__ pk,
                                          const T *__restrict__ pv, const T *__restrict__ sk,
                                          const T *__restrict__ sv, T *__restrict__ out,
                                          uint32_t row, int g, int pad, int start, int H, int D,
                                          int L, int C, int cursor, float scale) {
    constexpr int VEC = 16 / sizeof(T);
    __shared__ float s_m[SPLIT_WARPS], s_l[SPLIT_WARPS];
    __shared__ float s_acc[SPLIT_WARPS][SPLIT_MAX_D];

    const int h = blockIdx.y;
    const int warp = threadIdx.y, lane = threadIdx.x;
    const int lpk = D / VEC, kpw = WARP / lpk;
    const int sub = lane / lpk, part = lane % lpk;

    float qv[VEC];
    load16(q + ((size_t)row * H + h) * D + part * VEC, qv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) qv[i] *= scale;

    const int prefix = L - pad;
    const int keys = prefix + (cursor >= start ? cursor - start + 1 : 0);
    const size_t p0 = (((size_t)g * H + h) * L + pad) * D + part * VEC;
    const size_t s0 = (((size_t)row * H + h) * C + start) * D + part * VEC;
    // Key t's offset in its buffer (prefix or suffix).
    auto key = [&](int t, const T *pbuf, const T *sbuf) -> const T * {
        return t < prefix ? pbuf + p0 + (size_t)t * D : sbuf + s0 + (size_t)(t - prefix) * D;
    };

    Split<VEC> st;
    st.m = -INFINITY;
    st.l = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) st.acc[i] = 0.f;

    const int stride = SPLIT_WARPS * kpw;  // keys per pass of the block
    // Warp-uniform bounds: every lane runs every shuffle; a lane past the keys folds
    // nothing.
    for (int base = warp * kpw; base < keys; base += 2 * stride) {
        const int t0 = base + sub, t1 = base + stride + sub;
        const bool ok0 = t0 < keys, ok1 = t1 < keys;
        float k0[VEC], v0[VEC], k1[VEC], v1[VEC];
        if (ok0) load16(key(t0, pk, sk), k0), load16(key(t0, pv, sv), v0);
        if (ok1) load16(key(t1, pk, sk), k1), load16(key(t1, pv, sv), v1);
        float s0_ = 0.f, s1_ = 0.f;
        if (ok0) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) s0_ += qv[i] * k0[i];
        }
        if (ok1) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) s1_ += qv[i] * k1[i];
        }
        for (int o = lpk / 2; o > 0; o /= 2) {
            s0_ += __shfl_xor_sync(FULL_MASK, s0_, o);
            s1_ += __shfl_xor_sync(FULL_MASK, s1_, o);
        }
        if (ok0) fold_key(st, s0_, v0);
        if (ok1) fold_key(st, s1_, v1);
    }

    // The warp's key groups into one state (lanes of one `part` hold the same dims).
    for (int o = lpk; o < WARP; o *= 2) {
        const float m2 = __shfl_xor_sync(FULL_MASK, st.m, o);
        const float l2 = __shfl_xor_sync(FULL_MASK, st.l, o);
        float acc2[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc2[i] = __shfl_xor_sync(FULL_MASK, st.acc[i], o);
        merge(st, m2, l2, acc2);
    }
    if (sub == 0) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) s_acc[warp][part * VEC + i] = st.acc[i];
        if (part == 0) s_m[warp] = st.m, s_l[warp] = st.l;
    }
    __syncthreads();
    if (warp != 0 || sub != 0) return;

    // The block's warps into the row's output.
    Split<VEC> all;
    all.m = s_m[0];
    all.l = s_l[0];
#pragma unroll
    for (int i = 0; i < VEC; ++i) all.acc[i] = s_acc[0][part * VEC + i];
    for (int w = 1; w < SPLIT_WARPS; ++w) {
        float acc2[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc2[i] = s_acc[w][part * VEC + i];
        merge(all, s_m[w], s_l[w], acc2);
    }
    const float inv = all.l > 0.f ? 1.f / all.l : 0.f;
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = all.acc[i] * inv;
    store16(out + ((size_t)row * H + h) * D + part * VEC, o);
}


template <typename T>
__device__ __forceinline__ void grouped_attention_split(
    const T *__restrict__ q, const T *__restrict__ pk, const T *__restrict__ pv,
    const T *__restrict__ sk, const T *__restrict__ sv, const uint32_t *__restrict__ scatter,
    const uint32_t *__restrict__ row_start, const uint32_t *__restrict__ group_pad,
    T *__restrict__ out, int B, int H, int D, int L, int C, int R, int cursor, float scale) {
    const int g = blockIdx.x, slot = blockIdx.z;
    const uint32_t row = scatter[g * R + slot];
    if (row >= (uint32_t)B) return;  // an empty slot: the whole block leaves
    split_row<T>(q, pk, pv, sk, sv, out, row, g, (int)group_pad[g], (int)row_start[row], H, D, L,
                 C, cursor, scale);
}

// row_attention: the split kernel for a captured decode step (rookworld-lm/src/cuda/graph.rs),
// whose launch cannot change from step to step. Grid (B rows of the step's bucket, H
// heads); block (32, SPLIT_WARPS). What changes lives in device memory: `step` holds the
// live rows and the cursor (rows past the live ones leave at once), `row_group` and
// `row_start` each row's group and first suffix column, `group_pad` each group's padding.
template <typename T>
__device__ __forceinline__ void row_attention(
    const T *__restrict__ q, const T *__restrict__ pk, const T *__restrict__ pv,
    const T *__restrict__ sk, const T *__restrict__ sv, const uint32_t *__restrict__ step,
    const uint32_t *__restrict__ row_group, const uint32_t *__restrict__ row_start,
    const uint32_t *__restrict__ group_pad, T *__restrict__ out, int H, int D, int L, int C,
    float scale) {
    const uint32_t row = blockIdx.x;
    if (row >= step[0]) return;
    const int g = (int)row_group[row];
    split_row<T>(q, pk, pv, sk, sv, out, row, g, (int)group_pad[g], (int)row_start[row], H, D, L,
                 C, (int)step[1], scale);
}

#define GROUPED_ATTENTION_SPLIT(NAME, T)                                                    \
    extern "C" __global__ void __launch_bounds__(WARP * SPLIT_WARPS)                        \
        NAME(const T *q, const T *pk, const T *pv, const T *sk, const T *sv,               \
             const uint32_t *scatter, const uint32_t *row_start, const uint32_t *group_pad, \
             T *out, int B, int H, int D, int L, int C, int R, int cursor, float scale) {   \
        grouped_attention_split<T>(q, pk, pv, sk, sv, scatter, row_start, group_pad, out,   \
                                   B, H, D, L, C, R, cursor, scale);                        \
    }

GROUPED_ATTENTION_SPLIT(grouped_attention_split_f32, float)
GROUPED_ATTENTION_SPLIT(grouped_attention_split_bf16, __nv_bfloat16)

#define ROW_ATTENTION(NAME, T)                                                              \
    extern "C" __global__ void __launch_bounds__(WARP * SPLIT_WARPS)                        \
        NAME(const T *q, const T *pk, const T *pv, const T *sk, const T *sv,               \
             const uint32_t *step, const uint32_t *row_group, const uint32_t *row_start,    \
             const uint32_t *group_pad, T *out, int H, int D, int L, int C, float scale) {  \
        row_attention<T>(q, pk, pv, sk, sv, step, row_group, row_start, group_pad, out, H,  \
                         D, L, C, scale);                                                   \
    }

ROW_ATTENTION(row_attention_f32, float)
ROW_ATTENTION(row_attention_bf16, __nv_bfloat16)
