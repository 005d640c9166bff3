//! `AddrFilter`: which resolved addresses a subscriber may dial.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

/// An address range `addr/prefix`.
///
/// ```
/// use eventplane::net::Cidr;
/// let net: Cidr = "10.0.0.0/8".parse()?;
/// assert!(net.contains("10.1.2.3".parse().unwrap()));
/// assert!(!net.contains("11.0.0.1".parse().unwrap()));
/// # Ok::<(), eventplane::net::CidrError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

/// A string that is not `addr/prefix`.
///
/// ```
/// use eventplane::net::Cidr;
/// assert!("10.0.0.0/33".parse::<Cidr>().is_err());
/// assert!("not a network".parse::<Cidr>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid CIDR {input:?}")]
pub struct CidrError {
    input: String,
}

impl Cidr {
    /// `addr/prefix`; `None` when the prefix is too long for the family.
    pub fn new(addr: IpAddr, prefix: u8) -> Option<Cidr> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (prefix <= max).then_some(Cidr { addr, prefix })
    }

    const fn v4(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> Cidr {
        Cidr {
            addr: IpAddr::V4(Ipv4Addr::new(a, b, c, d)),
            prefix,
        }
    }

    const fn v6(segments: [u16; 8], prefix: u8) -> Cidr {
        let [a, b, c, d, e, f, g, h] = segments;
        Cidr {
            addr: IpAddr::V6(Ipv6Addr::new(a, b, c, d, e, f, g, h)),
            prefix,
        }
    }

    /// Whether `ip` lies in this range (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            _ => false,
        }
    }

    /// Whether all of `self` lies inside `outer`.
    pub fn is_within(&self, outer: &Cidr) -> bool {
        self.prefix >= outer.prefix && outer.contains(self.addr)
    }
}

fn prefix_eq(a: &[u8], b: &[u8], prefix: u8) -> bool {
    let full = usize::from(prefix / 8);
    let rest = prefix % 8;
    if a.get(..full) != b.get(..full) {
        return false;
    }
    if rest == 0 {
        return true;
    }
    let mask = 0xffu8 << (8 - rest);
    match (a.get(full), b.get(full)) {
        (Some(x), Some(y)) => x & mask == y & mask,
        _ => false,
    }
}

/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`) as IPv4; everything else unchanged.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => ip,
        },
        v4 => v4,
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Cidr, CidrError> {
        let err = || CidrError {
            input: s.to_owned(),
        };
        let (addr, prefix) = s.split_once('/').ok_or_else(err)?;
        let addr: IpAddr = addr.parse().map_err(|_| err())?;
        let prefix: u8 = prefix.parse().map_err(|_| err())?;
        Cidr::new(canonical(addr), prefix).ok_or_else(err)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// The always-special address ranges (loopback, unspecified, link-local, multicast, …)
/// that an [`AddrFilter`] judges apart from ordinary addresses.
///
/// ```
/// use eventplane::net::SpecialRange;
/// let (range, _cidr) = SpecialRange::of("169.254.169.254".parse().unwrap()).unwrap();
/// assert_eq!(range, SpecialRange::LinkLocal);
/// assert!(SpecialRange::of("10.1.2.3".parse().unwrap()).is_none());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SpecialRange {
    /// 127.0.0.0/8, ::1.
    Loopback,
    /// 0.0.0.0/8, ::.
    Unspecified,
    /// 169.254.0.0/16 (cloud metadata at 169.254.169.254), fe80::/10.
    LinkLocal,
    /// 224.0.0.0/4, ff00::/8.
    Multicast,
    /// 255.255.255.255.
    Broadcast,
    /// fd00:ec2::254, the EC2 IPv6 metadata endpoint.
    MetadataV6,
    /// Cloud metadata endpoints outside link-local: 100.100.100.200 (Alibaba Cloud)
    /// and 168.63.129.16 (Azure's wire server).
    Metadata,
    /// 64:ff9b:1::/48, NAT64's local-use prefix (RFC 8215): where its IPv4 address
    /// sits depends on the site's prefix length, so the whole range is refused
    /// unless reopened.
    Nat64Local,
}

