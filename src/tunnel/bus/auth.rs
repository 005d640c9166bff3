//! Who may open sessions on an event bus, and what each may claim (DESIGN §7.3):
//! per-broker credentials bound to a client id and the namespaces it may cover,
//! stored as SHA-256 digests and compared in constant time.

use crate::tunnel::error::TunnelError;
use crate::tunnel::io::Secret;
use crate::tunnel::protocol::announce::Role;
use crate::tunnel::protocol::broker_session::Grant;
use crate::tunnel::{MAX_NAME_LEN, MAX_NAMESPACES};

/// Most credentials one bus holds.
pub(crate) const MAX_BUS_CLIENTS: usize = 4096;

/// The SHA-256 digest of a bus credential: what a router stores instead of the token.
/// Never printed in full.
///
/// ```
/// use eventplane::tunnel::{Secret, TokenDigest};
/// let digest = TokenDigest::of(&Secret::new("s3cret-token-0123456789")?);
/// let hex = "f1a3fa32dd1b9ee6ef0e1cbc1a1bdb1f3a0e1a53e3e7a9b51c1a2e5f1c0f9c7d";
/// assert!(TokenDigest::from_hex(hex).is_ok());
/// assert_ne!(TokenDigest::from_hex(hex)?, digest);
/// assert!(TokenDigest::from_hex("not hex").is_err());
/// # Ok::<(), eventplane::tunnel::TunnelError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TokenDigest([u8; 32]);

impl std::fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c, d, ..] = self.0;
        write!(f, "TokenDigest({a:02x}{b:02x}{c:02x}{d:02x}…)")
    }
}

impl TokenDigest {
    /// The digest of `token`.
    pub fn of(token: &Secret) -> TokenDigest {
        TokenDigest::of_bytes(token.expose().as_bytes())
    }

    fn of_bytes(bytes: &[u8]) -> TokenDigest {
        let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
        let mut out = [0u8; 32];
        out.copy_from_slice(digest.as_ref());
        TokenDigest(out)
    }

    /// A digest written as 64 hex digits; what follows them after whitespace is
    /// ignored, so `sha256sum`'s `HEX  -` line reads too. Digest the token itself,
    /// without a newline: `printf %s "$TOKEN" | sha256sum`, or
    /// `event-broker --config FILE --print-token-sha256`.
    pub fn from_hex(hex: &str) -> Result<TokenDigest, TunnelError> {
        let bad = || TunnelError::Config {
            field: "token_sha256",
            reason: "is not 64 hex digits".into(),
        };
        let hex = hex.split_whitespace().next().unwrap_or_default().as_bytes();
        if hex.len() != 64 {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (byte, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
            let digit = |c: u8| (c as char).to_digit(16).ok_or_else(bad);
            let (hi, lo) = match pair {
                [hi, lo] => (digit(*hi)?, digit(*lo)?),
                _ => return Err(bad()),
            };
            *byte = (hi * 16 + lo) as u8;
        }
        Ok(TokenDigest(out))
    }

    /// The digest as 64 lowercase hex digits (what `sha256sum` prints; a
    /// `--bus-clients` file holds this).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Compares every byte, whatever differs (the fold is kept opaque to the
    /// optimiser). Digests, not tokens, are compared: timing reveals nothing of a
    /// token.
    fn equals(&self, other: &TokenDigest) -> bool {
        let diff = self
            .0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |diff, (a, b)| diff | (a ^ b));
        std::hint::black_box(diff) == 0
    }
}

/// One credential and what it grants.
#[derive(Debug, Clone)]
struct Client {
    digest: TokenDigest,
    grant: Grant,
    namespaces: Vec<String>,
}

