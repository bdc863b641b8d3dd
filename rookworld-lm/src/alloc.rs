//! The process's heap: freed buffers kept for the next request instead of handed back to
//! the kernel.
//!
//! glibc's malloc serves a large request (above a threshold that starts at 128 KiB) with a
//! fresh `mmap` and gives it back with `munmap` when it is freed, and it trims freed memory
//! at the top of its heap. Sampling and training ask for buffers of the same few sizes
//! again and again (a step's logits, packed operands, scratch rows); each fresh mapping is
//! page faults — the kernel zeroing every 4 KiB page — and each unmap a TLB shootdown on
//! every core. On a 2-core AMD EPYC (Zen 5), a whole `rollout-worker generate` of 4 × 8 × 64
//! tokens took 2.23 s with glibc's defaults and 1.96 s with the settings below (medians of
//! 7, INT8 panels).

/// The largest request served from the heap: the most glibc allows on 64-bit targets.
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Free memory at the heap's top kept before trimming.
const TRIM_THRESHOLD: i32 = 1 << 30;

/// Keeps freed memory in the heap for the next request: requests up to 32 MiB come from
/// the heap rather than from their own mappings, and up to 1 GiB freed at its top stays.
/// Only with glibc, and not when the user tunes its malloc (`GLIBC_TUNABLES` naming
/// `glibc.malloc`, or `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`). Call it first
/// thing in `main`.
pub fn keep_freed_memory() {
    let tunables = std::env::var("GLIBC_TUNABLES").ok();
    let legacy = ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if user_tuned(tunables.as_deref(), legacy) {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets malloc's parameters (under its own lock); it takes no
    // pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

/// Hands the heap's free memory back to the kernel now (glibc's `malloc_trim`): after a
/// one-time release far larger than what later requests reuse, such as a model's dense
/// weights once its packed panels hold them. A no-op elsewhere than glibc.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks malloc's own free lists (under its lock).
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whether the user set glibc malloc's parameters themselves.
fn user_tuned(tunables: Option<&str>, legacy_variables: bool) -> bool {
    legacy_variables || tunables.is_some_and(|t| t.contains("glibc.malloc."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_own_malloc_settings_are_left_alone() {
        assert!(!user_tuned(None, false));
        assert!(!user_tuned(Some("glibc.pthread.rseq=0"), false));
        assert!(user_tuned(Some("glibc.malloc.mmap_threshold=65536"), false));
        assert!(user_tuned(
            Some("glibc.rtld.nns=2:glibc.malloc.trim_threshold=0"),
            false
        ));
        assert!(user_tuned(None, true));
    }

    #[test]
    fn memory_freed_after_the_settings_is_served_again() {
        keep_freed_memory();
        // With the settings taken, a buffer above glibc's default threshold is allocated,
        // written, read and freed twice, intact each time.
        for _ in 0..2 {
            let v = vec![1u8; 8 << 20];
            assert_eq!(v.iter().map(|&b| usize::from(b)).sum::<usize>(), 8 << 20);
        }
    }
}
