// The warp matrix products of CUDA's <mma.h> (`nvcuda::wmma`) that the project's kernels
// use, on the host (see cuda_emu.h): 16 × 16 × 16 tiles, BF16 operands, f32 accumulators.
//
// A fragment is the warp's: each lane holds `num_elements` (8) of its 256 values, lane l's
// element e being the tile's value l + 32 e in row-major order. CUDA leaves that layout
// unspecified, and this one is unlike any GPU's, so a kernel that reads or writes `x[e]`
// as if it knew which value it holds gives wrong results here too; one that only fills,
// scales every element alike, loads, multiplies and stores is what the GPU runs alike.
//
// Every call is warp-synchronous as on the GPU (each lane of the warp calls it, with the
// same arguments: a divergent call is the emulator's barrier error). What the GPU requires
// of its arguments is an error here: a pointer not 256-bit (32-byte) aligned, a leading
// dimension not a multiple of 16 bytes. Products are f32 multiply-adds in k order; the
// GPU's tensor cores sum in their own order, so results agree to f32 rounding, not bit
// for bit.

#ifndef ROOKWORLD_CUDA_EMU_MMA_H
#define ROOKWORLD_CUDA_EMU_MMA_H

#include <cuda_bf16.h>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulator has 16 x 16 x 16 tiles only");
    static constexpr int num_elements = 256 / ::emu::WARP;
    using element_type = T;
    T x[num_elements];
};

namespace detail {

// Row and column of lane `lane`'s element `e` in a 16 x 16 tile.
inline int row_of(int lane, int e) { return (lane + ::emu::WARP * e) / 16; }
inline int col_of(int lane, int e) { return (lane + ::emu::WARP * e) % 16; }

inline float widen(float x) { return x; }
inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
inline void narrow(float &to, float x) { to = x; }
inline void narrow(__nv_bfloat16 &to, float x) { to = __float2bfloat16_rn(x); }

template <class T> inline void check(const void *p, unsigned ldm, const char *call) {
    ::emu::sync_warp(0xffffffffu);
    char why[160];
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0) {
        snprintf(why, sizeof why, "%s: a pointer not 256-bit aligned (%p)", call, p);
        ::emu::fail(why);
    }
    if ((ldm * sizeof(T)) % 16 != 0) {
        snprintf(why, sizeof why, "%s: a leading dimension of %u elements, not a multiple of 16 bytes",
                 call, ldm);
        ::emu::fail(why);
    }
}

// Offset of the value at (row, col) of a tile stored `row_major` or not, `ldm` apart.
inline size_t at(int row, int col, unsigned ldm, bool row_major) {
    return row_major ? (size_t)row * ldm + col : (size_t)col * ldm + row;
}

template <class L> constexpr bool is_row_major() { return std::is_same<L, row_major>::value; }

}  // namespace detail

template <class Use, class T, class L, class V>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, L> &f, V v) {
    for (int e = 0; e < f.num_elements; ++e) detail::narrow(f.x[e], (float)v);
}

// matrix_a: (row, k); matrix_b: (k, col); each `row_major` or `col_major` in memory.
template <class Use, class T, class L>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, L> &f, const T *p, unsigned ldm) {
    static_assert(!std::is_same<Use, accumulator>::value, "an accumulator's load names its layout");
    detail::check<T>(p, ldm, "load_matrix_sync");
    const int lane = ::emu::lane_id();
    for (int e = 0; e < f.num_elements; ++e)
        f.x[e] = p[detail::at(detail::row_of(lane, e), detail::col_of(lane, e), ldm,
                              detail::is_row_major<L>())];
}

template <class T>
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, T> &f, const T *p, unsigned ldm,
                             layout_t layout) {
    detail::check<T>(p, ldm, "load_matrix_sync");
    const int lane = ::emu::lane_id();
    for (int e = 0; e < f.num_elements; ++e)
        f.x[e] = p[detail::at(detail::row_of(lane, e), detail::col_of(lane, e), ldm,
                              layout == mem_row_major)];
}

template <class T>
inline void store_matrix_sync(T *p, const fragment<accumulator, 16, 16, 16, T> &f, unsigned ldm,
                              layout_t layout) {
    detail::check<T>(p, ldm, "store_matrix_sync");
    const int lane = ::emu::lane_id();
    for (int e = 0; e < f.num_elements; ++e)
        p[detail::at(detail::row_of(lane, e), detail::col_of(lane, e), ldm,
                     layout == mem_row_major)] = f.x[e];
}

// d = a · b + c, each lane's elements of d from the whole of a and b: the warp's lanes
// pool their elements of a and b first (a warp barrier before and after, as a shuffle).
template <class T, class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                     const fragment<matrix_a, 16, 16, 16, T, LA> &a,
                     const fragment<matrix_b, 16, 16, 16, T, LB> &b,
                     const fragment<accumulator, 16, 16, 16, float> &c) {
    const int me = ::emu::linear(::emu::self().idx), warp = me / ::emu::WARP;
    const int lane = me % ::emu::WARP;
    float(&pool)[2][256] = ::emu::L->mma[warp];
    for (int e = 0; e < a.num_elements; ++e) {
        const int i = lane + ::emu::WARP * e;
        pool[0][i] = detail::widen(a.x[e]);
        pool[1][i] = detail::widen(b.x[e]);
    }
    ::emu::sync_warp(0xffffffffu);
    float out[fragment<accumulator, 16, 16, 16, float>::num_elements];
    for (int e = 0; e < d.num_elements; ++e) {
        const int row = detail::row_of(lane, e), col = detail::col_of(lane, e);
        float sum = c.x[e];
        for (int k = 0; k < 16; ++k) sum = fmaf(pool[0][row * 16 + k], pool[1][k * 16 + col], sum);
        out[e] = sum;
    }
    ::emu::sync_warp(0xffffffffu);  // every lane has read the pool before it is written again
    for (int e = 0; e < d.num_elements; ++e) d.x[e] = out[e];
}

}  // namespace wmma
}  // namespace nvcuda

#endif
