//! The one error every configuration in the crate is checked with.
//!
//! Each component validates its configuration once, in the step that consumes it
//! (`zmtp::ConfigBuilder::build`, `Merge::new`, `DynamicSubscriberBuilder::spawn`,
//! `Processor::new`, …), and refuses a bad value with a [`ConfigError`] that names the
//! setter. No value is silently raised, lowered or clamped.

use std::time::Duration;

/// A configuration value that was refused, naming the field (the setter's name).
///
/// ```
/// use eventplane::ConfigError;
/// use eventplane::lossy::{Merge, MergeConfig};
/// let err = Merge::<u32>::new(MergeConfig::default().lane_capacity(0)).unwrap_err();
/// assert_eq!(err, ConfigError::Zero { field: "lane_capacity" });
/// assert_eq!(err.field(), "lane_capacity");
/// assert_eq!(err.to_string(), "lane_capacity must not be zero");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A bound or duration was zero.
    #[error("{field} must not be zero")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// A value was outside its range.
    #[error("{field} {reason}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The allowed range.
        reason: &'static str,
    },
    /// A value contradicts another one.
    #[error("{field} {reason}")]
    Inconsistent {
        /// The refused field.
        field: &'static str,
        /// What it contradicts.
        reason: &'static str,
    },
    /// A value is malformed (an endpoint, a prefix, …).
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl ConfigError {
    /// The refused field: the setter's name, or, for a constructor taking several
    /// values (`EngineDecoder::with_limits`, `Backoff::new`), the parameter's.
    pub fn field(&self) -> &'static str {
        match self {
            ConfigError::Zero { field }
            | ConfigError::OutOfRange { field, .. }
            | ConfigError::Inconsistent { field, .. }
            | ConfigError::Invalid { field, .. } => field,
        }
    }
}

impl ConfigError {
    /// The same refusal, named after `field`: for a setter that passes its values on
    /// to a constructor checking them under its own parameter names.
    pub(crate) fn renamed(self, field: &'static str) -> ConfigError {
        match self {
            ConfigError::Zero { .. } => ConfigError::Zero { field },
            ConfigError::OutOfRange { reason, .. } => ConfigError::OutOfRange { field, reason },
            ConfigError::Inconsistent { reason, .. } => ConfigError::Inconsistent { field, reason },
            ConfigError::Invalid { reason, .. } => ConfigError::Invalid { field, reason },
        }
    }
}

/// `value`, or [`ConfigError::Zero`] naming `field`.
pub(crate) fn nonzero(field: &'static str, value: usize) -> Result<usize, ConfigError> {
    if value == 0 {
        return Err(ConfigError::Zero { field });
    }
    Ok(value)
}

/// `duration`, or [`ConfigError::Zero`] naming `field`.
pub(crate) fn nonzero_duration(
    field: &'static str,
    duration: Duration,
) -> Result<Duration, ConfigError> {
    if duration.is_zero() {
        return Err(ConfigError::Zero { field });
    }
    Ok(duration)
}

/// A `min ..= max` backoff range: `min` positive, `max` not below it.
pub(crate) fn backoff_range(
    field: &'static str,
    min: Duration,
    max: Duration,
) -> Result<(), ConfigError> {
    nonzero_duration(field, min)?;
    if max < min {
        return Err(ConfigError::Inconsistent {
            field,
            reason: "maximum is below the minimum",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers_name_the_field() {
        assert_eq!(nonzero("a", 1), Ok(1));
        assert_eq!(nonzero("a", 0), Err(ConfigError::Zero { field: "a" }));
        assert_eq!(
            nonzero_duration("b", Duration::ZERO).unwrap_err().field(),
            "b"
        );
        let sec = Duration::from_secs(1);
        assert_eq!(backoff_range("c", sec, sec), Ok(()));
        assert_eq!(
            backoff_range("c", sec * 2, sec),
            Err(ConfigError::Inconsistent {
                field: "c",
                reason: "maximum is below the minimum"
            })
        );
        assert_eq!(
            backoff_range("c", Duration::ZERO, sec).unwrap_err(),
            ConfigError::Zero { field: "c" }
        );
    }
}