const SPECIAL: [(SpecialRange, Cidr); 13] = [
    (SpecialRange::Loopback, Cidr::v4(127, 0, 0, 0, 8)),
    (
        SpecialRange::Loopback,
        Cidr::v6([0, 0, 0, 0, 0, 0, 0, 1], 128),
    ),
    (SpecialRange::Unspecified, Cidr::v4(0, 0, 0, 0, 8)),
    (SpecialRange::Unspecified, Cidr::v6([0; 8], 128)),
    (SpecialRange::LinkLocal, Cidr::v4(169, 254, 0, 0, 16)),
    (
        SpecialRange::LinkLocal,
        Cidr::v6([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10),
    ),
    (SpecialRange::Multicast, Cidr::v4(224, 0, 0, 0, 4)),
    (
        SpecialRange::Multicast,
        Cidr::v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8),
    ),
    (SpecialRange::Broadcast, Cidr::v4(255, 255, 255, 255, 32)),
    (
        SpecialRange::MetadataV6,
        Cidr::v6([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254], 128),
    ),
    (SpecialRange::Metadata, Cidr::v4(100, 100, 100, 200, 32)),
    (SpecialRange::Metadata, Cidr::v4(168, 63, 129, 16, 32)),
    (
        SpecialRange::Nat64Local,
        Cidr::v6([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48),
    ),
];

/// SIIT's IPv4-translated addresses (RFC 2765), `::ffff:0:a.b.c.d`.
const SIIT: Cidr = Cidr::v6([0, 0, 0, 0, 0xffff, 0, 0, 0], 96);

/// NAT64's well-known prefix (RFC 6052): the IPv4 address is the last 32 bits.
const NAT64: Cidr = Cidr::v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96);
/// 6to4 (RFC 3056): the IPv4 address is bits 16..48.
const SIX_TO_FOUR: Cidr = Cidr::v6([0x2002, 0, 0, 0, 0, 0, 0, 0], 16);

