//! The bootstrap wire format: pure encode / decode, no sockets.
//!
//! Every message on a bootstrap connection is one frame:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `b"GINB"` |
//! | 4 | 1 | format version ([`VERSION`]) |
//! | 5 | 1 | kind ([`Kind`]) |
//! | 6 | 2 | flags, must be zero |
//! | 8 | 8 | tag (little-endian u64; message matching for `Data`, zero otherwise) |
//! | 16 | 4 | payload length (little-endian u32) |
//! | 20 | n | payload |
//!
//! Integers inside payloads are little-endian; strings and byte lists carry a
//! u32 length prefix. A decoder never trusts a length: the header's length is
//! checked against a limit before anything is allocated, and the payload is
//! read in bounded chunks, so a truncated or lying frame costs at most what
//! was actually received.

use std::fmt;
use std::io::{self, Read};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"GINB";
/// The wire format version this build speaks.
pub const VERSION: u8 = 1;
/// Size of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 20;
/// Default largest payload accepted (1 GiB); see [`crate::Config::max_frame`].
pub const DEFAULT_MAX_PAYLOAD: usize = 1 << 30;
/// Payloads are read at most this many bytes at a time, so a frame that claims
/// a huge length but stops early never causes a huge allocation.
const READ_CHUNK: usize = 1 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Acceptor → dialer: a fresh nonce the dialer must answer.
    Challenge = 1,
    /// Dialer → acceptor: identity plus the keyed-hash answer.
    Hello = 2,
    /// Acceptor → dialer: the answer was right.
    Welcome = 3,
    /// Acceptor → dialer: refused, with a reason.
    Refuse = 4,
    /// Root → rank: every rank's listening address.
    Table = 5,
    /// Rank → rank: user or collective payload.
    Data = 6,
    /// Orderly close: the sender will send nothing more.
    Goodbye = 7,
    /// Root → rank: a rank vanished without a goodbye.
    PeerDied = 8,
    /// Root → rank: the rendezvous failed (timeout or bad input).
    Abort = 9,
    /// Rank → root, root → rank: a rank stopped draining its connections
    /// (frozen, stopped or hung), so the job cannot go on.
    PeerStuck = 10,
    /// Root → rank: a rank left the job in order (said goodbye to the root).
    PeerLeft = 11,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Challenge,
            2 => Self::Hello,
            3 => Self::Welcome,
            4 => Self::Refuse,
            5 => Self::Table,
            6 => Self::Data,
            7 => Self::Goodbye,
            8 => Self::PeerDied,
            9 => Self::Abort,
            10 => Self::PeerStuck,
            11 => Self::PeerLeft,
            _ => return None,
        })
    }
}

/// Why a connection was opened: to join the root, or to talk to a peer rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Purpose {
    /// A rank joining the rendezvous root.
    Root = 0,
    /// A rank opening its sending connection to a peer rank.
    Peer = 1,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// See [`Kind::Challenge`].
    Challenge {
        /// The random nonce the dialer's answer must cover.
        nonce: [u8; 16],
    },
    /// See [`Kind::Hello`].
    Hello(Hello),
    /// See [`Kind::Welcome`].
    Welcome,
    /// See [`Kind::Refuse`].
    Refuse {
        /// Why the dialer was refused.
        reason: String,
    },
    /// See [`Kind::Table`].
    Table {
        /// Each rank's listening address (`ip:port`), indexed by rank.
        addrs: Vec<String>,
    },
    /// See [`Kind::Data`].
    Data {
        /// The tag the receiver matches messages by (the header's tag field).
        tag: u64,
        /// The message bytes.
        payload: Vec<u8>,
    },
    /// See [`Kind::Goodbye`].
    Goodbye,
    /// See [`Kind::PeerDied`].
    PeerDied {
        /// The rank that died.
        rank: u32,
        /// How its death was noticed.
        reason: String,
    },
    /// See [`Kind::Abort`].
    Abort {
        /// Why the root gave up.
        reason: String,
        /// The ranks that never joined (empty when the root does not know
        /// the rank count yet).
        missing: Vec<u32>,
    },
    /// See [`Kind::PeerStuck`].
    PeerStuck {
        /// The rank that stopped draining its connections.
        rank: u32,
        /// How it was noticed (which send could not complete).
        reason: String,
    },
    /// See [`Kind::PeerLeft`].
    PeerLeft {
        /// The rank that left.
        rank: u32,
    },
}