/// The credentials an [`EventBus`](crate::tunnel::EventBus) accepts, and what each grants
/// (DESIGN §7.3).
///
/// - [`broker`](Self::broker): one credential per broker, bound to its `client_id`
///   and the namespaces it may cover. A hello naming another client id or another
///   namespace is denied (`denied{client_id_not_granted | namespace_not_granted}`,
///   counted in [`BusStats::denied`](crate::tunnel::BusStats)), so a broker can neither
///   supersede another nor claim its namespaces.
/// - [`shared`](Self::shared): one token for a single trusted broker (any client id
///   not bound to a per-broker credential, the namespaces given). Whoever holds it may
///   take over any such client id.
///
/// The router tunnels only granted namespaces: a publisher in a namespace no
/// credential grants is dialled directly ([`grants`](Self::grants)). Tokens are kept
/// only as SHA-256 digests (unsalted: use random tokens of 32 bytes or more, e.g.
/// `openssl rand -hex 32`), every stored digest is compared on each request; none
/// is ever logged. A client id may not end in `.check` (the suffix names the session
/// `event-broker --check-bus` opens under its credential).
///
/// ```
/// use eventplane::tunnel::{BusClients, Secret, TokenDigest};
/// let token_a = Secret::new("token-of-broker-a")?;
/// let clients = BusClients::new()
///     .broker("broker-a", TokenDigest::of(&token_a), vec!["prod".into()])?
///     .broker("broker-b", TokenDigest::from_hex(&"ab".repeat(32))?, vec!["prod".into(), "dev".into()])?;
/// assert!(clients.grants("dev"));
/// assert!(!clients.grants("staging"));
/// // The same client id, or the same token, twice is refused.
/// assert!(clients.clone().broker("broker-a", TokenDigest::of(&Secret::new("another-token-0123456789")?), vec!["prod".into()]).is_err());
/// # Ok::<(), eventplane::tunnel::TunnelError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct BusClients {
    clients: Vec<Client>,
}

/// An authenticated credential: its index in the bus's list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Identity(pub(crate) usize);

impl BusClients {
    /// No credential yet (a bus with none accepts no broker).
    pub fn new() -> BusClients {
        BusClients::default()
    }

    /// A single trusted broker's token: any client id not bound to a per-broker
    /// credential (nor its `.check`), only `namespaces`.
    ///
    /// ```
    /// use eventplane::tunnel::{BusClients, Secret};
    /// let clients = BusClients::shared(&Secret::new("one-trusted-token")?, vec!["prod".into()])?;
    /// assert!(clients.grants("prod"));
    /// # Ok::<(), eventplane::tunnel::TunnelError>(())
    /// ```
    pub fn shared(token: &Secret, namespaces: Vec<String>) -> Result<BusClients, TunnelError> {
        BusClients::new().add(
            TokenDigest::of(token),
            Grant::namespaces(namespaces.clone()).with_role(Role::Broker),
            namespaces,
        )
    }

    /// With broker `client_id`, which authenticates with the token whose digest is
    /// `token_sha256`, allowed to cover `namespaces`.
    pub fn broker(
        self,
        client_id: impl Into<String>,
        token_sha256: TokenDigest,
        namespaces: Vec<String>,
    ) -> Result<BusClients, TunnelError> {
        self.bound(Role::Broker, client_id.into(), token_sha256, namespaces)
    }

    /// With source `client_id` (a KV listener that dials out and announces its own
    /// publishers, DESIGN §7.4), which authenticates with the token whose digest is
    /// `token_sha256`, allowed to announce publishers of `namespaces` only. A source's
    /// namespaces are not tunnelled through brokers ([`grants`](Self::grants)).
    ///
    /// ```
    /// use eventplane::tunnel::{BusClients, TokenDigest};
    /// let clients = BusClients::new().source("gpu-box-1", TokenDigest::from_hex(&"cd".repeat(32))?, vec!["edge".into()])?;
    /// assert!(!clients.grants("edge")); // no broker covers it
    /// # Ok::<(), eventplane::tunnel::TunnelError>(())
    /// ```
    pub fn source(
        self,
        client_id: impl Into<String>,
        token_sha256: TokenDigest,
        namespaces: Vec<String>,
    ) -> Result<BusClients, TunnelError> {
        self.bound(Role::Source, client_id.into(), token_sha256, namespaces)
    }

