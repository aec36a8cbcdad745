//! The job's unique id and the connection handshake's keyed hash.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use crate::error::BootstrapError;
use crate::frame::Purpose;

/// Identifies one job: where its rendezvous root listens, and a random 128-bit
/// secret every connection must prove it knows.
///
/// Printed as `gin1:<32 hex digits>@<ip:port>` so it can travel in an
/// environment variable (`GIN_UNIQUE_ID`); [`FromStr`] parses the same text.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId {
    /// The root's listening address.
    pub addr: SocketAddr,
    /// The job secret.
    pub secret: [u8; 16],
}

impl UniqueId {
    /// A fresh id for a root listening at `addr`, with a secret from the OS.
    pub fn new(addr: SocketAddr) -> Result<Self, BootstrapError> {
        let mut secret = [0u8; 16];
        getrandom::fill(&mut secret).map_err(|e| BootstrapError::Io {
            rank: None,
            context: "drawing the job secret from the OS".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(Self { addr, secret })
    }

    /// An id whose secret is derived from a job identifier that every rank
    /// already shares (a launcher's job id), for launchers that hand out only a
    /// root address. Such a secret keeps strangers and other jobs out by
    /// accident, not by design: use `GIN_UNIQUE_ID` where that matters.
    pub fn derived(addr: SocketAddr, job_key: &str) -> Self {
        let h = blake3::derive_key("gin-rs bootstrap v1 derived job secret", job_key.as_bytes());
        let mut secret = [0u8; 16];
        secret.copy_from_slice(&h[..16]);
        Self { addr, secret }
    }

    /// A key for another protocol of the same job, derived from the secret.
    pub(crate) fn derive_token(&self, purpose: &str) -> [u8; 32] {
        let mut h = blake3::Hasher::new_derive_key("gin-rs job token v1");
        h.update(&self.secret);
        h.update(purpose.as_bytes());
        *h.finalize().as_bytes()
    }

    fn mac_key(&self) -> [u8; 32] {
        blake3::derive_key("gin-rs bootstrap v1 handshake", &self.secret)
    }

    /// The answer to a challenge: binds the nonce to who is dialing and why.
    pub(crate) fn mac(
        &self,
        nonce: &[u8; 16],
        purpose: Purpose,
        rank: u32,
        nranks: u32,
        listen_addr: &str,
    ) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.mac_key());
        h.update(nonce);
        h.update(&[purpose as u8]);
        h.update(&rank.to_le_bytes());
        h.update(&nranks.to_le_bytes());
        h.update(listen_addr.as_bytes());
        *h.finalize().as_bytes()
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gin1:")?;
        for b in self.secret {
            write!(f, "{b:02x}")?;
        }
        write!(f, "@{}", self.addr)
    }
}

/// The secret is not printed by `Debug`, so ids can appear in logs.
impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("addr", &self.addr)
            .field("secret", &"<hidden>")
            .finish()
    }
}

impl FromStr for UniqueId {
    type Err = BootstrapError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| BootstrapError::BadUniqueId {
            text: s.to_owned(),
            why: why.to_owned(),
        };
        let rest = s
            .strip_prefix("gin1:")
            .ok_or_else(|| bad("expected it to start with \"gin1:\""))?;
        let (hex, addr) = rest
            .split_once('@')
            .ok_or_else(|| bad("expected <secret>@<address>"))?;
        if hex.len() != 32 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad("the secret must be 32 hexadecimal digits"));
        }
        let mut secret = [0u8; 16];
        for (i, b) in secret.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| bad("the secret must be 32 hexadecimal digits"))?;
        }
        let addr = resolve(addr).map_err(|why| bad(&why))?;
        Ok(Self { addr, secret })
    }
}

/// Parses `ip:port` or resolves `host:port` to its first address.
pub(crate) fn resolve(text: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = text.parse() {
        return Ok(a);
    }
    text.to_socket_addrs()
        .map_err(|e| format!("cannot resolve address {text:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("address {text:?} resolves to nothing"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn display_parse_roundtrip(secret in any::<[u8; 16]>(), port in any::<u16>(), v6 in any::<bool>(), ip in any::<[u8; 16]>()) {
            let addr: SocketAddr = if v6 {
                (std::net::Ipv6Addr::from(ip), port).into()
            } else {
                (std::net::Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]), port).into()
            };
            let id = UniqueId { addr, secret };
            let back: UniqueId = id.to_string().parse().unwrap();
            prop_assert_eq!(back, id);
        }
    }

    #[test]
    fn malformed_ids_say_what_is_wrong() {
        for (text, why) in [
            ("nope", "gin1:"),
            ("gin1:abc", "<secret>@<address>"),
            ("gin1:zz@127.0.0.1:1", "32 hexadecimal"),
            (
                "gin1:000102030405060708090a0b0c0d0e0f@not an address",
                "cannot resolve",
            ),
        ] {
            let e = text.parse::<UniqueId>().unwrap_err().to_string();
            assert!(e.contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn debug_hides_the_secret() {
        let id = UniqueId {
            addr: "127.0.0.1:5".parse().unwrap(),
            secret: [0xee; 16],
        };
        assert!(!format!("{id:?}").contains("ee"));
    }

    #[test]
    fn mac_depends_on_every_field() {
        let id = UniqueId {
            addr: "127.0.0.1:5".parse().unwrap(),
            secret: [1; 16],
        };
        let base = id.mac(&[0; 16], Purpose::Peer, 1, 4, "");
        assert_ne!(base, id.mac(&[1; 16], Purpose::Peer, 1, 4, ""));
        assert_ne!(base, id.mac(&[0; 16], Purpose::Root, 1, 4, ""));
        assert_ne!(base, id.mac(&[0; 16], Purpose::Peer, 2, 4, ""));
        assert_ne!(base, id.mac(&[0; 16], Purpose::Peer, 1, 5, ""));
        assert_ne!(base, id.mac(&[0; 16], Purpose::Peer, 1, 4, "x"));
        let other = UniqueId {
            secret: [2; 16],
            ..id
        };
        assert_ne!(base, other.mac(&[0; 16], Purpose::Peer, 1, 4, ""));
    }
}
