//! Every read from the API server with a byte bound before it is held: kube-rs reads an
//! error answer whole (and logs it whole when it is not JSON), a typed list whole and a
//! typed watch line of any length. Here an error answer costs at most
//! [`MAX_ERROR_BODY_BYTES`], a list page `max_page_bytes`, a watch event
//! [`MAX_WATCH_LINE_BYTES`]; the bodies are streamed, never collected first.

use std::pin::Pin;
use std::time::Duration;

use futures_util::io::AsyncBufRead;
use futures_util::{AsyncReadExt, StreamExt, TryStreamExt};
use kube::api::{ListParams, ObjectList, WatchParams};
use kube::core::ErrorResponse;
use serde::de::DeserializeOwned;

use super::error::{MAX_RETRY_AFTER, RetryAfter};
use super::narrow::{self, MAX_WATCH_LINE_BYTES};

/// The most of an error answer's body read (the rest is dropped unread): its JSON
/// `Status`, or the start of whatever else it is.
pub(crate) const MAX_ERROR_BODY_BYTES: usize = 64 << 10;

/// The most of an error answer kept in its message when it is not a JSON `Status`.
const MAX_ERROR_MESSAGE_BYTES: usize = 512;

/// A body being read.
pub(crate) type Body = Pin<Box<dyn AsyncBufRead + Send>>;

/// Sends `request`; its body as it arrives, or for a 4xx / 5xx status the
/// `kube::Error::Api` it carries, read from at most [`MAX_ERROR_BODY_BYTES`] (for a
/// 429 or 5xx with a `Retry-After` in seconds, the answer and the delay as a
/// [`RetryAfter`] in `kube::Error::Service`).
pub(crate) async fn send(
    client: &kube::Client,
    request: http::Request<Vec<u8>>,
) -> Result<Body, kube::Error> {
    let response = client.send(request.map(kube::client::Body::from)).await?;
    let status = response.status();
    let retry_after = (status.as_u16() == 429 || status.is_server_error())
        .then(|| response.headers().get(http::header::RETRY_AFTER))
        .flatten()
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|secs| Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    let mut frames = response.into_body();
    let data = futures_util::stream::poll_fn(move |cx| {
        loop {
            let frame = match http_body::Body::poll_frame(Pin::new(&mut frames), cx) {
                std::task::Poll::Ready(Some(Ok(frame))) => frame,
                std::task::Poll::Ready(Some(Err(e))) => {
                    return std::task::Poll::Ready(Some(Err(std::io::Error::other(e))));
                }
                std::task::Poll::Ready(None) => return std::task::Poll::Ready(None),
                std::task::Poll::Pending => return std::task::Poll::Pending,
            };
            // Trailers carry nothing read here.
            if let Ok(data) = frame.into_data() {
                return std::task::Poll::Ready(Some(Ok(data)));
            }
        }
    });
    let body: Body = Box::pin(data.into_async_read());
    if !(status.is_client_error() || status.is_server_error()) {
        return Ok(body);
    }
    let mut text = Vec::new();
    let limit = u64::try_from(MAX_ERROR_BODY_BYTES).unwrap_or(u64::MAX);
    // An answer cut short still says its status.
    let _ = body.take(limit).read_to_end(&mut text).await;
    let answer = serde_json::from_slice::<ErrorResponse>(&text).unwrap_or_else(|_| {
        let shown = text.get(..MAX_ERROR_MESSAGE_BYTES).unwrap_or(&text);
        ErrorResponse {
            status: status.to_string(),
            code: status.as_u16(),
            message: format!(
                "{:?}{}",
                String::from_utf8_lossy(shown),
                if text.len() > shown.len() { " …" } else { "" }
            ),
            reason: "Failed to parse error data".into(),
        }
    });
    Err(match retry_after {
        Some(after) => kube::Error::Service(Box::new(RetryAfter { answer, after })),
        None => kube::Error::Api(answer),
    })
}

/// One page of a typed list at `url`, read from at most `max_bytes`.
pub(crate) async fn list<K: DeserializeOwned + Clone>(
    client: &kube::Client,
    url: &str,
    params: &ListParams,
    max_bytes: usize,
) -> Result<ObjectList<K>, kube::Error> {
    let request = kube::core::Request::new(url)
        .list(params)
        .map_err(kube::Error::BuildRequest)?;
    let body = send(client, request).await?;
    let text = narrow::read_capped(body, max_bytes)
        .await
        .map_err(kube::Error::ReadEvents)?;
    serde_json::from_str(&text).map_err(kube::Error::SerdeError)
}

/// A line of a watch.
pub(crate) enum Line {
    /// An event's text (without its newline; never blank).
    Text(Vec<u8>),
    /// A line over [`MAX_WATCH_LINE_BYTES`]: the watch ends after it (opened again it
    /// would read the same, so everything is read afresh instead).
    TooLong(String),
}

/// The lines of a watch at `url` from `version`, each of at most
/// [`MAX_WATCH_LINE_BYTES`].
pub(crate) async fn watch_lines(
    client: &kube::Client,
    url: &str,
    params: &WatchParams,
    version: &str,
) -> Result<Pin<Box<dyn futures_core::Stream<Item = Result<Line, kube::Error>> + Send>>, kube::Error>
{
    let request = kube::core::Request::new(url)
        .watch(params, version)
        .map_err(kube::Error::BuildRequest)?;
    let body = send(client, request).await?;
    let lines = futures_util::stream::unfold(
        (body, Vec::new(), false),
        |(mut body, mut line, ended)| async move {
            if ended {
                return None;
            }
            loop {
                match narrow::read_line_capped(&mut body, &mut line, MAX_WATCH_LINE_BYTES).await {
                    Ok(false) => return None,
                    Ok(true) if line.iter().all(u8::is_ascii_whitespace) => continue,
                    Ok(true) => {
                        let text = Line::Text(std::mem::take(&mut line));
                        return Some((Ok(text), (body, line, false)));
                    }
                    Err(e) if narrow::is_too_long(&e) => {
                        return Some((Ok(Line::TooLong(e.to_string())), (body, line, true)));
                    }
                    Err(e) => return Some((Err(kube::Error::ReadEvents(e)), (body, line, true))),
                }
            }
        },
    );
    Ok(lines.boxed())
}