/// The IPv4 address an IPv6 address carries to an IPv4 host (IPv4-mapped, SIIT's
/// IPv4-translated, NAT64's well-known prefix, 6to4), if any: a gateway on the path
/// delivers to it.
fn embedded_v4(ip: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = ip else {
        return None;
    };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let o = v6.octets();
    if NAT64.contains(ip) || SIIT.contains(ip) {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if SIX_TO_FOUR.contains(ip) {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

impl SpecialRange {
    /// The special range `ip` falls in, if any: IPv4-mapped and IPv4-translated
    /// (`::ffff:0:0/96`) forms, and IPv4 addresses embedded in NAT64 (`64:ff9b::/96`)
    /// or 6to4 (`2002::/16`) addresses, are judged by the IPv4 address they reach
    /// (the range returned is then the IPv4 one). An allow-list entry is matched
    /// against the address as written, a special range against the address reached:
    /// to reopen loopback behind NAT64, both `64:ff9b::/96` and `127.0.0.0/8` must be
    /// allowed.
    ///
    /// ```
    /// use eventplane::net::SpecialRange;
    /// let (range, _) = SpecialRange::of("64:ff9b::7f00:1".parse().unwrap()).unwrap();
    /// assert_eq!(range, SpecialRange::Loopback);
    /// let (range, _) = SpecialRange::of("2002:a9fe:a9fe::".parse().unwrap()).unwrap();
    /// assert_eq!(range, SpecialRange::LinkLocal);
    /// ```
    pub fn of(ip: IpAddr) -> Option<(SpecialRange, Cidr)> {
        let ip = embedded_v4(ip).map_or(ip, IpAddr::V4);
        SPECIAL.iter().copied().find(|(_, cidr)| cidr.contains(ip))
    }
}

/// Why an address was refused.
///
/// ```
/// use eventplane::net::{AddrFilter, Refusal};
/// let refusal = AddrFilter::default().check("169.254.169.254".parse().unwrap()).unwrap_err();
/// assert!(matches!(refusal, Refusal::Special { .. }));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// It lies in a special range the policy does not open.
    #[error("{addr} is in a special range ({range:?})")]
    Special {
        /// The address.
        addr: IpAddr,
        /// The range.
        range: SpecialRange,
    },
    /// `allowed_cidrs` is set and none contains it.
    #[error("{addr} is outside the allowed networks")]
    NotAllowed {
        /// The address.
        addr: IpAddr,
    },
}

/// Decides which resolved addresses may be dialled — checked on every resolved
/// address at dial time, so DNS rebinding cannot smuggle in a metadata address.
///
/// The default policy allows loopback (local development) and refuses the other
/// special ranges; [`strict`](Self::strict) refuses loopback too (a broker's default:
/// it runs next to sidecars and admin ports that only loopback reaches). With
/// [`allow_cidr`](Self::allow_cidr) everything outside the allowed networks is
/// refused, and a special range reopens only through a CIDR that lies entirely inside
/// it (`0.0.0.0/0` reopens none).
///
/// ```
/// use eventplane::net::AddrFilter;
/// let filter = AddrFilter::default().allow_cidr("10.0.0.0/8".parse()?);
/// assert!(filter.check("10.1.2.3".parse().unwrap()).is_ok());
/// assert!(filter.check("192.168.1.1".parse().unwrap()).is_err());
/// assert!(AddrFilter::default().check("169.254.169.254".parse().unwrap()).is_err());
/// # Ok::<(), eventplane::net::CidrError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddrFilter {
    deny_loopback: bool,
    allowed: Vec<Cidr>,
}

impl AddrFilter {
    /// Refuses loopback too.
    pub fn strict() -> AddrFilter {
        AddrFilter {
            deny_loopback: true,
            allowed: Vec::new(),
        }
    }

    /// Adds an allowed network (once any is set, everything outside them is refused).
    #[must_use]
    pub fn allow_cidr(mut self, cidr: Cidr) -> AddrFilter {
        self.allowed.push(cidr);
        self
    }

    /// Checks one resolved address.
    pub fn check(&self, ip: IpAddr) -> Result<(), Refusal> {
        let ip = canonical(ip);
        if !self.allowed.is_empty() && !self.allowed.iter().any(|c| c.contains(ip)) {
            return Err(Refusal::NotAllowed { addr: ip });
        }
        let Some((range, cidr)) = SpecialRange::of(ip) else {
            return Ok(());
        };
        // Judged by the IPv4 address a NAT64 or 6to4 address reaches.
        let reached = embedded_v4(ip).map_or(ip, IpAddr::V4);
        let reopened = self
            .allowed
            .iter()
            .any(|c| c.is_within(&cidr) && c.contains(reached));
        let loopback_ok = range == SpecialRange::Loopback && !self.deny_loopback;
        if reopened || loopback_ok {
            Ok(())
        } else {
            Err(Refusal::Special { addr: ip, range })
        }
    }

    /// Checks a socket address.
    pub fn check_socket(&self, addr: SocketAddr) -> Result<(), Refusal> {
        self.check(addr.ip())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn special_ranges_table() {
        let cases: &[(&str, Option<SpecialRange>)] = &[
            ("127.0.0.1", Some(SpecialRange::Loopback)),
            ("127.255.0.9", Some(SpecialRange::Loopback)),
            ("::1", Some(SpecialRange::Loopback)),
            ("::ffff:127.0.0.1", Some(SpecialRange::Loopback)),
            ("0.0.0.0", Some(SpecialRange::Unspecified)),
            ("::", Some(SpecialRange::Unspecified)),
            ("::ffff:0.0.0.0", Some(SpecialRange::Unspecified)),
            ("169.254.169.254", Some(SpecialRange::LinkLocal)),
            ("169.254.0.1", Some(SpecialRange::LinkLocal)),
            ("::ffff:169.254.169.254", Some(SpecialRange::LinkLocal)),
            ("fe80::1", Some(SpecialRange::LinkLocal)),
            ("febf::1", Some(SpecialRange::LinkLocal)),
            ("224.0.0.1", Some(SpecialRange::Multicast)),
            ("239.255.255.250", Some(SpecialRange::Multicast)),
            ("ff02::1", Some(SpecialRange::Multicast)),
            ("::ffff:224.0.0.1", Some(SpecialRange::Multicast)),
            ("255.255.255.255", Some(SpecialRange::Broadcast)),
            ("::ffff:255.255.255.255", Some(SpecialRange::Broadcast)),
            ("fd00:ec2::254", Some(SpecialRange::MetadataV6)),
            ("100.100.100.200", Some(SpecialRange::Metadata)),
            ("168.63.129.16", Some(SpecialRange::Metadata)),
            ("::ffff:168.63.129.16", Some(SpecialRange::Metadata)),
            // NAT64 and 6to4 reach the IPv4 address they embed.
            ("64:ff9b::7f00:1", Some(SpecialRange::Loopback)),
            ("64:ff9b::a9fe:a9fe", Some(SpecialRange::LinkLocal)),
            ("64:ff9b::6464:64c8", Some(SpecialRange::Metadata)),
            ("2002:7f00:1::1", Some(SpecialRange::Loopback)),
            ("2002:a9fe:a9fe::", Some(SpecialRange::LinkLocal)),
            ("2002:a83f:8110:1::", Some(SpecialRange::Metadata)),
            ("::ffff:0:7f00:1", Some(SpecialRange::Loopback)),
            ("::ffff:0:a9fe:a9fe", Some(SpecialRange::LinkLocal)),
            ("64:ff9b:1::7f00:1", Some(SpecialRange::Nat64Local)),
            ("64:ff9b:1:ffff::", Some(SpecialRange::Nat64Local)),
            ("64:ff9b::a00:5", None),
            ("::ffff:0:a00:5", None),
            ("2002:a00:5::1", None),
            ("100.100.100.201", None),
            ("10.0.0.5", None),
            ("192.168.1.1", None),
            ("8.8.8.8", None),
            ("fec0::1", None),
            ("fd00:ec2::253", None),
            ("2001:db8::1", None),
        ];
        for (addr, want) in cases {
            assert_eq!(SpecialRange::of(ip(addr)).map(|(r, _)| r), *want, "{addr}");
            let verdict = AddrFilter::default().check(ip(addr));
            let allowed = matches!(want, None | Some(SpecialRange::Loopback));
            assert_eq!(verdict.is_ok(), allowed, "{addr}: {verdict:?}");
            let strict = AddrFilter::strict().check(ip(addr));
            assert_eq!(strict.is_ok(), want.is_none(), "strict {addr}: {strict:?}");
        }
    }

    #[test]
    fn allowed_cidrs() {
        let f = AddrFilter::default()
            .allow_cidr("10.0.0.0/8".parse().unwrap())
            .allow_cidr("2001:db8::/32".parse().unwrap());
        assert!(f.check(ip("10.9.8.7")).is_ok());
        assert!(f.check(ip("::ffff:10.9.8.7")).is_ok());
        assert!(f.check(ip("2001:db8::5")).is_ok());
        assert!(matches!(
            f.check(ip("11.0.0.1")),
            Err(Refusal::NotAllowed { .. })
        ));
        // With an allow-list, loopback outside it is refused too.
        assert!(f.check(ip("127.0.0.1")).is_err());
    }

    #[test]
    fn everything_cidr_reopens_no_special_range() {
        let f = AddrFilter::strict()
            .allow_cidr("0.0.0.0/0".parse().unwrap())
            .allow_cidr("::/0".parse().unwrap());
        assert!(f.check(ip("8.8.8.8")).is_ok());
        for special in [
            "169.254.169.254",
            "127.0.0.1",
            "224.0.0.1",
            "::1",
            "fd00:ec2::254",
            "0.0.0.0",
        ] {
            assert!(
                matches!(f.check(ip(special)), Err(Refusal::Special { .. })),
                "{special}"
            );
        }
        // A CIDR inside a special range reopens exactly that part.
        let lo = AddrFilter::strict().allow_cidr("127.0.0.0/8".parse().unwrap());
        assert!(lo.check(ip("127.0.0.1")).is_ok());
        let one = AddrFilter::default().allow_cidr("169.254.10.0/24".parse().unwrap());
        assert!(one.check(ip("169.254.10.7")).is_ok());
        assert!(one.check(ip("169.254.169.254")).is_err());
    }

    #[test]
    fn cidr_parsing() {
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("10.0.0.0".parse::<Cidr>().is_err());
        assert!("x/8".parse::<Cidr>().is_err());
        assert_eq!(
            "::ffff:10.0.0.0/8".parse::<Cidr>().unwrap().to_string(),
            "10.0.0.0/8"
        );
        let c: Cidr = "10.0.0.0/7".parse().unwrap();
        assert!(c.contains(ip("11.255.0.1")));
        assert!(!c.contains(ip("12.0.0.1")));
    }
}
