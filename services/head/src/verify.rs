//! Verification: how a rollout's output earns its reward.

use serde::Deserialize;
use serde_json::Value;

/// A verify kind as written in a task: a name, or an object with its parameters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "VerifySpec")]
pub enum Verify {
    None,
    /// Reward 1 when the output equals `expected` (as JSON), else 0.
    Exact,
    /// Reward 1 when both are numbers within `tolerance` of each other (absolute, or relative
    /// to `expected` with `relative: true`), else 0.
    Numeric {
        tolerance: f64,
        relative: bool,
    },
    /// Reward the cosine similarity of the two texts' embeddings (clamped to 0..1); passed at
    /// `threshold`.
    Similarity {
        threshold: f64,
    },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum VerifySpec {
    Name(String),
    Object {
        kind: String,
        #[serde(default)]
        tolerance: Option<f64>,
        #[serde(default)]
        relative: Option<bool>,
        #[serde(default)]
        threshold: Option<f64>,
    },
}

impl TryFrom<VerifySpec> for Verify {
    type Error = String;

    fn try_from(spec: VerifySpec) -> Result<Self, String> {
        let (kind, tolerance, relative, threshold) = match spec {
            VerifySpec::Name(kind) => (kind, None, None, None),
            VerifySpec::Object {
                kind,
                tolerance,
                relative,
                threshold,
            } => (kind, tolerance, relative, threshold),
        };
        let verify = match kind.as_str() {
            "none" => Verify::None,
            "exact" => Verify::Exact,
            "numeric" => Verify::Numeric {
                tolerance: tolerance.unwrap_or(1e-6),
                relative: relative.unwrap_or(false),
            },
            "similarity" => Verify::Similarity {
                threshold: threshold.unwrap_or(0.8),
            },
            other => {
                return Err(format!(
                    "unknown verify kind {other:?}; kinds: none, exact, numeric, similarity"
                ));
            }
        };
        match verify {
            Verify::Numeric { tolerance, .. } if !(tolerance >= 0.0 && tolerance.is_finite()) => {
                Err("`tolerance` must be a number of at least 0".into())
            }
            Verify::Similarity { threshold } if !(-1.0..=1.0).contains(&threshold) => {
                Err("`threshold` must be between -1 and 1".into())
            }
            v => Ok(v),
        }
    }
}

impl Verify {
    pub fn name(&self) -> &'static str {
        match self {
            Verify::None => "none",
            Verify::Exact => "exact",
            Verify::Numeric { .. } => "numeric",
            Verify::Similarity { .. } => "similarity",
        }
    }
}

/// A number, or a string that reads as one.
fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// The reward for kinds that need no model: `(reward, passed)`.
pub fn score(verify: &Verify, output: &Value, expected: &Value) -> Result<(f64, bool), String> {
    match verify {
        Verify::None | Verify::Similarity { .. } => {
            Err(format!("{} is not scored here", verify.name()))
        }
        Verify::Exact => {
            let ok = output == expected;
            Ok((f64::from(u8::from(ok)), ok))
        }
        Verify::Numeric {
            tolerance,
            relative,
        } => {
            let (Some(got), Some(want)) = (number(output), number(expected)) else {
                return Ok((0.0, false));
            };
            let allowed = if *relative {
                tolerance * want.abs()
            } else {
                *tolerance
            };
            let ok = (got - want).abs() <= allowed;
            Ok((f64::from(u8::from(ok)), ok))
        }
    }
}

/// A value as the text to embed: strings as they are, anything else as JSON.
pub fn as_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Cosine similarity of two vectors (0 when either is empty or all zero).
pub fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let (na, nb) = (norm(a), norm(b));
    if na == 0.0 || nb == 0.0 || a.len() != b.len() {
        0.0
    } else {
        dot / (na * nb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Verify, String> {
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    #[test]
    fn kinds_parse_by_name_or_object_with_checked_parameters() {
        assert_eq!(parse(json!("exact")).unwrap(), Verify::Exact);
        assert_eq!(
            parse(json!({"kind": "numeric", "tolerance": 0.1, "relative": true})).unwrap(),
            Verify::Numeric {
                tolerance: 0.1,
                relative: true
            }
        );
        assert_eq!(
            parse(json!("similarity")).unwrap(),
            Verify::Similarity { threshold: 0.8 }
        );
        assert!(
            parse(json!("fuzzy"))
                .unwrap_err()
                .contains("unknown verify kind \"fuzzy\"")
        );
        assert!(
            parse(json!({"kind": "numeric", "tolerance": -1}))
                .unwrap_err()
                .contains("tolerance")
        );
        assert!(
            parse(json!({"kind": "similarity", "threshold": 2}))
                .unwrap_err()
                .contains("threshold")
        );
    }

    #[test]
    fn exact_and_numeric_rewards() {
        assert_eq!(
            score(&Verify::Exact, &json!({"a": [1]}), &json!({"a": [1]})),
            Ok((1.0, true))
        );
        assert_eq!(
            score(&Verify::Exact, &json!("4"), &json!(4)),
            Ok((0.0, false))
        );
        let abs = Verify::Numeric {
            tolerance: 0.01,
            relative: false,
        };
        assert_eq!(score(&abs, &json!(2.501), &json!(2.5004)), Ok((1.0, true)));
        assert_eq!(score(&abs, &json!("2.6"), &json!(2.5004)), Ok((0.0, false)));
        assert_eq!(
            score(&abs, &json!("not a number"), &json!(1)),
            Ok((0.0, false))
        );
        let rel = Verify::Numeric {
            tolerance: 0.1,
            relative: true,
        };
        assert_eq!(score(&rel, &json!(105), &json!(100)), Ok((1.0, true)));
        assert_eq!(score(&rel, &json!(115), &json!(100)), Ok((0.0, false)));
    }

    #[test]
    fn cosine_of_vectors() {
        assert!((cosine(&[1.0, 0.0], &[1.0, 0.0]) - 1.0).abs() < 1e-12);
        assert!(cosine(&[1.0, 0.0], &[0.0, 1.0]).abs() < 1e-12);
        assert_eq!(cosine(&[], &[]), 0.0);
        assert_eq!(cosine(&[1.0], &[1.0, 2.0]), 0.0);
    }
}
