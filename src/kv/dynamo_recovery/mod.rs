//! Dynamo 1.6.1's KV recovery, on the wire (sans-IO): how its router asks a worker's
//! KV query endpoint for what it lost, and how the worker answers.
//!
//! A worker that can be asked advertises a `recovery_target` in its
//! `v1/event_sources/…` record: where its endpoint listens (`transport.tcp`,
//! `HOST:PORT/{instance:x}/{namespace}/{component}/{endpoint}`) and its codec
//! (`request_plane_codec`, msgpack or JSON). The exchange:
//!
//! 1. The router connects to `HOST:PORT` and sends one request frame
//!    ([`encode_request`]): the path after the first `/`, headers, and a two-part
//!    payload ([`encode_two_part`]) of a JSON [`Control`] header and a [`KvQuery`]
//!    body in the worker's codec. The worker acknowledges with four zero bytes.
//! 2. The worker connects to the [`CallHome`] address the header names and sends
//!    two-part messages: a JSON header `{"subject": …, "stream_type": "response"}`,
//!    a JSON header `{"error": null}`, a body [`AnswerBody::Answer`], a body
//!    [`AnswerBody::Final`], and the JSON string `"sentinel"` as a header.
//!
//! Measured against the 1.6.1 wheel with no Dynamo code on the other side (see
//! `tests/fixtures/dynamo-1.6.1-recovery/`). Dynamo's main branch carries a proposed
//! multiplexed response transport (`tcp_response_mux_v1`) that neither 1.6.1 nor
//! 1.7.0.dev20261026 uses; a release that made it the only one would need this
//! re-measured.

mod answer;
mod client;
mod frame;
mod query;
mod recover;
mod serve;

pub(crate) use recover::recover_dynamo;

pub use answer::answer;
pub use client::{CallHomeConfig, CallHomeListener, DynamoQueryError, QueryTarget};
pub use serve::{DynamoQueryConfig, DynamoQueryServer, DynamoQueryStats};

pub use frame::{
    FrameError, RequestFrame, RequestLimits, TwoPart, decode_request, decode_two_part,
    encode_request, encode_two_part, two_part_of,
};
pub use query::{
    AnswerBody, CallHome, Codec, ConnectionInfo, Control, KvAnswer, KvQuery, QueryError,
};

#[cfg(test)]
mod tests;
