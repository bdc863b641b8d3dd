//! Settings chosen by name from a fixed list (an objective's variant, a pass): each value
//! with the one name it has on the command line, in run files and in the run record. The
//! command line's parser is the learner's; this crate only names the values.

/// A setting whose values are a fixed list of names.
pub trait Choice: Copy + PartialEq + Send + Sync + 'static {
    /// Every value and its name (lowercase, words joined by `-`), in the order help lists
    /// them.
    const NAMES: &'static [(Self, &'static str)];

    /// The value's name.
    fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(v, _)| *v == self)
            .map_or("", |(_, n)| n)
    }

    /// The value named `name`, or `None`.
    fn named(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(v, _)| *v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpo::{AdvantageNorm, Aggregation, PolicyLoss};
    use crate::offpolicy::Correction;
    use crate::policy::StepPath;

    fn round_trips<T: Choice + std::fmt::Debug>() {
        let mut seen = std::collections::BTreeSet::new();
        for &(v, n) in T::NAMES {
            assert!(seen.insert(n), "{n} named twice");
            assert_eq!(T::named(n), Some(v));
            assert_eq!(v.name(), n);
            assert!(n.chars().all(|c| c.is_ascii_lowercase() || c == '-'), "{n}");
        }
        assert_eq!(T::named("no-such-value"), None);
    }

    #[test]
    fn every_choice_has_one_name_per_value() {
        round_trips::<AdvantageNorm>();
        round_trips::<Aggregation>();
        round_trips::<PolicyLoss>();
        round_trips::<Correction>();
        round_trips::<StepPath>();
    }
}
