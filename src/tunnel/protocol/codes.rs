//! The tunnel's closed code sets (DESIGN §7.1): what each side may say about a
//! stream or a drain. Unknown text reads as `Unknown`, so a newer peer's code never
//! fails a session.

macro_rules! closed_codes {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum $name {
            $($(#[$vmeta])* $variant,)*
            /// A code this version does not know.
            Unknown,
        }

        impl $name {
            /// Every known code (not `Unknown`), for bounded metric label sets.
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            /// The code on the wire (`"unknown"` for `Unknown`).
            pub fn as_str(&self) -> &'static str {
                match self {
                    $($name::$variant => $text,)*
                    $name::Unknown => "unknown",
                }
            }

            /// The code `text` names; `Unknown` for any other text.
            pub fn parse(text: &str) -> $name {
                match text {
                    $($text => $name::$variant,)*
                    _ => $name::Unknown,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

closed_codes! {
    /// Why a broker refused a `subscribe` (a closed set; anything else reads as
    /// `Unknown`).
    ///
    /// ```
    /// use eventplane::tunnel::RefuseCode;
    /// assert_eq!(RefuseCode::parse("target_not_advertised"), RefuseCode::TargetNotAdvertised);
    /// assert_eq!(RefuseCode::parse("from_the_future"), RefuseCode::Unknown);
    /// ```
    RefuseCode {
        /// The target is not in the broker's discovery view.
        TargetNotAdvertised = "target_not_advertised",
        /// A resolved address is refused by the broker's address filter.
        AddressFiltered = "address_filtered",
        /// The target's host does not resolve.
        DnsFailed = "dns_failed",
        /// Resolving took longer than its deadline.
        DnsTimeout = "dns_timeout",
        /// No resolved address accepted the connection.
        ConnectFailed = "connect_failed",
        /// Connecting took longer than its deadline.
        ConnectTimeout = "connect_timeout",
        /// No HTTP/2 stream slot within its deadline.
        StreamSlotTimeout = "stream_slot_timeout",
        /// The router's response head did not come within its deadline.
        ResponseTimeout = "response_timeout",
        /// The broker is draining.
        Draining = "draining",
        /// The session's stream limit is reached.
        TooManyStreams = "too_many_streams",
        /// The stream id is already in use.
        DuplicateStream = "duplicate_stream",
        /// The target is not `tcp://host:port`.
        BadTarget = "bad_target",
        /// A data stream for a subscribe the router does not know (late or expired).
        UnknownStream = "unknown_stream",
        /// The data stream failed before the router answered it (reset, or the bus
        /// connection went).
        StreamFailed = "stream_failed",
        /// The session opened streams faster than the broker's `opens_per_second`.
        RateLimited = "rate_limited",
        /// The target's kind is not one this client serves: an `announced` target to
        /// a broker, a `tcp://` one to a source, or a kind this version does not know.
        UnsupportedTarget = "unsupported_target",
        /// A source was asked for a publisher it does not announce (withdrawn, or
        /// never announced).
        TargetNotAnnounced = "target_not_announced",
    }
}

closed_codes! {
    /// Why an open stream ended on the broker's side.
    ///
    /// ```
    /// use eventplane::tunnel::CloseCode;
    /// assert_eq!(CloseCode::BufferOverflow.as_str(), "buffer_overflow");
    /// ```
    CloseCode {
        /// The publisher closed its connection.
        UpstreamClosed = "upstream_closed",
        /// The router read too slowly: the stream's or session's buffer was full.
        BufferOverflow = "buffer_overflow",
    }
}

closed_codes! {
    /// Why a router denied a client's `hello` or a source's `announce` (its credential
    /// does not grant what it claims); the session ends after the `denied` frame.
    ///
    /// ```
    /// use eventplane::tunnel::DenyCode;
    /// assert_eq!(DenyCode::parse("namespace_not_granted"), DenyCode::NamespaceNotGranted);
    /// ```
    DenyCode {
        /// The hello names a client id the credential is not bound to.
        ClientIdNotGranted = "client_id_not_granted",
        /// The hello claims a namespace outside the credential's grant.
        NamespaceNotGranted = "namespace_not_granted",
        /// The hello takes a role (broker or source) the credential does not grant.
        RoleNotGranted = "role_not_granted",
        /// A source announced more publishers than the welcome's `max_sources`.
        TooManySources = "too_many_sources",
        /// A source announced a publisher for a worker its credential does not name.
        WorkerNotGranted = "worker_not_granted",
        /// A source sent `announce` frames faster than 32 at once and 4 a second
        /// after.
        AnnouncingTooFast = "announcing_too_fast",
    }
}

closed_codes! {
    /// Why a router did not take a publisher a source announced (sent back in an
    /// `announce_refused` frame, so the source knows and its readiness fails).
    ///
    /// ```
    /// use eventplane::tunnel::AnnounceRefusal;
    /// assert_eq!(AnnounceRefusal::parse("bus_full"), AnnounceRefusal::BusFull);
    /// ```
    AnnounceRefusal {
        /// Another source's credential holds the channel, or held it within
        /// `EventBusConfig::announced_channel_hold`.
        HeldByAnotherSource = "held_by_another_source",
        /// A newer session of the same client holds it.
        SupersededSession = "superseded_session",
        /// The bus holds `max_announced_sources`, or this credential its share of them.
        BusFull = "bus_full",
    }
}

closed_codes! {
    /// Why a router drains a broker.
    ///
    /// ```
    /// use eventplane::tunnel::DrainReason;
    /// assert_eq!(DrainReason::parse("rebalance"), DrainReason::Rebalance);
    /// ```
    DrainReason {
        /// The router is shutting down.
        Shutdown = "shutdown",
        /// The router moves this broker's subscriptions elsewhere.
        Rebalance = "rebalance",
    }
}

/// Counts per code (a closed set, so the label set is bounded); no allocation per
/// count.
#[derive(Debug, Default)]
pub(crate) struct CodeCounts(std::sync::Mutex<std::collections::HashMap<&'static str, u64>>);

impl CodeCounts {
    pub(crate) fn add(&self, code: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(code)
            .or_default() += 1;
    }

    /// The counts, by code.
    pub(crate) fn snapshot(&self) -> std::collections::HashMap<String, u64> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(code, n)| ((*code).to_owned(), *n))
            .collect()
    }
}
