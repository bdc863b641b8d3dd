// Token sampling on the device: one block per row of logits, so a decode step sends the
// host only each row's token and its log-probability (rookworld-lm/src/device_sampling.rs
// holds the CPU reference, step for step).
//
// Per row, with x_i the logits (NaN counts as -inf), m = max x:
// - greedy (temperature 0): the first argmax and x_c - log sum_i exp(x_i);
// - else z_i = (x_i - m) / T, w_i = exp(z_i). Top-k and top-p keep the tokens whose logit
//   is at least a threshold found by bisection on the logit's ordered bit pattern: top-k's
//   is the k-th largest logit, top-p's the largest whose kept mass reaches p of the mass
//   top-k kept. The token is the first i, in index order, whose running sum of kept w
//   exceeds u * sum(kept w), u the row's uniform draw from the host's seeded stream;
//   its log-probability is z_c - log sum(kept w).
// Sums are in f64, each thread over a contiguous chunk, combined in a fixed order, so a
// row's result depends only on its logits and its draw.
//
// The logits are f32 or BF16 (the head's output as it is: a BF16 value widens to f32
// exactly, so both give the same draw on the same values), rows `ld` elements apart
// (ld >= V: a view of the first V columns of a padded head's output).

#include <cuda_bf16.h>
#include <stdint.h>

#define THREADS 1024
#define WARPS (THREADS / 32)

__device__ __forceinline__ float sanitize(float x) { return isnan(x) ? -INFINITY : x; }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

// Order-preserving map of a float to an unsigned key (-inf lowest among non-NaN).
__device__ __forceinline__ uint32_t key_of(float x) {
    const uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Sum over the block, the same on every thread (warp sums combined in warp order).
template <typename T>
__device__ T block_total(T x, T *scratch) {
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < WARPS; ++w) total += scratch[w];
    return total;
}

__device__ uint32_t block_max(uint32_t x, uint32_t *scratch) {
    for (int o = 16; o > 0; o /= 2) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    uint32_t top = 0;
    for (int w = 0; w < WARPS; ++w) top = max(top, scratch[w]);
    return top;
}

// (value, index) of the largest value, the smallest index among equals.
__device__ void block_argmax(float &v, uint32_t &i, float *sv, uint32_t *si) {
    for (int o = 16; o > 0; o /= 2) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const uint32_t oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (int w = 1; w < WARPS; ++w)
        if (sv[w] > v || (sv[w] == v && si[w] < i)) { v = sv[w]; i = si[w]; }
}

// Inclusive prefix sum over the block's threads, in thread order.
__device__ double block_inclusive_scan(double x, double *scratch) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int o = 1; o < 32; o *= 2) {
        const double y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    double before = 0.0;
    for (int w = 0; w < warp; ++w) before += scratch[w];
    return before + x;
}

