//! GPU utilisation for the worker's metrics, from NVML (the driver's `libnvidia-ml.so.1`,
//! loaded at run time, so a build without it still starts).
//!
//! The GPU is found by the UUID of the CUDA device the engine runs on, so the numbers are
//! that GPU's whatever the device ordering (`CUDA_VISIBLE_DEVICES`, PCI or fastest-first).

use std::time::Duration;

use nvml_wrapper::Nvml;

use crate::metrics::GpuSample;

/// An open NVML handle on one GPU.
pub struct GpuMonitor {
    nvml: Nvml,
    uuid: String,
}

impl GpuMonitor {
    /// Loads NVML and checks that it knows the GPU `uuid` (`GPU-…`, as [`nvml_uuid`]).
    /// The error is one line: no driver library, or no such GPU.
    pub fn open(uuid: &str) -> Result<Self, String> {
        let nvml = Nvml::init().map_err(|e| format!("NVML unavailable: {e}"))?;
        nvml.device_by_uuid(uuid)
            .map_err(|e| format!("NVML has no GPU {uuid}: {e}"))?;
        Ok(Self {
            nvml,
            uuid: uuid.to_owned(),
        })
    }

    /// The GPU's current utilisation and power.
    pub fn sample(&self) -> Result<GpuSample, String> {
        let device = self
            .nvml
            .device_by_uuid(self.uuid.as_str())
            .map_err(|e| format!("NVML: {e}"))?;
        let rates = device
            .utilization_rates()
            .map_err(|e| format!("NVML utilization: {e}"))?;
        Ok(GpuSample {
            utilization: f64::from(rates.gpu) / 100.0,
            memory_busy: f64::from(rates.memory) / 100.0,
            power_watts: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        })
    }
}

/// NVML's name of a CUDA device UUID: `GPU-` and the 16 bytes as 8-4-4-4-12 hex digits.
pub fn nvml_uuid(bytes: &[u8; 16]) -> String {
    let hex = |range: std::ops::Range<usize>| {
        bytes[range]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// The NVML UUID of the CUDA device `device`; `None` off CUDA.
pub fn device_uuid(device: &candle_core::Device) -> Option<String> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        let uuid = d.cuda_stream().context().uuid().ok()?;
        return Some(nvml_uuid(&uuid.bytes.map(|b| b as u8)));
    }
    let _ = device;
    None
}

/// Publishes the readings of the engine's GPU every `period` until `stop` resolves.
/// Off CUDA it returns at once; where NVML cannot be used it says why once and returns.
pub async fn monitor(
    device: candle_core::Device,
    period: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    let Some(uuid) = device_uuid(&device) else {
        return;
    };
    let gpu = match GpuMonitor::open(&uuid) {
        Ok(gpu) => gpu,
        Err(e) => {
            tracing::warn!(error = %e, "no GPU utilisation metrics");
            return;
        }
    };
    tracing::info!(gpu = %uuid, "GPU utilisation from NVML");
    let mut tick = tokio::time::interval(period);
    tokio::pin!(stop);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {}
        }
        match gpu.sample() {
            Ok(sample) => {
                failing = false;
                crate::metrics::set_gpu(&sample);
            }
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "GPU utilisation reading failed");
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_written_as_nvml_names_gpus() {
        let bytes = [
            0x5a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71, 0x82, 0x93, 0xa4, 0xb5, 0xc6, 0xd7,
            0xe8, 0xf9,
        ];
        assert_eq!(
            nvml_uuid(&bytes),
            "GPU-5a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
        );
    }

    #[test]
    fn without_nvml_or_the_gpu_opening_is_one_line_not_a_panic() {
        // On a machine with NVML this GPU still does not exist.
        let err = GpuMonitor::open("GPU-00000000-0000-0000-0000-000000000000")
            .err()
            .expect("no such GPU");
        assert!(err.starts_with("NVML"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }

    #[tokio::test]
    async fn off_cuda_the_monitor_returns_at_once() {
        let done = tokio::time::timeout(
            Duration::from_secs(5),
            monitor(
                candle_core::Device::Cpu,
                Duration::from_millis(1),
                std::future::pending(),
            ),
        )
        .await;
        assert!(done.is_ok());
    }
}
