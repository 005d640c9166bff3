//! The handshake half of a [`Session`]: the peer's greeting, then READY (or ERROR)
//! and the checks on what it declares.

use bytes::Bytes;

use super::types::{Event, PeerInfo, SocketType};
use super::{PUB_MIN_COMMAND_SIZE, Session, State};
use crate::zmtp::codec::{Command, Decoded, Greeting, Metadata};
use crate::zmtp::{Error, ProtocolError};

impl Session {
    pub(super) fn on_greeting(&mut self, greeting: Greeting) {
        self.peer = Some(PeerInfo {
            major: greeting.major,
            minor: greeting.minor,
            metadata: Metadata::new(),
        });
        let mut md = Metadata::new();
        md.push("Socket-Type", self.socket_type.as_str());
        Command::Ready(md).encode(&mut self.output);
        self.state = State::AwaitReady;
    }

    pub(super) fn on_handshake_frame(&mut self, decoded: Decoded) -> Result<Event, Error> {
        let body = match decoded {
            Decoded::Command(body) => body,
            Decoded::Message(_) => {
                return Err(ProtocolError::UnexpectedDuringHandshake {
                    what: "message".into(),
                }
                .into());
            }
        };
        let metadata = match Command::parse(body)? {
            Command::Ready(md) => md,
            Command::Error { reason } => {
                return Err(Error::PeerError {
                    reason: String::from_utf8_lossy(&reason).into_owned(),
                });
            }
            other => {
                return Err(ProtocolError::UnexpectedDuringHandshake {
                    what: format!("{} command", String::from_utf8_lossy(other.name())),
                }
                .into());
            }
        };
        if let Some(peer_type) = metadata.get("Socket-Type") {
            if !self.socket_type.accepts_peer(peer_type) {
                return Err(ProtocolError::IncompatibleSocketType {
                    peer: String::from_utf8_lossy(peer_type).into_owned(),
                    ours: self.socket_type.as_str(),
                }
                .into());
            }
        }
        let mut peer = self.peer.take().unwrap_or(PeerInfo {
            major: 3,
            minor: 0,
            metadata: Metadata::new(),
        });
        peer.metadata = metadata;
        self.state = State::Active;
        self.handshake_deadline = None;
        let mut limits = *self.decoder.limits();
        match self.socket_type {
            SocketType::Sub | SocketType::Dealer | SocketType::Router => {
                limits.max_command_size = self.config.max_frame_size;
            }
            SocketType::Pub => {
                // A subscriber has nothing to send but subscriptions (a message of
                // `0x01 prefix`, or a command) and heartbeats: a publisher never
                // assembles a larger frame only to ignore it.
                let sub = self.config.max_subscription_size;
                limits.max_frame_size = sub.saturating_add(1).min(limits.max_frame_size);
                limits.max_message_size = sub.saturating_add(1).min(limits.max_message_size);
                limits.max_command_size = sub
                    .saturating_add(16)
                    .max(PUB_MIN_COMMAND_SIZE)
                    .min(self.config.max_frame_size.max(PUB_MIN_COMMAND_SIZE));
            }
        }
        self.decoder.set_limits(limits);
        self.decoder.set_commands_only(false);
        if peer.speaks_3_1() {
            self.next_ping = self
                .config
                .heartbeat_interval
                .and_then(|i| self.last_input.checked_add(i));
        }
        self.peer = Some(peer.clone());
        let prefixes: Vec<Bytes> = self.subscriptions.keys().cloned().collect();
        for prefix in prefixes {
            self.queue_subscription(&prefix, true);
        }
        Ok(Event::Ready(peer))
    }
}