// logits: (B, V), row r at r * ld; draws: (B, 4) temperature, top-k, top-p, uniform;
// out: (3, B) token, log-probability's bits, status (0, or 1 for a row with no finite
// logit): one upload and one download per step.
template <typename T>
__device__ void sample_row(const T *__restrict__ logits, int V, long long ld,
                           const double *__restrict__ draws, uint32_t *__restrict__ out) {
    __shared__ double s_d[WARPS];
    __shared__ uint32_t s_u[WARPS];
    __shared__ float s_f[WARPS];
    __shared__ uint32_t s_chosen;

    const int row = blockIdx.x, t = threadIdx.x, B = gridDim.x;
    uint32_t *tokens = out, *status = out + 2 * B;
    float *logprobs = reinterpret_cast<float *>(out + B);
    const double *draw = draws + 4 * (size_t)row;
    const T *xs = logits + (size_t)row * (size_t)ld;
    auto x = [&](int i) { return widen(xs[i]); };
    const int chunk = (V + THREADS - 1) / THREADS;
    const int lo_i = min(V, t * chunk), hi_i = min(V, lo_i + chunk);

    // Max and first argmax.
    float best = -INFINITY;
    uint32_t best_i = 0xffffffffu;
    for (int i = lo_i; i < hi_i; ++i) {
        const float v = sanitize(x(i));
        if (v > best || best_i == 0xffffffffu) { best = v; best_i = i; }
    }
    if (best == -INFINITY) best_i = 0xffffffffu;  // an all -inf chunk offers no candidate
    block_argmax(best, best_i, s_f, s_u);
    const float m = best;
    if (!isfinite(m)) {
        if (t == 0) { tokens[row] = 0; logprobs[row] = NAN; status[row] = 1; }
        return;
    }

    const float temp = (float)draw[0];
    const float inv_t = 1.f / temp;
    // Greedy at T = 0 and wherever 1/T overflows (SamplingParams::is_greedy): the plain
    // log-softmax of the argmax.
    if (!isfinite(inv_t)) {
        double part = 0.0;
        for (int i = lo_i; i < hi_i; ++i) part += exp((double)sanitize(x(i)) - (double)m);
        const double lse = (double)m + log(block_total(part, s_d));
        if (t == 0) {
            tokens[row] = best_i;
            logprobs[row] = (float)((double)m - lse);
            status[row] = 0;
        }
        return;
    }

    // w of token i (0 for NaN logits).
    auto weight = [&](int i) { return __expf((sanitize(x(i)) - m) * inv_t); };

    // Top-k: the k-th largest key.
    uint32_t tau = 0;
    const uint32_t k = (uint32_t)draw[1];
    if (k > 0 && k < (uint32_t)V) {
        uint32_t lo = 0;
        for (int bit = 31; bit >= 0; --bit) {
            const uint32_t cand = lo | (1u << bit);
            uint32_t n = 0;
            for (int i = lo_i; i < hi_i; ++i) n += key_of(sanitize(x(i))) >= cand;
            if (block_total(n, s_u) >= k) lo = cand;
        }
        tau = lo;
    }
    // Top-p: the largest key whose kept mass reaches p of top-k's mass.
    const float p = (float)draw[2];
    if (p < 1.f) {
        double part = 0.0;
        for (int i = lo_i; i < hi_i; ++i)
            if (key_of(sanitize(x(i))) >= tau) part += (double)weight(i);
        const double target = (double)p * block_total(part, s_d);
        uint32_t lo = 0;
        for (int bit = 31; bit >= 0; --bit) {
            const uint32_t cand = lo | (1u << bit);
            const uint32_t floor = cand > tau ? cand : tau;
            double mass = 0.0;
            for (int i = lo_i; i < hi_i; ++i)
                if (key_of(sanitize(x(i))) >= floor) mass += (double)weight(i);
            if (block_total(mass, s_d) >= target) lo = cand;
        }
        tau = lo > tau ? lo : tau;
    }

    // The draw: first token whose running kept mass exceeds u * total.
    double part = 0.0;
    uint32_t last_kept = 0;
    bool any = false;
    for (int i = lo_i; i < hi_i; ++i) {
        if (key_of(sanitize(x(i))) < tau) continue;
        const float w = weight(i);
        part += (double)w;
        if (w > 0.f) { last_kept = i; any = true; }
    }
    // Thread t owns [incl[t - 1], incl[t]) of [0, total): the intervals tile it exactly.
    __shared__ double s_incl[THREADS];
    const double incl = block_inclusive_scan(part, s_d);
    s_incl[t] = incl;
    if (t == 0) s_chosen = 0xffffffffu;
    __syncthreads();
    const double total = s_incl[THREADS - 1];
    const double target = draw[3] * total;
    const double excl = t > 0 ? s_incl[t - 1] : 0.0;
    if (any && excl <= target && target < incl) {
        double cum = excl;
        uint32_t chosen = last_kept;
        for (int i = lo_i; i < hi_i; ++i) {
            if (key_of(sanitize(x(i))) < tau) continue;
            cum += (double)weight(i);
            if (target < cum) { chosen = i; break; }
        }
        atomicMin(&s_chosen, chosen);
    }
    __syncthreads();
    if (s_chosen == 0xffffffffu) {  // rounding put the target past the last token
        const uint32_t last = block_max(any ? last_kept + 1 : 0, s_u);
        // m is finite and 1/T is, so the argmax has w = 1; should no weight be kept all the
        // same, the argmax, never an index before the row.
        if (t == 0) s_chosen = last > 0 ? last - 1 : best_i;
        __syncthreads();
    }
    if (t == 0) {
        const uint32_t c = s_chosen;
        tokens[row] = c;
        logprobs[row] = (float)((double)((sanitize(x(c)) - m) * inv_t) - log(total));
        status[row] = 0;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
    sample_rows_f32(const float *__restrict__ logits, int V, long long ld,
                    const double *__restrict__ draws, uint32_t *__restrict__ out) {
    sample_row(logits, V, ld, draws, out);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    sample_rows_bf16(const __nv_bfloat16 *__restrict__ logits, int V, long long ld,
                     const double *__restrict__ draws, uint32_t *__restrict__ out) {
    sample_row(logits, V, ld, draws, out);
}
