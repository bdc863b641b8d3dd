//! What this CPU offers the vectorised kernels, detected once: AVX2 and FMA (every kernel
//! of [`crate::simd`] and [`crate::cpu_gemm`]), and AVX-512's dot products (the packed
//! kernels' BF16 and INT8 panels).

/// Whether this CPU has AVX2 and FMA, which the packed kernels and the vectorised paths of
/// [`crate::simd`] need.
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`supported`], asked once.
#[cfg(target_arch = "x86_64")]
pub(crate) fn supported_cached() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(supported)
}

/// The AVX-512 dot products this CPU lends the packed kernels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Avx512 {
    /// `vpdpbusd` (AVX512-VNNI): INT8 panels.
    pub vnni: bool,
    /// `vdpbf16ps` (AVX512-BF16): BF16 panels in pairs of k, inputs rounded to BF16.
    pub bf16: bool,
}

/// What of [`Avx512`] the packed kernels use on this CPU (detected once). Setting
/// `ROOKWORLD_CPU_KERNELS=avx2` keeps them to AVX2: to compare the two in one run, or for
/// BF16 panels whose product is the f32 panels' to the bit (the widening kernel);
/// `ROOKWORLD_CPU_KERNELS=avx512` keeps them off AMX tiles ([`crate::cpu_gemm::amx`]).
pub fn avx512() -> Avx512 {
    static FOUND: std::sync::OnceLock<Avx512> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        let avx2_only = std::env::var("ROOKWORLD_CPU_KERNELS").is_ok_and(|v| v == "avx2");
        #[cfg(target_arch = "x86_64")]
        if supported() && !avx2_only && std::arch::is_x86_feature_detected!("avx512f") {
            return Avx512 {
                vnni: std::arch::is_x86_feature_detected!("avx512vnni"),
                bf16: std::arch::is_x86_feature_detected!("avx512bf16"),
            };
        }
        let _ = avx2_only;
        Avx512::default()
    })
}