    /// With source `client_id`, as [`source`](Self::source) does, allowed to
    /// announce publishers only for workers `worker_ids` (a credential leaked from one
    /// GPU box cannot speak for the workers of another).
    ///
    /// ```
    /// use eventplane::tunnel::{BusClients, TokenDigest};
    /// let clients = BusClients::new()
    ///     .source_for_workers("gpu-box-1", TokenDigest::from_hex(&"cd".repeat(32))?, vec!["prod".into()], vec![7, 8])?;
    /// assert_eq!(clients.len(), 1);
    /// # Ok::<(), eventplane::tunnel::TunnelError>(())
    /// ```
    pub fn source_for_workers(
        self,
        client_id: impl Into<String>,
        token_sha256: TokenDigest,
        namespaces: Vec<String>,
        worker_ids: Vec<u64>,
    ) -> Result<BusClients, TunnelError> {
        let mut clients = self.bound(Role::Source, client_id.into(), token_sha256, namespaces)?;
        if let Some(last) = clients.clients.last_mut() {
            last.grant = last.grant.clone().with_workers(worker_ids);
        }
        Ok(clients)
    }

    fn bound(
        self,
        role: Role,
        client_id: String,
        token_sha256: TokenDigest,
        namespaces: Vec<String>,
    ) -> Result<BusClients, TunnelError> {
        if client_id.is_empty() || client_id.len() > MAX_NAME_LEN {
            return Err(TunnelError::Config {
                field: "client_id",
                reason: format!("must be 1 to {MAX_NAME_LEN} bytes"),
            });
        }
        if client_id.ends_with(".check") {
            return Err(TunnelError::Config {
                field: "client_id",
                reason: format!("{client_id:?} ends in .check, the suffix of --check-bus sessions"),
            });
        }
        if self
            .clients
            .iter()
            .any(|c| c.grant.client_id() == Some(client_id.as_str()))
        {
            return Err(TunnelError::Config {
                field: "client_id",
                reason: format!("{client_id:?} is granted twice"),
            });
        }
        let grant = Grant::namespaces(namespaces.clone())
            .with_client_id(client_id)
            .with_role(role);
        self.add(token_sha256, grant, namespaces)
    }

    fn add(
        mut self,
        digest: TokenDigest,
        grant: Grant,
        namespaces: Vec<String>,
    ) -> Result<BusClients, TunnelError> {
        let refuse = |field, reason: String| Err(TunnelError::Config { field, reason });
        if namespaces.is_empty() || namespaces.len() > MAX_NAMESPACES {
            return refuse("namespaces", format!("must name 1 to {MAX_NAMESPACES}"));
        }
        if namespaces
            .iter()
            .any(|n| n.is_empty() || n.len() > MAX_NAME_LEN)
        {
            return refuse(
                "namespaces",
                format!("each must be 1 to {MAX_NAME_LEN} bytes"),
            );
        }
        if self.clients.iter().any(|c| c.digest.equals(&digest)) {
            return refuse("token_sha256", "the same token is granted twice".into());
        }
        if self.clients.len() >= MAX_BUS_CLIENTS {
            return refuse("clients", format!("more than {MAX_BUS_CLIENTS}"));
        }
        self.clients.push(Client {
            digest,
            grant,
            namespaces,
        });
        Ok(self)
    }

    /// Whether any broker credential may cover `namespace` (its publishers are then
    /// reached through brokers, not dialled directly). Source credentials do not
    /// count: a source serves only what it announces.
    pub fn grants(&self, namespace: &str) -> bool {
        self.clients.iter().any(|c| {
            c.grant.role() != Some(Role::Source) && c.namespaces.iter().any(|n| n == namespace)
        })
    }

    /// Whether any credential is a source's.
    pub fn has_sources(&self) -> bool {
        self.clients
            .iter()
            .any(|c| c.grant.role() == Some(Role::Source))
    }

    /// How many credentials grant the source role.
    pub(crate) fn sources(&self) -> usize {
        self.clients
            .iter()
            .filter(|c| c.grant.role() == Some(Role::Source))
            .count()
    }

