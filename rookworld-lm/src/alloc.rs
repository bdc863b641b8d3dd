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

    /// The probe's verdict: whether an 8 MiB buffer came from its own mapping (glibc's
    /// `mallinfo2().hblkhd`: bytes in mapped blocks), in a fresh process, with or
    /// without the settings.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn mapped_in_a_fresh_process(settings: bool) -> bool {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "alloc::tests::probe", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(
                "ROOKWORLD_ALLOC_PROBE",
                if settings { "settings" } else { "defaults" },
            )
            .env_remove("GLIBC_TUNABLES")
            .env_remove("MALLOC_MMAP_THRESHOLD_")
            .env_remove("MALLOC_TRIM_THRESHOLD_")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "the probe failed: {text}");
        match (text.contains("probe: mapped"), text.contains("probe: heap")) {
            (true, false) => true,
            (false, true) => false,
            _ => panic!("the probe said neither: {text}"),
        }
    }

    /// Run by [`mapped_in_a_fresh_process`] only.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    #[ignore = "a probe the settings' test runs in a fresh process"]
    fn probe() {
        let Ok(mode) = std::env::var("ROOKWORLD_ALLOC_PROBE") else {
            return;
        };
        if mode == "settings" {
            keep_freed_memory();
        }
        // SAFETY: mallinfo2 only reads malloc's counters (under its lock).
        let mapped = || unsafe { libc::mallinfo2() }.hblkhd;
        let before = mapped();
        let v = std::hint::black_box(vec![1u8; 8 << 20]);
        let during = mapped();
        assert_eq!(v.iter().map(|&b| usize::from(b)).sum::<usize>(), 8 << 20);
        let verdict = if during >= before + (8 << 20) {
            "mapped"
        } else {
            "heap"
        };
        println!("probe: {verdict}");
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn with_the_settings_a_large_buffer_comes_from_the_heap() {
        // glibc's defaults map an 8 MiB buffer of its own (the probe can tell), the
        // settings serve it from the heap.
        assert!(mapped_in_a_fresh_process(false), "glibc's defaults");
        assert!(!mapped_in_a_fresh_process(true), "with keep_freed_memory");
    }
}
