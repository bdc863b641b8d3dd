// Kernels that exercise the emulator (tests/emulator.rs): a block reduction through shared
// memory, the shuffles, and the faults it must name.

#include <cuda_bf16.h>
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

// out[block] = Σ in[block·blockDim .. +blockDim], through shared memory and warp shuffles.
extern "C" __global__ void block_sum(float *out, const float *in) {
    __shared__ float partial[32];
    float v = in[blockIdx.x * blockDim.x + threadIdx.x];
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) s += partial[w];
        out[blockIdx.x] = s;
    }
}

// out[i] = lane i's source under __shfl_sync (from lane src), __shfl_up_sync (by up) and
// __shfl_down_sync (by down), one warp.
extern "C" __global__ void shuffles(int *out, int src, int up, int down) {
    const int lane = threadIdx.x;
    out[lane] = __shfl_sync(0xffffffffu, lane * 10, src);
    out[32 + lane] = __shfl_up_sync(0xffffffffu, lane, up);
    out[64 + lane] = __shfl_down_sync(0xffffffffu, lane, down);
}

// Thread 0 returns before the others reach __syncthreads.
extern "C" __global__ void divergent_barrier(float *out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1.f;
}

// A shuffle whose mask leaves out half of the warp.
extern "C" __global__ void partial_mask(float *out) {
    out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, 1.f, 1);
}

// Writes out[0 .. n): past the buffer's end when n is larger than it.
extern "C" __global__ void fill(float *out, int n, float v) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = v;
}

// Reads a 16-byte vector: its pointer must be 16-byte aligned.
extern "C" __global__ void wide(float *out, const int4 *in) {
    const int4 v = in[0];
    out[0] = (float)(v.x + v.y + v.z + v.w);
}

// Dynamic shared memory: each thread writes its index, then reads its neighbour's.
extern "C" __global__ void rotate(int *out) {
    extern __shared__ int ring[];
    ring[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = ring[(threadIdx.x + 1) % blockDim.x];
}

// out (16, 16) = a · b + c through the warp's matrix product, the operands rounded to
// BF16 in shared memory: a row-major, or column-major (a[k·16 + i] is a_ik) when
// a_col_major; b row-major. One warp.
extern "C" __global__ void tile_product(float *out, const float *a, const float *b,
                                        const float *c, int a_col_major) {
    __shared__ __align__(32) __nv_bfloat16 sa[256], sb[256];
    __shared__ __align__(32) float sc[256];
    for (int i = threadIdx.x; i < 256; i += 32) {
        sa[i] = __float2bfloat16(a[i]);
        sb[i] = __float2bfloat16(b[i]);
        sc[i] = c[i];
    }
    __syncwarp();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::load_matrix_sync(acc, sc, 16, wmma::mem_row_major);
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
    wmma::load_matrix_sync(fb, sb, 16);
    if (a_col_major) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa;
        wmma::load_matrix_sync(fa, sa, 16);
        wmma::mma_sync(acc, fa, fb, acc);
    } else {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, sa, 16);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(sc, acc, 16, wmma::mem_row_major);
    __syncwarp();
    for (int i = threadIdx.x; i < 256; i += 32) out[i] = sc[i];
}

// A tile loaded from shared memory 8 bytes past a 32-byte boundary.
extern "C" __global__ void misaligned_tile(float *out) {
    __shared__ __align__(32) __nv_bfloat16 s[16 * 24];
    for (int i = threadIdx.x; i < 16 * 24; i += 32) s[i] = __float2bfloat16(1.f);
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, s + 4, 16);
    out[threadIdx.x] = __bfloat162float(fa.x[0]);
}
