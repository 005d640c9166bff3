//! `tcp://host:port` endpoints.

use std::net::SocketAddr;

use super::Error;

/// Splits `tcp://host:port` into host and port. `*` as host means every interface
/// (libzmq's spelling for bind); IPv6 hosts are bracketed (`tcp://[::1]:5555`).
pub(crate) fn parse_tcp(endpoint: &str) -> Result<(String, u16), Error> {
    let invalid = |reason| Error::InvalidEndpoint {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| {
        // `host:port` without a scheme is the usual slip: say what was meant.
        invalid(if endpoint.contains("://") {
            "only tcp:// endpoints are supported"
        } else {
            "only tcp:// endpoints are supported (write tcp://host:port)"
        })
    })?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| invalid("missing :port"))?;
    let port: u16 = match port.parse::<u64>() {
        Ok(n) => u16::try_from(n).map_err(|_| invalid("port is above 65535"))?,
        Err(_) if port.is_empty() => return Err(invalid("missing port after ':'")),
        Err(_) => return Err(invalid("port is not a number")),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(invalid("missing host"));
    }
    let host = if host == "*" { "0.0.0.0" } else { host };
    Ok((host.to_owned(), port))
}

/// Resolves an endpoint to socket addresses (DNS allowed), within `timeout` (a
/// resolver that never answers must not hold a dial forever).
pub(crate) async fn resolve(
    endpoint: &str,
    timeout: std::time::Duration,
) -> Result<Vec<SocketAddr>, Error> {
    let (host, port) = parse_tcp(endpoint)?;
    let lookup = tokio::net::lookup_host((host.as_str(), port));
    let addrs: Vec<SocketAddr> = tokio::time::timeout(timeout, lookup)
        .await
        .map_err(|_| Error::Timeout(super::TimeoutKind::Resolve))?
        .map_err(Error::Io)?
        .collect();
    if addrs.is_empty() {
        return Err(Error::InvalidEndpoint {
            endpoint: endpoint.to_owned(),
            reason: "host resolved to no address",
        });
    }
    Ok(addrs)
}

/// `tcp://ip:port` for a socket address.
pub(crate) fn format_tcp(addr: SocketAddr) -> String {
    format!("tcp://{addr}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses() {
        assert_eq!(
            parse_tcp("tcp://127.0.0.1:5555").unwrap(),
            ("127.0.0.1".into(), 5555)
        );
        assert_eq!(parse_tcp("tcp://*:0").unwrap(), ("0.0.0.0".into(), 0));
        assert_eq!(parse_tcp("tcp://[::1]:1").unwrap(), ("::1".into(), 1));
        assert!(parse_tcp("ipc:///tmp/x").is_err());
        assert!(parse_tcp("tcp://host").is_err());
        assert!(parse_tcp("tcp://:1").is_err());
        let reason = |e| match parse_tcp(e) {
            Err(Error::InvalidEndpoint { reason, .. }) => reason,
            other => panic!("{e}: {other:?}"),
        };
        assert_eq!(reason("tcp://h:99999"), "port is above 65535");
        assert_eq!(reason("tcp://h:port"), "port is not a number");
        assert_eq!(reason("tcp://h:"), "missing port after ':'");
        assert_eq!(
            reason("127.0.0.1:5"),
            "only tcp:// endpoints are supported (write tcp://host:port)"
        );
        assert_eq!(
            reason("ipc:///tmp/s"),
            "only tcp:// endpoints are supported"
        );
    }
}
