//! Range checks of command-line values, one per concept, shared by every command: a bad
//! value is refused at start with one line naming the flag, the rule and the value. And
//! [`ConfigError`], the one type of every such refusal in the three binaries.

/// A configuration refused at start: one line that names the setting, before any work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A value outside its rule's range ([`positive`], [`at_least`], …).
    #[error("{flag} must {rule} (got {value})")]
    OutOfRange {
        flag: String,
        rule: String,
        value: String,
    },
    /// A peer's address without its scheme or host ([`url`]).
    #[error("{flag} `{value}` is not a URL: write it with its scheme, e.g. http://{}", value.trim_start_matches("//"))]
    NotUrl { flag: String, value: String },
    /// `--max-new-tokens` past the model's context after the longest prompt
    /// ([`fits_context`]).
    #[error("--max-new-tokens {max_new} does not fit after {what} of {prompt} tokens in the model's {context}-token context; use --max-new-tokens {} or less", context.saturating_sub(*prompt))]
    Context {
        max_new: usize,
        prompt: usize,
        what: String,
        context: usize,
    },
    /// A value its setting's parser refused (a device, a dtype, an old name).
    #[error("{0}")]
    Value(String),
    /// Settings that contradict each other, or that the chosen mode cannot use.
    #[error("{0}")]
    Conflict(String),
    /// Something a setting names that cannot be used: a file, an address, a peer.
    #[error("{0}")]
    Unusable(String),
}

fn out_of_range(flag: &str, rule: impl Into<String>, value: impl ToString) -> ConfigError {
    ConfigError::OutOfRange {
        flag: flag.to_owned(),
        rule: rule.into(),
        value: value.to_string(),
    }
}

/// `flag` must be a finite number above 0 (learning rates, temperatures, timeouts).
pub fn positive(flag: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(out_of_range(flag, "be > 0", v))
    }
}

/// `flag` must be a finite number of at least 0 (decay, clip norms, coefficients).
pub fn non_negative(flag: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(out_of_range(flag, "be ≥ 0", v))
    }
}

/// `flag` must lie in [0, 1] (fractions, top-p, clip ε).
pub fn fraction(flag: &str, v: f64) -> Result<(), ConfigError> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(out_of_range(flag, "lie in [0, 1]", v))
    }
}

/// `flag` must be at least `min` (counts: steps, batch sizes, intervals).
pub fn at_least(flag: &str, v: u64, min: u64) -> Result<(), ConfigError> {
    if v >= min {
        Ok(())
    } else {
        Err(out_of_range(flag, format!("be ≥ {min}"), v))
    }
}

/// `--max-new-tokens` must fit in the model's `context` after `what` (the longest prompt)
/// of `prompt` tokens; the refusal says how many would fit.
pub fn fits_context(
    max_new: usize,
    prompt: usize,
    what: &str,
    context: usize,
) -> Result<(), ConfigError> {
    if prompt + max_new <= context {
        return Ok(());
    }
    Err(ConfigError::Context {
        max_new,
        prompt,
        what: what.to_owned(),
        context,
    })
}

/// `flag` must be a gRPC URL with its scheme: `http://HOST:PORT` (or `https://`).
pub fn url(flag: &str, v: &str) -> Result<(), ConfigError> {
    let ok = (v.starts_with("http://") || v.starts_with("https://"))
        && v.parse::<tonic::codegen::http::Uri>()
            .is_ok_and(|u| u.host().is_some_and(|h| !h.is_empty()));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::NotUrl {
            flag: flag.to_owned(),
            value: v.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_names_the_flag_and_the_value() {
        assert!(positive("--lr", 1e-3).is_ok());
        assert_eq!(
            positive("--lr", -1.0).unwrap_err().to_string(),
            "--lr must be > 0 (got -1)"
        );
        assert!(positive("--lr", f64::NAN).is_err());
        assert!(non_negative("--beta", 0.0).is_ok());
        assert!(non_negative("--beta", -0.1).is_err());
        assert!(fraction("--top-p", 1.0).is_ok());
        assert_eq!(
            fraction("--clip-eps", 5.0).unwrap_err().to_string(),
            "--clip-eps must lie in [0, 1] (got 5)"
        );
        assert_eq!(
            at_least("--steps", 0, 1).unwrap_err().to_string(),
            "--steps must be ≥ 1 (got 0)"
        );
        assert_eq!(
            fits_context(100, 60, "the prompt", 128)
                .unwrap_err()
                .to_string(),
            "--max-new-tokens 100 does not fit after the prompt of 60 tokens in the model's 128-token context; use --max-new-tokens 68 or less"
        );
        assert!(at_least("--push-every", 0, 1).is_err());
        assert!(url("--reward", "http://reward:50052").is_ok());
        assert!(url("--reward", "https://10.0.0.1:50052").is_ok());
        assert_eq!(
            url("--reward", "reward:50052").unwrap_err().to_string(),
            "--reward `reward:50052` is not a URL: write it with its scheme, e.g. http://reward:50052"
        );
        assert!(url("--learner", "http://").is_err());
    }
}
