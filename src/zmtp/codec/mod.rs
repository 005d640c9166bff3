//! The sans-IO ZMTP 3.x codec: greeting, frames, commands and metadata.
//!
//! Nothing here does I/O or reads a clock. Decoders consume from a
//! [`BytesMut`](bytes::BytesMut) and hand out zero-copy [`Bytes`](bytes::Bytes);
//! encoders append to a `BytesMut`. Peer-controlled sizes are compared with the
//! configured limits before anything is buffered or allocated.

mod command;
mod frame;
mod greeting;

pub use command::{Command, MAX_METADATA_PROPERTIES, MAX_PING_CONTEXT, Metadata};
pub use frame::{
    Decoded, FLAG_COMMAND, FLAG_LONG, FLAG_MORE, FrameDecoder, FrameLimits, LONG_HEADER_LEN,
    SHORT_HEADER_LEN, encode_frame_header, encode_message, encoded_len,
};
pub use greeting::{
    GREETING_LEN, Greeting, GreetingDecoder, MECHANISM_NULL, VERSION_MAJOR, VERSION_MINOR,
    encode_greeting,
};
