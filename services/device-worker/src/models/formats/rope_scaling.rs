//! Rope scaling as a model's files ask for it, turned into one divisor per rotary frequency (the
//! form Llama 3.1's GGUF files store as `rope_freqs`). `linear` divides every frequency by its
//! factor; `llama3` keeps the high frequencies, divides the low ones by the factor and blends
//! the ones between (as transformers' `_compute_llama3_parameters`). The other kinds (yarn,
//! dynamic NTK, longrope) also change attention's scale or depend on the sequence's length;
//! they are refused by name.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub enum Scaling {
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_context: f64,
    },
}

/// The kinds served, for refusals.
const SERVED: &str = "default, linear, llama3";

impl Scaling {
    /// From a transformers `config.json`: `rope_parameters` (transformers 5) or `rope_scaling`
    /// (earlier), its kind under `rope_type` or the older `type`.
    pub fn from_config(config: &Value) -> Result<Option<Self>, String> {
        let Some(params) = ["rope_parameters", "rope_scaling"]
            .iter()
            .find_map(|key| config.get(*key).filter(|v| v.is_object()))
        else {
            return Ok(None);
        };
        let kind = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let number = |key: &str| -> Result<f64, String> {
            params
                .get(key)
                .and_then(Value::as_f64)
                .ok_or_else(|| format!("config.json: {kind} rope scaling needs a number for {key}"))
        };
        let scaling = match kind {
            "default" => return Ok(None),
            "linear" => Self::Linear {
                factor: number("factor")?,
            },
            "llama3" => Self::Llama3 {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_context: number("original_max_position_embeddings")?,
            },
            other => {
                return Err(format!(
                    "config.json: rope_type {other:?}: this rope scaling is not served \
                     (served: {SERVED})"
                ));
            }
        };
        scaling.check("config.json")?;
        Ok(Some(scaling))
    }

    /// From a GGUF's `{arch}.rope.scaling.type` and `.factor` (`key` names the first).
    pub fn from_gguf(kind: &str, factor: Option<f32>, key: &str) -> Result<Option<Self>, String> {
        let scaling =
            match kind {
                "none" => return Ok(None),
                "linear" => Self::Linear {
                    factor: f64::from(factor.ok_or_else(|| {
                        format!("{key} = \"linear\" needs its rope.scaling.factor")
                    })?),
                },
                other => {
                    return Err(format!(
                        "{key} = {other:?}: this rope scaling is not served (served: none, linear; \
                     Llama 3.1's comes as rope_freqs)"
                    ));
                }
            };
        scaling.check(key)?;
        Ok(Some(scaling))
    }

    fn check(&self, source: &str) -> Result<(), String> {
        let ok = match *self {
            Self::Linear { factor } => factor > 0.0,
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => factor > 0.0 && high_freq_factor > low_freq_factor && original_context > 0.0,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{source}: rope scaling {self:?} is not a valid one (factors must be positive, \
                 high_freq_factor above low_freq_factor)"
            ))
        }
    }

    /// The divisor of each of a head's `head_dim / 2` rotary frequencies.
    pub fn divisors(&self, head_dim: usize, freq_base: f32) -> Vec<f32> {
        (0..head_dim)
            .step_by(2)
            .map(|i| {
                let frequency = 1.0 / f64::from(freq_base).powf(i as f64 / head_dim as f64);
                self.divisor(frequency) as f32
            })
            .collect()
    }

    fn divisor(&self, frequency: f64) -> f64 {
        match *self {
            Self::Linear { factor } => factor,
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => {
                let wavelength = 2.0 * std::f64::consts::PI / frequency;
                if wavelength < original_context / high_freq_factor {
                    1.0
                } else if wavelength > original_context / low_freq_factor {
                    factor
                } else {
                    let smooth = (original_context / wavelength - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn llama3_keeps_high_frequencies_divides_low_ones_and_blends_between() {
        // Llama 3.1's own settings.
        let config = json!({"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}, "rope_theta": 500000.0});
        let scaling = Scaling::from_config(&config).unwrap().unwrap();
        let divisors = scaling.divisors(128, 500_000.0);
        assert_eq!(divisors.len(), 64);
        // Wavelengths under 2048 tokens keep their frequency, those over 8192 are divided by 8.
        assert_eq!(divisors[0], 1.0);
        assert_eq!(divisors[63], 8.0);
        let wavelength =
            |k: usize| 2.0 * std::f64::consts::PI * 500_000f64.powf(2.0 * k as f64 / 128.0);
        for (k, d) in divisors.iter().enumerate() {
            let w = wavelength(k);
            if w < 2048.0 {
                assert_eq!(*d, 1.0, "{k}");
            } else if w > 8192.0 {
                assert_eq!(*d, 8.0, "{k}");
            } else {
                // Between, 1/d moves linearly in 8192/w from 1/8 (at 1) to 1 (at 4).
                let smooth = (8192.0 / w - 1.0) / 3.0;
                let expected = 1.0 / ((1.0 - smooth) / 8.0 + smooth);
                assert!(
                    (f64::from(*d) - expected).abs() < 1e-5,
                    "{k}: {d} vs {expected}"
                );
                assert!(*d > 1.0 && *d < 8.0, "{k}: {d}");
            }
        }
        // The blended band is not empty with these settings.
        assert!(divisors.iter().any(|d| *d > 1.0 && *d < 8.0));
    }

    #[test]
    fn linear_divides_every_frequency_and_both_spellings_are_read() {
        for config in [
            json!({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
            json!({"rope_scaling": {"type": "linear", "factor": 4.0}}),
        ] {
            let scaling = Scaling::from_config(&config).unwrap().unwrap();
            assert_eq!(scaling.divisors(16, 10_000.0), vec![4.0; 8]);
        }
        assert_eq!(
            Scaling::from_gguf("linear", Some(2.0), "llama.rope.scaling.type").unwrap(),
            Some(Scaling::Linear { factor: 2.0 })
        );
        assert_eq!(Scaling::from_gguf("none", None, "k").unwrap(), None);
        assert_eq!(
            Scaling::from_config(&json!({"rope_parameters": {"rope_type": "default"}})).unwrap(),
            None
        );
        assert_eq!(
            Scaling::from_config(&json!({"rope_scaling": null})).unwrap(),
            None
        );
    }

    #[test]
    fn other_kinds_and_bad_settings_are_refused_by_name() {
        let err = Scaling::from_config(&json!({"rope_scaling": {"type": "yarn", "factor": 4.0}}))
            .unwrap_err();
        assert_eq!(
            err,
            "config.json: rope_type \"yarn\": this rope scaling is not served (served: default, \
             linear, llama3)"
        );
        let err = Scaling::from_config(&json!({"rope_parameters": {"rope_type": "llama3",
            "factor": 8.0}}))
        .unwrap_err();
        assert_eq!(
            err,
            "config.json: llama3 rope scaling needs a number for low_freq_factor"
        );
        let err = Scaling::from_config(&json!({"rope_parameters": {"rope_type": "linear",
            "factor": 0.0}}))
        .unwrap_err();
        assert!(err.contains("is not a valid one"), "{err}");
        let err = Scaling::from_gguf("yarn", Some(4.0), "qwen3.rope.scaling.type").unwrap_err();
        assert!(
            err.starts_with("qwen3.rope.scaling.type = \"yarn\": this rope scaling is not served"),
            "{err}"
        );
        let err = Scaling::from_gguf("linear", None, "llama.rope.scaling.type").unwrap_err();
        assert!(err.contains("needs its rope.scaling.factor"), "{err}");
    }
}