/// A dialer's introduction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Whether the dialer joins the root or opens a peer connection.
    pub purpose: Purpose,
    /// The dialer's rank.
    pub rank: u32,
    /// The job's rank count, as the dialer knows it.
    pub nranks: u32,
    /// The address the dialer listens on (`ip:port`), empty for peer dials.
    pub listen_addr: String,
    /// Keyed hash of the challenge nonce and the fields above.
    pub mac: [u8; 32],
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not [`MAGIC`] (they are given).
    #[error("bad magic {0:02x?} (not a gin-rs bootstrap peer)")]
    BadMagic([u8; 4]),
    /// The header names a format version other than [`VERSION`].
    #[error("unsupported bootstrap format version {got} (this build speaks {VERSION})")]
    BadVersion {
        /// The version byte received.
        got: u8,
    },
    /// The kind byte (given) is no [`Kind`].
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    /// The flags (given) are not zero.
    #[error("non-zero flags {0:#06x}")]
    BadFlags(u16),
    /// A payload or field is longer than the limit.
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Its length in bytes.
        len: u64,
        /// The limit: the reader's payload limit when decoding, `u32::MAX`
        /// (what a length field can describe) when encoding.
        max: usize,
    },
    /// The payload ends before a field does.
    #[error("frame truncated: {what} needs {need} more bytes, {have} left")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// The bytes it needs.
        need: usize,
        /// The bytes left in the payload.
        have: usize,
    },
    /// Bytes (their count given) remain after the kind's last field.
    #[error("{0} trailing bytes after the frame's fields")]
    Trailing(usize),
    /// A field's value is not allowed.
    #[error("field {what} is not valid: {why}")]
    BadField {
        /// The field.
        what: &'static str,
        /// What is wrong with its value.
        why: String,
    },
    /// The stream ended inside a frame.
    #[error("connection closed in the middle of a frame ({got} of {want} bytes)")]
    Eof {
        /// The frame's bytes received, header included.
        got: usize,
        /// The frame's whole size, header included (or the header's size
        /// when the header itself is cut short).
        want: usize,
    },
}

/// A parsed header, before its payload has been read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) tag: u64,
    pub(crate) len: usize,
}

