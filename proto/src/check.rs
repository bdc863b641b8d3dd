//! Range checks of command-line values, one per concept, shared by every command: a bad
//! value is refused at start with one line naming the flag, the rule and the value.

/// `flag` must be a finite number above 0 (learning rates, temperatures, timeouts).
pub fn positive(flag: &str, v: f64) -> Result<(), String> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(format!("{flag} must be > 0 (got {v})"))
    }
}

/// `flag` must be a finite number of at least 0 (decay, clip norms, coefficients).
pub fn non_negative(flag: &str, v: f64) -> Result<(), String> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(format!("{flag} must be ≥ 0 (got {v})"))
    }
}

/// `flag` must lie in [0, 1] (fractions, top-p, clip ε).
pub fn fraction(flag: &str, v: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(format!("{flag} must lie in [0, 1] (got {v})"))
    }
}

/// `flag` must be at least `min` (counts: steps, batch sizes, intervals).
pub fn at_least(flag: &str, v: u64, min: u64) -> Result<(), String> {
    if v >= min {
        Ok(())
    } else {
        Err(format!("{flag} must be ≥ {min} (got {v})"))
    }
}

/// `--max-new-tokens` must fit in the model's `context` after `what` (the longest prompt)
/// of `prompt` tokens; the refusal says how many would fit.
pub fn fits_context(
    max_new: usize,
    prompt: usize,
    what: &str,
    context: usize,
) -> Result<(), String> {
    if prompt + max_new <= context {
        return Ok(());
    }
    Err(format!(
        "--max-new-tokens {max_new} does not fit after {what} of {prompt} tokens in the model's {context}-token context; use --max-new-tokens {} or less",
        context.saturating_sub(prompt)
    ))
}

/// `flag` must be a gRPC URL with its scheme: `http://HOST:PORT` (or `https://`).
pub fn url(flag: &str, v: &str) -> Result<(), String> {
    let ok = (v.starts_with("http://") || v.starts_with("https://"))
        && v.parse::<tonic::codegen::http::Uri>()
            .is_ok_and(|u| u.host().is_some_and(|h| !h.is_empty()));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{flag} `{v}` is not a URL: write it with its scheme, e.g. http://{}",
            v.trim_start_matches("//")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_names_the_flag_and_the_value() {
        assert!(positive("--lr", 1e-3).is_ok());
        assert_eq!(
            positive("--lr", -1.0).unwrap_err(),
            "--lr must be > 0 (got -1)"
        );
        assert!(positive("--lr", f64::NAN).is_err());
        assert!(non_negative("--beta", 0.0).is_ok());
        assert!(non_negative("--beta", -0.1).is_err());
        assert!(fraction("--top-p", 1.0).is_ok());
        assert_eq!(
            fraction("--clip-eps", 5.0).unwrap_err(),
            "--clip-eps must lie in [0, 1] (got 5)"
        );
        assert!(at_least("--push-every", 0, 1).is_err());
        assert!(url("--reward", "http://reward:50052").is_ok());
        assert!(url("--reward", "https://10.0.0.1:50052").is_ok());
        assert_eq!(
            url("--reward", "reward:50052").unwrap_err(),
            "--reward `reward:50052` is not a URL: write it with its scheme, e.g. http://reward:50052"
        );
        assert!(url("--learner", "http://").is_err());
    }
}