    /// How many credentials it holds.
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The credential an `Authorization: Bearer …` header presents, if any: every
    /// stored digest is compared, in constant time, whatever matches.
    pub(crate) fn authenticate(&self, header: Option<&[u8]>) -> Option<Identity> {
        let token = header?.strip_prefix(b"Bearer ")?;
        let presented = TokenDigest::of_bytes(token);
        let mut found = None;
        for (i, client) in self.clients.iter().enumerate() {
            if client.digest.equals(&presented) {
                found = Some(Identity(i));
            }
        }
        found
    }

    /// What `identity` grants. A credential not bound to a client id may claim none
    /// that another credential is bound to.
    pub(crate) fn grant(&self, identity: Identity) -> Grant {
        let Some(client) = self.clients.get(identity.0) else {
            return Grant::namespaces(Vec::new());
        };
        if client.grant.client_id().is_some() {
            return client.grant.clone();
        }
        let bound = self
            .clients
            .iter()
            .filter_map(|c| c.grant.client_id().map(str::to_owned))
            .collect();
        client.grant.clone().reserving(bound)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_token_authenticates_as_its_own_broker_only() {
        let (a, b) = (
            Secret::new("token-of-a-0123456789").unwrap(),
            Secret::new("token-of-b-0123456789").unwrap(),
        );
        let clients = BusClients::new()
            .broker("a", TokenDigest::of(&a), vec!["prod".into()])
            .unwrap()
            .broker("b", TokenDigest::of(&b), vec!["dev".into()])
            .unwrap();
        let header = |t: &str| format!("Bearer {t}");
        assert_eq!(
            clients.authenticate(Some(header("token-of-a-0123456789").as_bytes())),
            Some(Identity(0))
        );
        assert_eq!(
            clients.authenticate(Some(header("token-of-b-0123456789").as_bytes())),
            Some(Identity(1))
        );
        assert_eq!(clients.authenticate(Some(b"Bearer token-c")), None);
        assert_eq!(clients.authenticate(Some(b"token-of-a-0123456789")), None);
        assert_eq!(clients.authenticate(None), None);
        assert_eq!(clients.grant(Identity(1)).client_id(), Some("b"));
        assert!(!clients.grant(Identity(1)).covers("prod"));
        assert!(
            BusClients::new()
                .broker("a.check", TokenDigest::of(&a), vec!["prod".into()])
                .is_err()
        );
    }

    #[test]
    fn a_shared_token_cannot_claim_a_bound_client_id() {
        use crate::tunnel::{DenyCode, Hello};
        let shared = Secret::new("shared-token-0123456789").unwrap();
        let clients = BusClients::shared(&shared, vec!["prod".into()])
            .unwrap()
            .broker(
                "broker-a",
                TokenDigest::of(&Secret::new("token-of-a-0123456789").unwrap()),
                vec!["prod".into()],
            )
            .unwrap();
        let grant = clients.grant(Identity(0));
        let hello = |id: &str| Hello::new(id, vec!["prod".into()]);
        assert_eq!(
            grant.check(&hello("broker-a")),
            Err(DenyCode::ClientIdNotGranted)
        );
        assert_eq!(
            grant.check(&hello("broker-a.check")),
            Err(DenyCode::ClientIdNotGranted)
        );
        assert_eq!(grant.check(&hello("anyone-else")), Ok(()));
    }

    #[test]
    fn a_digest_reads_as_sha256sum_prints_it() {
        // printf %s abc | sha256sum
        let hex = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(
            TokenDigest::from_hex(hex).unwrap(),
            TokenDigest::of_bytes(b"abc")
        );
        assert_eq!(
            TokenDigest::from_hex(&hex.to_uppercase()).unwrap(),
            TokenDigest::from_hex(hex).unwrap()
        );
        // sha256sum's own line.
        assert_eq!(
            TokenDigest::from_hex(&format!("{hex}  -\n")).unwrap(),
            TokenDigest::from_hex(hex).unwrap()
        );
        for bad in ["", "ab", &hex.replace('b', "g"), &format!("{hex}00")] {
            assert!(TokenDigest::from_hex(bad).is_err(), "{bad}");
        }
        assert!(!format!("{:?}", TokenDigest::from_hex(hex).unwrap()).contains(hex));
        assert_eq!(TokenDigest::from_hex(hex).unwrap().to_hex(), hex);
    }
}