/// Parses and validates a header against the payload limit.
pub(crate) fn decode_header(
    b: &[u8; HEADER_LEN],
    max_payload: usize,
) -> Result<Header, FrameError> {
    let magic = [b[0], b[1], b[2], b[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    if b[4] != VERSION {
        return Err(FrameError::BadVersion { got: b[4] });
    }
    let kind = Kind::from_u8(b[5]).ok_or(FrameError::BadKind(b[5]))?;
    let flags = u16::from_le_bytes([b[6], b[7]]);
    if flags != 0 {
        return Err(FrameError::BadFlags(flags));
    }
    let tag = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    let len = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes"));
    if len as usize > max_payload {
        return Err(FrameError::TooLarge {
            len: u64::from(len),
            max: max_payload,
        });
    }
    Ok(Header {
        kind,
        tag,
        len: len as usize,
    })
}

/// Encodes a frame into one buffer (header and payload), ready for one write.
///
/// Fails only when the payload cannot be described by the u32 length field.
pub fn encode(frame: &Frame) -> Result<Vec<u8>, FrameError> {
    let mut w = Vec::with_capacity(HEADER_LEN + 64);
    w.extend_from_slice(&[0; HEADER_LEN]);
    let (kind, tag) = match frame {
        Frame::Challenge { nonce } => {
            w.extend_from_slice(nonce);
            (Kind::Challenge, 0)
        }
        Frame::Hello(h) => {
            w.push(h.purpose as u8);
            w.extend_from_slice(&h.rank.to_le_bytes());
            w.extend_from_slice(&h.nranks.to_le_bytes());
            put_bytes(&mut w, h.listen_addr.as_bytes())?;
            w.extend_from_slice(&h.mac);
            (Kind::Hello, 0)
        }
        Frame::Welcome => (Kind::Welcome, 0),
        Frame::Refuse { reason } => {
            put_bytes(&mut w, reason.as_bytes())?;
            (Kind::Refuse, 0)
        }
        Frame::Table { addrs } => {
            put_len(&mut w, addrs.len())?;
            for a in addrs {
                put_bytes(&mut w, a.as_bytes())?;
            }
            (Kind::Table, 0)
        }
        Frame::Data { tag, payload } => {
            w.extend_from_slice(payload);
            (Kind::Data, *tag)
        }
        Frame::Goodbye => (Kind::Goodbye, 0),
        Frame::PeerDied { rank, reason } => {
            w.extend_from_slice(&rank.to_le_bytes());
            put_bytes(&mut w, reason.as_bytes())?;
            (Kind::PeerDied, 0)
        }
        Frame::PeerStuck { rank, reason } => {
            w.extend_from_slice(&rank.to_le_bytes());
            put_bytes(&mut w, reason.as_bytes())?;
            (Kind::PeerStuck, 0)
        }
        Frame::PeerLeft { rank } => {
            w.extend_from_slice(&rank.to_le_bytes());
            (Kind::PeerLeft, 0)
        }
        Frame::Abort { reason, missing } => {
            put_bytes(&mut w, reason.as_bytes())?;
            put_len(&mut w, missing.len())?;
            for m in missing {
                w.extend_from_slice(&m.to_le_bytes());
            }
            (Kind::Abort, 0)
        }
    };
    let len = w.len() - HEADER_LEN;
    let len32 = u32::try_from(len).map_err(|_| FrameError::TooLarge {
        len: len as u64,
        max: u32::MAX as usize,
    })?;
    w[0..4].copy_from_slice(&MAGIC);
    w[4] = VERSION;
    w[5] = kind as u8;
    w[8..16].copy_from_slice(&tag.to_le_bytes());
    w[16..20].copy_from_slice(&len32.to_le_bytes());
    Ok(w)
}

fn put_len(w: &mut Vec<u8>, n: usize) -> Result<(), FrameError> {
    let n = u32::try_from(n).map_err(|_| FrameError::TooLarge {
        len: n as u64,
        max: u32::MAX as usize,
    })?;
    w.extend_from_slice(&n.to_le_bytes());
    Ok(())
}

fn put_bytes(w: &mut Vec<u8>, b: &[u8]) -> Result<(), FrameError> {
    put_len(w, b.len())?;
    w.extend_from_slice(b);
    Ok(())
}

/// Decodes a payload whose header was already validated.
pub(crate) fn decode_payload(h: Header, payload: Vec<u8>) -> Result<Frame, FrameError> {
    if h.kind == Kind::Data {
        return Ok(Frame::Data {
            tag: h.tag,
            payload,
        });
    }
    let mut r = Cursor { b: &payload, at: 0 };
    let frame = match h.kind {
        Kind::Challenge => Frame::Challenge {
            nonce: r.array("nonce")?,
        },
        Kind::Hello => {
            let purpose = match r.u8("purpose")? {
                0 => Purpose::Root,
                1 => Purpose::Peer,
                p => {
                    return Err(FrameError::BadField {
                        what: "purpose",
                        why: format!("unknown value {p}"),
                    });
                }
            };
            Frame::Hello(Hello {
                purpose,
                rank: r.u32("rank")?,
                nranks: r.u32("nranks")?,
                listen_addr: r.string("listen_addr")?,
                mac: r.array("mac")?,
            })
        }
        Kind::Welcome => Frame::Welcome,
        Kind::Refuse => Frame::Refuse {
            reason: r.string("reason")?,
        },
        Kind::Table => {
            let n = r.u32("table length")? as usize;
            // Each entry needs at least its 4-byte length: bound the count by
            // what is actually present before reserving anything.
            if n > r.remaining() / 4 {
                return Err(FrameError::Truncated {
                    what: "table entries",
                    need: n * 4,
                    have: r.remaining(),
                });
            }
            let mut addrs = Vec::with_capacity(n);
            for _ in 0..n {
                addrs.push(r.string("table entry")?);
            }
            Frame::Table { addrs }
        }
        Kind::Goodbye => Frame::Goodbye,
        Kind::PeerDied => Frame::PeerDied {
            rank: r.u32("rank")?,
            reason: r.string("reason")?,
        },
        Kind::PeerStuck => Frame::PeerStuck {
            rank: r.u32("rank")?,
            reason: r.string("reason")?,
        },
        Kind::PeerLeft => Frame::PeerLeft {
            rank: r.u32("rank")?,
        },
        Kind::Abort => {
            let reason = r.string("reason")?;
            let n = r.u32("missing count")? as usize;
            if n > r.remaining() / 4 {
                return Err(FrameError::Truncated {
                    what: "missing ranks",
                    need: n * 4,
                    have: r.remaining(),
                });
            }
            let mut missing = Vec::with_capacity(n);
            for _ in 0..n {
                missing.push(r.u32("missing rank")?);
            }
            Frame::Abort { reason, missing }
        }
        Kind::Data => unreachable!("handled above"),
    };
    if r.remaining() != 0 {
        return Err(FrameError::Trailing(r.remaining()));
    }
    Ok(frame)
}

/// Decodes one whole frame from a byte slice; returns it and the bytes used.
pub fn decode(bytes: &[u8], max_payload: usize) -> Result<(Frame, usize), FrameError> {
    let hb: &[u8; HEADER_LEN] = bytes
        .get(..HEADER_LEN)
        .and_then(|s| s.try_into().ok())
        .ok_or(FrameError::Truncated {
            what: "header",
            need: HEADER_LEN,
            have: bytes.len(),
        })?;
    let h = decode_header(hb, max_payload)?;
    let body = bytes
        .get(HEADER_LEN..HEADER_LEN + h.len)
        .ok_or(FrameError::Truncated {
            what: "payload",
            need: h.len,
            have: bytes.len() - HEADER_LEN,
        })?;
    Ok((decode_payload(h, body.to_vec())?, HEADER_LEN + h.len))
}

/// Reads one frame from a stream.
///
/// `Ok(None)` means the stream ended cleanly before a new frame began.
pub fn read_frame<R: Read>(r: &mut R, max_payload: usize) -> Result<Option<Frame>, ReadError> {
    let mut hb = [0u8; HEADER_LEN];
    let got = read_full(r, &mut hb)?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_LEN {
        return Err(FrameError::Eof {
            got,
            want: HEADER_LEN,
        }
        .into());
    }
    let h = decode_header(&hb, max_payload)?;
    let mut payload = Vec::with_capacity(h.len.min(READ_CHUNK));
    while payload.len() < h.len {
        let start = payload.len();
        let step = (h.len - start).min(READ_CHUNK);
        payload.resize(start + step, 0);
        let n = read_full(r, &mut payload[start..])?;
        if n < step {
            return Err(FrameError::Eof {
                got: HEADER_LEN + start + n,
                want: HEADER_LEN + h.len,
            }
            .into());
        }
    }
    Ok(Some(decode_payload(h, payload)?))
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A failure while reading a frame from a stream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The stream failed.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The bytes are not a valid frame (including a stream that ends inside
    /// one).
    #[error(transparent)]
    Frame(#[from] FrameError),
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn remaining(&self) -> usize {
        self.b.len() - self.at
    }
    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], FrameError> {
        if self.remaining() < n {
            return Err(FrameError::Truncated {
                what,
                need: n,
                have: self.remaining(),
            });
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, FrameError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FrameError> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }
    fn string(&mut self, what: &'static str) -> Result<String, FrameError> {
        let n = self.u32(what)? as usize;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|e| FrameError::BadField {
            what,
            why: e.to_string(),
        })
    }
}

impl fmt::Display for Purpose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Root => "root",
            Self::Peer => "peer",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_string() -> impl Strategy<Value = String> {
        ".{0,40}"
    }

    fn any_frame() -> impl Strategy<Value = Frame> {
        prop_oneof![
            any::<[u8; 16]>().prop_map(|nonce| Frame::Challenge { nonce }),
            (
                any::<bool>(),
                any::<u32>(),
                any::<u32>(),
                any_string(),
                any::<[u8; 32]>()
            )
                .prop_map(|(p, rank, nranks, listen_addr, mac)| Frame::Hello(Hello {
                    purpose: if p { Purpose::Root } else { Purpose::Peer },
                    rank,
                    nranks,
                    listen_addr,
                    mac
                })),
            Just(Frame::Welcome),
            any_string().prop_map(|reason| Frame::Refuse { reason }),
            proptest::collection::vec(any_string(), 0..8).prop_map(|addrs| Frame::Table { addrs }),
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300))
                .prop_map(|(tag, payload)| Frame::Data { tag, payload }),
            Just(Frame::Goodbye),
            (any::<u32>(), any_string())
                .prop_map(|(rank, reason)| Frame::PeerDied { rank, reason }),
            (any::<u32>(), any_string())
                .prop_map(|(rank, reason)| Frame::PeerStuck { rank, reason }),
            any::<u32>().prop_map(|rank| Frame::PeerLeft { rank }),
            (any_string(), proptest::collection::vec(any::<u32>(), 0..8))
                .prop_map(|(reason, missing)| Frame::Abort { reason, missing }),
        ]
    }

    proptest! {
        #[test]
        fn encode_decode_roundtrip(f in any_frame()) {
            let bytes = encode(&f).unwrap();
            let (g, used) = decode(&bytes, DEFAULT_MAX_PAYLOAD).unwrap();
            prop_assert_eq!(used, bytes.len());
            prop_assert_eq!(&g, &f);
            // The stream reader agrees with the slice decoder.
            let mut s = &bytes[..];
            prop_assert_eq!(read_frame(&mut s, DEFAULT_MAX_PAYLOAD).unwrap(), Some(f));
        }

        #[test]
        fn every_truncation_is_an_error(f in any_frame(), cut in any::<prop::sample::Index>()) {
            let bytes = encode(&f).unwrap();
            let cut = cut.index(bytes.len());
            prop_assert!(decode(&bytes[..cut], DEFAULT_MAX_PAYLOAD).is_err());
            let mut s = &bytes[..cut];
            match read_frame(&mut s, DEFAULT_MAX_PAYLOAD) {
                Ok(None) => prop_assert_eq!(cut, 0),
                Ok(Some(g)) => prop_assert!(false, "decoded {:?} from a truncated frame", g),
                Err(_) => {}
            }
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes, 1 << 16);
            let mut s = &bytes[..];
            let _ = read_frame(&mut s, 1 << 16);
        }

        #[test]
        fn flipped_payload_bytes_never_panic(f in any_frame(), at in any::<prop::sample::Index>(), v in any::<u8>()) {
            let mut bytes = encode(&f).unwrap();
            let i = at.index(bytes.len());
            bytes[i] = v;
            let _ = decode(&bytes, DEFAULT_MAX_PAYLOAD);
        }
    }

    #[test]
    fn absurd_length_is_refused_before_allocation() {
        let mut h = encode(&Frame::Goodbye).unwrap();
        h[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut s = &h[..];
        let err = read_frame(&mut s, 1 << 20).unwrap_err();
        assert!(
            matches!(err, ReadError::Frame(FrameError::TooLarge { len, max }) if len == u64::from(u32::MAX) && max == 1 << 20),
            "{err}"
        );
    }

    #[test]
    fn lying_length_within_limit_reads_only_what_arrived() {
        // Claims 512 MiB, delivers 10 bytes: an EOF error, not a 512 MiB buffer.
        let mut h = encode(&Frame::Data {
            tag: 1,
            payload: vec![7; 10],
        })
        .unwrap();
        h[16..20].copy_from_slice(&(512u32 << 20).to_le_bytes());
        let mut s = &h[..];
        let err = read_frame(&mut s, DEFAULT_MAX_PAYLOAD).unwrap_err();
        assert!(
            matches!(err, ReadError::Frame(FrameError::Eof { got: 30, .. })),
            "{err}"
        );
    }

    #[test]
    fn wrong_magic_version_kind_flags_are_named() {
        let good = encode(&Frame::Welcome).unwrap();
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(
            decode(&b, 64),
            Err(FrameError::BadMagic(m)) if m == *b"XINB"
        ));
        let mut b = good.clone();
        b[4] = 9;
        assert_eq!(decode(&b, 64), Err(FrameError::BadVersion { got: 9 }));
        let mut b = good.clone();
        b[5] = 200;
        assert_eq!(decode(&b, 64), Err(FrameError::BadKind(200)));
        let mut b = good;
        b[6] = 1;
        assert_eq!(decode(&b, 64), Err(FrameError::BadFlags(1)));
    }

    #[test]
    fn golden_hello_bytes() {
        let f = Frame::Hello(Hello {
            purpose: Purpose::Peer,
            rank: 3,
            nranks: 8,
            listen_addr: "1.2".into(),
            mac: [0xab; 32],
        });
        let b = encode(&f).unwrap();
        let mut want = b"GINB\x01\x02\x00\x00".to_vec();
        want.extend_from_slice(&0u64.to_le_bytes());
        want.extend_from_slice(&(1u32 + 4 + 4 + 4 + 3 + 32).to_le_bytes());
        want.push(1);
        want.extend_from_slice(&[3, 0, 0, 0, 8, 0, 0, 0, 3, 0, 0, 0, b'1', b'.', b'2']);
        want.extend_from_slice(&[0xab; 32]);
        assert_eq!(b, want);
    }
}
