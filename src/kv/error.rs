//! The errors of the KV pipeline, in one place: engine decoding and encoding, the
//! router-event payload, sinks and local indexes. Configuration is refused with the
//! crate's [`ConfigError`](crate::ConfigError).

/// A payload that is not a KV event batch.
///
/// ```
/// use eventplane::kv::{WorkerId, engine::EngineDecoder};
/// let err = EngineDecoder::new(WorkerId(1), 4)?.decode_batch(&[0xc1]).unwrap_err();
/// assert!(err.to_string().contains("malformed engine batch"));
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed engine batch: {reason}")]
pub struct EngineDecodeError {
    pub(crate) reason: &'static str,
}

/// An engine batch or a router-event payload could not be encoded.
///
/// ```
/// use eventplane::kv::{EncodeError, engine::{encode_engine_batch, EngineEvent}};
/// // Encoding in-memory values does not fail in practice; the error keeps its source.
/// let result: Result<Vec<u8>, EncodeError> = encode_engine_batch(0.0, 0, 16, &[EngineEvent::Cleared]);
/// assert!(result.is_ok());
/// ```
#[derive(Debug, thiserror::Error)]
#[error("cannot encode {what}")]
pub struct EncodeError {
    /// What was being encoded.
    pub(crate) what: &'static str,
    #[source]
    pub(crate) source: Box<dyn std::error::Error + Send + Sync>,
}

impl EncodeError {
    /// `what` could not be encoded because of `source` (kept as the error's source).
    pub(crate) fn new(
        what: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        EncodeError {
            what,
            source: Box::new(source),
        }
    }
}

/// A sink's failure.
///
/// ```
/// use eventplane::kv::pipeline::SinkError;
/// let err = SinkError("the bus is down".into());
/// assert_eq!(err.to_string(), "publishing router events failed");
/// assert_eq!(std::error::Error::source(&err).unwrap().to_string(), "the bus is down");
/// ```
#[derive(Debug, thiserror::Error)]
#[error("publishing router events failed")]
pub struct SinkError(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// A local index's failure.
///
/// ```
/// use eventplane::kv::pipeline::IndexError;
/// let err = IndexError("disk full".into());
/// assert_eq!(err.to_string(), "local index rejected the event");
/// ```
#[derive(Debug, thiserror::Error)]
#[error("local index rejected the event")]
pub struct IndexError(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// A payload that is not a msgpack list of router events.
///
/// ```
/// use eventplane::wire::Dialect;
/// let err = Dialect::EventPlane.decode_router_events(b"\xc1 not msgpack").unwrap_err();
/// assert!(std::error::Error::source(&err).is_some());
/// ```
#[derive(Debug, thiserror::Error)]
#[error("malformed router-event payload")]
pub struct KvDecodeError(#[source] pub(crate) Box<dyn std::error::Error + Send + Sync>);

impl KvDecodeError {
    /// Refuses, before serde sees it, a payload whose declared lengths exceed its size
    /// or whose nesting is deeper than the bounded reader's: serde reserves from
    /// declared lengths (up to 1 MiB per vector), so a few forged bytes would cost that
    /// much.
    #[inline]
    pub(crate) fn check_shape(payload: &[u8]) -> Result<(), KvDecodeError> {
        crate::msgpack::check_shape(payload)
            .map_err(|e| KvDecodeError(format!("msgpack shape: {e:?}").into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_encoding_failure_names_what_and_keeps_its_cause() {
        let err = EncodeError::new("router events", std::io::Error::other("out of space"));
        assert_eq!(err.to_string(), "cannot encode router events");
        let cause = std::error::Error::source(&err).map(ToString::to_string);
        assert_eq!(cause.as_deref(), Some("out of space"));
    }
}
