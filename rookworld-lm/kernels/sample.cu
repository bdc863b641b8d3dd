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
// Sums are in f64 and every pass over the row reads coalesced: warp w owns a contiguous
// segment of the row (a multiple of 32 tokens), its lanes reading 32 consecutive tokens at
// a time; the lanes' sums are combined by shuffles and the warps' in warp order, so a
// row's result depends only on its logits and its draw. The draw finds its warp by the
// warps' masses, then its lane by a scan of 32 runs of that warp's segment (read again,
// from cache), and its token by that lane's walk of its run.
//
// The logits are f32 or BF16 (the head's output as it is: a BF16 value widens to f32
// exactly, so both give the same draw on the same values), rows `ld` elements apart
// (ld >= V: a view of the first V columns of a padded head's output).

#include <cuda_bf16.h>
#include <stdint.h>

#define THREADS 1024
#define WARP 32
#define WARPS (THREADS / WARP)
#define FULL 0xffffffffu

__device__ __forceinline__ float sanitize(float x) { return isnan(x) ? -INFINITY : x; }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

// Order-preserving map of a float to an unsigned key (-inf lowest among non-NaN).
__device__ __forceinline__ uint32_t key_of(float x) {
    const uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <typename T> __device__ __forceinline__ T warp_total(T x) {
    for (int o = WARP / 2; o > 0; o /= 2) x += __shfl_xor_sync(FULL, x, o);
    return x;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t x) {
    for (int o = WARP / 2; o > 0; o /= 2) x = max(x, __shfl_xor_sync(FULL, x, o));
    return x;
}

// Sum over the block, the same on every thread (warp sums combined in warp order).
template <typename T>
__device__ T block_total(T x, T *scratch) {
    x = warp_total(x);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < WARPS; ++w) total += scratch[w];
    return total;
}

