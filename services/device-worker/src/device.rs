//! The device a worker drives, parsed from `--device cpu | cuda:N | metal:N`.

use candle_core::Device;
use candle_core::quantized::GgmlDType;
use nomad_proto::v1::DeviceInfo;
use nomad_q8::{Kernel, QuantMatrix};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
    Metal(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        let index = |rest: &str| {
            rest.parse::<usize>()
                .map_err(|_| format!("invalid device index in {s:?}: expected e.g. cuda:0"))
        };
        match s.split_once(':') {
            None if s == "cpu" => Ok(DeviceSpec::Cpu),
            None if s == "cuda" => Ok(DeviceSpec::Cuda(0)),
            None if s == "metal" => Ok(DeviceSpec::Metal(0)),
            Some(("cuda", rest)) => index(rest).map(DeviceSpec::Cuda),
            Some(("metal", rest)) => index(rest).map(DeviceSpec::Metal),
            _ => Err(format!("unknown device {s:?}: use cpu, cuda:N or metal:N")),
        }
    }
}

impl DeviceSpec {
    pub fn type_name(self) -> &'static str {
        match self {
            DeviceSpec::Cpu => "cpu",
            DeviceSpec::Cuda(_) => "cuda",
            DeviceSpec::Metal(_) => "metal",
        }
    }

    pub fn index(self) -> u32 {
        match self {
            DeviceSpec::Cpu => 0,
            DeviceSpec::Cuda(i) | DeviceSpec::Metal(i) => i as u32,
        }
    }

    /// Opens the device, with an error that says how to get it when this build lacks it.
    pub fn open(self) -> anyhow::Result<Device> {
        let result = match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(i) => Device::new_cuda(i),
            DeviceSpec::Metal(i) => Device::new_metal(i),
        };
        result.map_err(|e| {
            let feature = match self {
                DeviceSpec::Cpu => "",
                DeviceSpec::Cuda(_) => " (build with `--features cuda` on a machine with CUDA)",
                DeviceSpec::Metal(_) => " (build with `--features metal` on macOS)",
            };
            anyhow::anyhow!("cannot open device {self}: {e}{feature}")
        })
    }

    pub fn info(self) -> DeviceInfo {
        DeviceInfo {
            r#type: self.type_name().to_owned(),
            index: self.index(),
            name: self.to_string(),
            memory_total_bytes: None,
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceSpec::Metal(i) => write!(f, "metal:{i}"),
        }
    }
}

/// `(free, total)` device memory as the driver reports it; `None` where the backend cannot say.
pub fn memory_info(device: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return match cuda.cuda_stream().context().mem_get_info() {
            Ok((free, total)) => Some((free as u64, total as u64)),
            Err(e) => {
                tracing::debug!("cuMemGetInfo failed: {e}");
                None
            }
        };
    }
    let _ = device;
    None
}

/// One line on what this build and machine offer, for the start-up log.
pub fn capabilities() -> String {
    format!(
        "compiled with cuda={} metal={}; cpu avx={} threads={} matmul_threads={} q8_0 kernel={} \
         q4_1 kernel={}",
        candle_core::utils::cuda_is_available(),
        candle_core::utils::metal_is_available(),
        candle_core::utils::with_avx(),
        candle_core::utils::get_num_threads(),
        nomad_q8::pool_threads(),
        QuantMatrix::kernel_for(GgmlDType::Q8_0).map_or("candle's", Kernel::name),
        QuantMatrix::kernel_for(GgmlDType::Q4_1)
            .map_or("none (re-quantized to q8_0 at load)", Kernel::name),
    )
}

/// On CPU, candle's f32 matmuls scale poorly across threads at these model sizes; the worker
/// instead runs them single-threaded and splits a batch's sequences across the cores (see
/// `models::embed`). Set before any thread exists; an explicit RAYON_NUM_THREADS wins.
pub fn single_threaded_matmuls_on_cpu(device: DeviceSpec) {
    if device == DeviceSpec::Cpu && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: called first thing in main, before any other thread is started.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_cuda_and_metal_and_names_bad_input() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("CUDA:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        assert_eq!("metal".parse::<DeviceSpec>().unwrap(), DeviceSpec::Metal(0));
        assert!(
            "cuda:x"
                .parse::<DeviceSpec>()
                .unwrap_err()
                .contains("cuda:x")
        );
        assert!("tpu:0".parse::<DeviceSpec>().unwrap_err().contains("tpu:0"));
    }

    #[test]
    fn cuda_without_the_feature_explains_how_to_get_it() {
        if cfg!(feature = "cuda") {
            return;
        }
        let msg = DeviceSpec::Cuda(0).open().unwrap_err().to_string();
        assert!(msg.contains("--features cuda"), "{msg}");
    }
}
