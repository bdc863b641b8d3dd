//! Choosing the device and dtype from command-line style names.

use std::str::FromStr;

use candle_core::{DType, Device};

use crate::error::{Error, Result};

/// `cpu`, `cuda`, `cuda:N` or `auto` (CUDA device 0 when usable, else the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda(usize),
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::InvalidArgument(format!(
                "unknown device `{s}` (use cpu, cuda, cuda:N or auto)"
            ))
        };
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda(0)),
            "auto" => Ok(Self::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl DeviceChoice {
    /// Opens the device. CUDA asked for but absent is an error naming the reason;
    /// `auto` falls back to the CPU and logs why.
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => open_cuda(ordinal),
            Self::Auto => match open_cuda(0) {
                Ok(device) => Ok(device),
                Err(reason) => {
                    tracing::warn!("--device auto: {reason}; using the CPU");
                    Ok(Device::Cpu)
                }
            },
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device> {
    Device::new_cuda(ordinal)
        .map_err(|e| Error::InvalidArgument(format!("CUDA device {ordinal} is unavailable: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> Result<Device> {
    Err(Error::InvalidArgument(format!(
        "CUDA device {ordinal} requested, but this binary was built without the `cuda` feature \
         (rebuild with `--features cuda`, or use --device cpu)"
    )))
}

/// `f32`, `f16` or `bf16` (also `float32`, `float16`, `bfloat16`).
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" | "half" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(Error::InvalidArgument(format!(
            "unknown dtype `{other}` (use f32, f16 or bf16)"
        ))),
    }
}

/// The dtype a device runs best: f32 on the CPU, bf16 on CUDA.
pub fn default_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_and_dtypes() {
        assert_eq!("cpu".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cpu);
        assert_eq!(
            "cuda:1".parse::<DeviceChoice>().unwrap(),
            DeviceChoice::Cuda(1)
        );
        assert!("tpu".parse::<DeviceChoice>().is_err());
        assert_eq!(parse_dtype("bf16").unwrap(), DType::BF16);
        assert!(parse_dtype("f8").unwrap_err().to_string().contains("f8"));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_names_the_reason_and_auto_falls_back() {
        let err = DeviceChoice::Cuda(0).open().unwrap_err().to_string();
        assert!(err.contains("without the `cuda` feature"), "{err}");
        assert!(DeviceChoice::Auto.open().unwrap().is_cpu());
    }
}
