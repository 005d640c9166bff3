//! The admin endpoint's HTTP/1.1, sans-IO: a request head read into a bounded
//! buffer, the route it names, the response bytes. One request per connection
//! (`Connection: close`); bodies are never read.

/// What a complete request head asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Head<'a> {
    /// `GET` answers with a body, `HEAD` without.
    pub(crate) head_only: bool,
    /// The path, without its query.
    pub(crate) path: &'a str,
    /// A method other than `GET` and `HEAD` (answered 405).
    pub(crate) other_method: bool,
}

/// Why a request head is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// No end of head within the limit: 431.
    TooLarge,
    /// Not `METHOD /path HTTP/1.x`: 400.
    Malformed,
}

/// Reads the head in `buf`: `Ok(None)` while it is incomplete and under `max` bytes.
pub(crate) fn parse_head(buf: &[u8], max: usize) -> Result<Option<Head<'_>>, Refused> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() >= max {
            Err(Refused::TooLarge)
        } else {
            Ok(None)
        };
    };
    if end + 4 > max {
        return Err(Refused::TooLarge);
    }
    let line_end = buf
        .windows(2)
        .position(|w| w == b"\r\n")
        .ok_or(Refused::Malformed)?;
    let line = std::str::from_utf8(buf.get(..line_end).ok_or(Refused::Malformed)?)
        .map_err(|_| Refused::Malformed)?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Refused::Malformed);
    };
    let token = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_uppercase());
    if !token(method) || !target.starts_with('/') || !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return Err(Refused::Malformed);
    }
    let path = target.split('?').next().unwrap_or(target);
    Ok(Some(Head {
        head_only: method == "HEAD",
        path,
        other_method: method != "GET" && method != "HEAD",
    }))
}

/// A response: status line, the headers every answer carries, `body` unless
/// `head_only`.
pub(crate) fn response(
    status: u16,
    content_type: &str,
    body: &[u8],
    head_only: bool,
    extra: &str,
) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Status",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
         cache-control: no-store\r\nconnection: close\r\n{extra}\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

/// The head of a response whose length is not known (answering a `HEAD` without
/// producing the body it describes).
pub(crate) fn response_without_length(status: u16, content_type: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} OK\r\ncontent-type: {content_type}\r\n\
         cache-control: no-store\r\nconnection: close\r\n\r\n"
    )
    .into_bytes()
}

/// A plain-text response.
pub(crate) fn text(status: u16, body: &str, head_only: bool) -> Vec<u8> {
    response(
        status,
        "text/plain; charset=utf-8",
        body.as_bytes(),
        head_only,
        "",
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_head_is_read_once_complete_and_refused_past_its_limit() {
        assert_eq!(
            parse_head(b"GET /readyz HTTP/1.1\r\nHost: x\r\n", 64),
            Ok(None)
        );
        let head = parse_head(b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n", 64)
            .unwrap()
            .unwrap();
        assert_eq!(
            head,
            Head {
                head_only: false,
                path: "/metrics",
                other_method: false
            }
        );
        let head = parse_head(b"HEAD /livez HTTP/1.0\r\n\r\n", 64)
            .unwrap()
            .unwrap();
        assert!(head.head_only && !head.other_method);
        let head = parse_head(b"POST /readyz HTTP/1.1\r\n\r\n", 64)
            .unwrap()
            .unwrap();
        assert!(head.other_method);
        assert_eq!(parse_head(&[b'a'; 64], 64), Err(Refused::TooLarge));
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(80));
        assert_eq!(parse_head(long.as_bytes(), 64), Err(Refused::TooLarge));
        for bad in [
            &b"GET /readyz\r\n\r\n"[..],
            b"get /readyz HTTP/1.1\r\n\r\n",
            b"GET readyz HTTP/1.1\r\n\r\n",
            b"GET /readyz HTTP/2\r\n\r\n",
            b"GET /readyz HTTP/1.1x\r\n\r\n",
            b"GET  /readyz HTTP/1.1\r\n\r\n",
            b"GET /\xff HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(parse_head(bad, 64), Err(Refused::Malformed), "{bad:?}");
        }
    }

    #[test]
    fn every_byte_string_is_answered_without_panic() {
        // Every prefix and every one-byte change of a request.
        let request = b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n";
        for n in 0..=request.len() {
            let _ = parse_head(&request[..n], 40);
        }
        for i in 0..request.len() {
            for b in 0..=255u8 {
                let mut r = request.to_vec();
                r[i] = b;
                let _ = parse_head(&r, 40);
            }
        }
    }

    #[test]
    fn responses_close_and_say_their_length() {
        let r = String::from_utf8(text(503, "not ready: x\n", false)).unwrap();
        assert!(r.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(r.contains("content-length: 13\r\n") && r.contains("connection: close\r\n"));
        assert!(r.ends_with("\r\n\r\nnot ready: x\n"));
        let head = String::from_utf8(text(200, "ok\n", true)).unwrap();
        assert!(head.contains("content-length: 3\r\n") && head.ends_with("\r\n\r\n"));
    }
}
