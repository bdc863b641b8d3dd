// The BF16 types and conversions of CUDA's <cuda_bf16.h> that the project's kernels use, on
// the host (see cuda_emu.h): 16-bit storage, f32 to BF16 rounding to nearest, ties to even
// (NaN kept a NaN), BF16 to f32 exact.

#ifndef ROOKWORLD_CUDA_EMU_BF16_H
#define ROOKWORLD_CUDA_EMU_BF16_H

#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    unsigned short __x;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline float __bfloat162float(__nv_bfloat16 b) {
    const uint32_t u = (uint32_t)b.__x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return {(unsigned short)(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 p) {
    return {__bfloat162float(p.x), __bfloat162float(p.y)};
}

#endif