// (value, index) of the largest value, the smallest index among equals.
__device__ void block_argmax(float &v, uint32_t &i, float *sv, uint32_t *si) {
    for (int o = WARP / 2; o > 0; o /= 2) {
        const float ov = __shfl_xor_sync(FULL, v, o);
        const uint32_t oi = __shfl_xor_sync(FULL, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (int w = 1; w < WARPS; ++w)
        if (sv[w] > v || (sv[w] == v && si[w] < i)) { v = sv[w]; i = si[w]; }
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

    const int row = blockIdx.x, B = gridDim.x;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    uint32_t *tokens = out, *status = out + 2 * B;
    float *logprobs = reinterpret_cast<float *>(out + B);
    const double *draw = draws + 4 * (size_t)row;
    const T *xs = logits + (size_t)row * (size_t)ld;
    auto x = [&](int i) { return widen(xs[i]); };
    // The warp's segment [lo, hi): whole rounds of 32 tokens, the last segment's end V.
    const int segment = (V + WARPS * WARP - 1) / (WARPS * WARP) * WARP;
    const int lo = min(V, warp * segment), hi = min(V, lo + segment);

    // Max and first argmax (a lane's tokens come in index order: its first maximum).
    float best = -INFINITY;
    uint32_t best_i = 0xffffffffu;
    for (int i = lo + lane; i < hi; i += WARP) {
        const float v = sanitize(x(i));
        if (v > best || best_i == 0xffffffffu) { best = v; best_i = i; }
    }
    if (best == -INFINITY) best_i = 0xffffffffu;  // all -inf: no candidate
    block_argmax(best, best_i, s_f, s_u);
    const float m = best;
    if (!isfinite(m)) {
        if (threadIdx.x == 0) { tokens[row] = 0; logprobs[row] = NAN; status[row] = 1; }
        return;
    }

    const float temp = (float)draw[0];
    const float inv_t = 1.f / temp;
    // Greedy at T = 0 and wherever 1/T overflows (SamplingParams::is_greedy): the plain
    // log-softmax of the argmax.
    if (!isfinite(inv_t)) {
        double part = 0.0;
        for (int i = lo + lane; i < hi; i += WARP) part += exp((double)sanitize(x(i)) - (double)m);
        const double lse = (double)m + log(block_total(part, s_d));
        if (threadIdx.x == 0) {
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
        uint32_t floor = 0;
        for (int bit = 31; bit >= 0; --bit) {
            const uint32_t cand = floor | (1u << bit);
            uint32_t n = 0;
            for (int i = lo + lane; i < hi; i += WARP) n += key_of(sanitize(x(i))) >= cand;
            if (block_total(n, s_u) >= k) floor = cand;
        }
        tau = floor;
    }
    // Top-p: the largest key whose kept mass reaches p of top-k's mass.
    const float p = (float)draw[2];
    if (p < 1.f) {
        double part = 0.0;
        for (int i = lo + lane; i < hi; i += WARP)
            if (key_of(sanitize(x(i))) >= tau) part += (double)weight(i);
        const double target = (double)p * block_total(part, s_d);
        uint32_t floor = 0;
        for (int bit = 31; bit >= 0; --bit) {
            const uint32_t cand = floor | (1u << bit);
            const uint32_t at_least = cand > tau ? cand : tau;
            double mass = 0.0;
            for (int i = lo + lane; i < hi; i += WARP)
                if (key_of(sanitize(x(i))) >= at_least) mass += (double)weight(i);
            if (block_total(mass, s_d) >= target) floor = cand;
        }
        tau = floor > tau ? floor : tau;
    }

    // The draw: the first token whose running kept mass exceeds u * total. Each warp's
    // kept mass (and last kept token); warp w owns [before_w, before_w + mass_w) of
    // [0, total), the masses summed in warp order, so the intervals tile it exactly.
    auto kept = [&](int i) { return key_of(sanitize(x(i))) >= tau; };
    double part = 0.0;
    uint32_t last = 0;  // 1 + the lane's last token of positive weight, 0 for none
    for (int i = lo + lane; i < hi; i += WARP) {
        if (!kept(i)) continue;
        const float w = weight(i);
        part += (double)w;
        if (w > 0.f) last = i + 1;
    }
    const double mass = warp_total(part);
    last = warp_max(last);
    __syncthreads();  // every warp has read the last block_total's s_d
    if (lane == 0) s_d[warp] = mass;
    if (threadIdx.x == 0) s_chosen = 0xffffffffu;
    __syncthreads();
    double before = 0.0, total = 0.0;
    for (int w = 0; w < WARPS; ++w) {
        if (w == warp) before = total;
        total += s_d[w];
    }
    const double target = draw[3] * total;
    if (last > 0 && before <= target && target < before + mass) {  // warp-uniform
        // That warp's segment split into 32 runs of consecutive tokens, a lane each (read
        // again from cache): each run's kept mass, a scan across the lanes, and the one
        // lane whose share [before + excl, before + incl) holds the target walks its run
        // token by token. Lane l's upper end and lane l + 1's lower end are the same sum,
        // so the shares tile the warp's; only a token of positive weight is chosen.
        const int run = (hi - lo + WARP - 1) / WARP;
        const int r0 = min(hi, lo + lane * run), r1 = min(hi, r0 + run);
        double incl = 0.0;
        for (int i = r0; i < r1; ++i)
            if (kept(i)) incl += (double)weight(i);
        for (int o = 1; o < WARP; o *= 2) {
            const double y = __shfl_up_sync(FULL, incl, o);
            if (lane >= o) incl += y;
        }
        const double up = __shfl_up_sync(FULL, incl, 1);
        const double excl = lane > 0 ? up : 0.0;
        // The scan's sums need not rise lane by lane in floating point, so shares may
        // overlap by a rounding: the first lane that claims is the one writer; none (the
        // lanes' sum short of the warp's mass) leaves it to lane 31 and the fallback.
        const bool claims = before + excl <= target && target < before + incl;
        uint32_t owner = claims ? (uint32_t)lane : (uint32_t)WARP;
        for (int o = WARP / 2; o > 0; o /= 2) owner = min(owner, __shfl_xor_sync(FULL, owner, o));
        if (lane == (owner < WARP ? (int)owner : WARP - 1)) {
            uint32_t chosen = last - 1;  // rounding put the target past the run's sums
            if (claims) {
                double cum = before + excl;
                for (int i = r0; i < r1; ++i) {
                    if (!kept(i)) continue;
                    const float w = weight(i);
                    cum += (double)w;
                    if (w > 0.f && target < cum) {
                        chosen = i;
                        break;
                    }
                }
            }
            s_chosen = chosen;
        }
    }
    __syncthreads();
    if (s_chosen == 0xffffffffu) {  // rounding put the target past the last token
        // m is finite and 1/T is, so the argmax has w = 1; should no weight be kept all the
        // same, the argmax, never an index before the row.
        if (lane == 0) s_u[warp] = last;
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t top = 0;
            for (int w = 0; w < WARPS; ++w) top = max(top, s_u[w]);
            s_chosen = top > 0 ? top - 1 : best_i;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
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
