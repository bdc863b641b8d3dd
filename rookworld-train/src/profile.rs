//! Where a step's device time goes: each kernel's launches and time, summed over the steps
//! profiled (`learner bench --profile`). The CUDA backend fills it from device events
//! around each launch ([`crate::cuda::Cuda::profiled`]): on a GPU machine without a
//! sampling profiler, one run says which kernel a missed goal is in.

use std::collections::BTreeMap;

/// One kernel's (or one product shape's) launches and device seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KernelTime {
    pub launches: u64,
    pub seconds: f64,
}

/// Launches and device time by kernel name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelProfile {
    times: BTreeMap<String, KernelTime>,
}

impl KernelProfile {
    /// One launch of `name` that took `seconds`.
    pub fn add(&mut self, name: &str, seconds: f64) {
        let t = match self.times.get_mut(name) {
            Some(t) => t,
            None => self.times.entry(name.to_owned()).or_default(),
        };
        t.launches += 1;
        t.seconds += seconds;
    }

    /// Adds every launch of `other`.
    pub fn merge(&mut self, other: &KernelProfile) {
        for (name, o) in &other.times {
            let t = self.times.entry(name.clone()).or_default();
            t.launches += o.launches;
            t.seconds += o.seconds;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.times.is_empty()
    }

    /// Launches of every kernel.
    pub fn launches(&self) -> u64 {
        self.times.values().map(|t| t.launches).sum()
    }

    /// Device seconds of every kernel: the step's time less this is time the device
    /// waited for the host (or ran work outside the pass).
    pub fn seconds(&self) -> f64 {
        self.times.values().map(|t| t.seconds).sum()
    }

    /// Every kernel, longest total time first (ties by name).
    pub fn by_time(&self) -> Vec<(&str, KernelTime)> {
        let mut rows: Vec<(&str, KernelTime)> =
            self.times.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        rows.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds).then(a.0.cmp(b.0)));
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_add_up_by_name_and_list_longest_first() {
        let mut a = KernelProfile::default();
        a.add("gelu_fwd", 0.5e-3);
        a.add("gemm 768×880×2304 NN", 2e-3);
        a.add("gelu_fwd", 0.25e-3);
        let mut b = KernelProfile::default();
        b.add("pass_layer_norm_fwd", 0.75e-3);
        b.add("gelu_fwd", 0.25e-3);
        a.merge(&b);
        assert_eq!(a.launches(), 5);
        assert!((a.seconds() - 3.75e-3).abs() < 1e-12);
        let rows = a.by_time();
        let names: Vec<&str> = rows.iter().map(|r| r.0).collect();
        assert_eq!(
            names,
            ["gemm 768×880×2304 NN", "gelu_fwd", "pass_layer_norm_fwd"]
        );
        assert_eq!(rows[1].1.launches, 3);
        assert!((rows[1].1.seconds - 1e-3).abs() < 1e-12);
        assert!(KernelProfile::default().is_empty());
    }
}
