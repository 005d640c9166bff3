//! The bound on an endpoint a record advertises, shared by both record formats.

use super::RecordError;

/// Longest endpoint a record may advertise (bytes): what a tunnel target may be.
pub(crate) const MAX_ENDPOINT_LEN: usize = 1024;

/// Longest host name in an endpoint (DNS's limit).
const MAX_HOST_LEN: usize = 253;

/// An endpoint over [`MAX_ENDPOINT_LEN`], or whose host is over 253 bytes, makes its
/// record malformed (counted), in either record format: no router or broker could
/// use it, and a tunnel must never be handed it.
pub(crate) fn check_endpoint(endpoint: &str) -> Result<(), RecordError> {
    let host = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest)
        .rsplit_once(':')
        .map_or(endpoint, |(host, _)| host);
    if endpoint.len() > MAX_ENDPOINT_LEN || host.len() > MAX_HOST_LEN {
        return Err(RecordError::EndpointTooLong {
            len: endpoint.len(),
            max: MAX_ENDPOINT_LEN,
        });
    }
    Ok(())
}
