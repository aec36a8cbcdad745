//! A small codec for the records ranks allgather (a window part's size,
//! key and address, a host id, a placement), so that no caller slices
//! bytes by hand: a [`Writer`] appends fields little-endian, a [`Reader`]
//! reads them back in the same order, and any record of the wrong shape
//! is a [`Malformed`] error naming the rank that sent it (the ranks run
//! different builds, or memory was corrupted), never a panic.
//!
//! The layout of each record is its owner's (gin-core's window and host
//! records); this module only knows fields: `u32`, `u64`, a 0-or-1 flag,
//! fixed byte arrays, length-prefixed bytes and a UTF-8 tail.

/// A record of the wrong shape, as the rank that received it sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank} sent a malformed {what} ({got} bytes, expected {expected})")]
pub struct Malformed {
    /// The rank whose record it is.
    pub rank: usize,
    /// The record, and what is wrong with it where that is more than its
    /// length (for example `"window 3 record (a shared flag that is neither
    /// 0 nor 1)"`).
    pub what: String,
    /// Its length in bytes.
    pub got: usize,
    /// The length expected (for a record whose length varies, that of its
    /// fixed head).
    pub expected: usize,
}

/// Appends a record's fields, little-endian, in order.
#[derive(Debug, Default, Clone)]
pub struct Writer(Vec<u8>);

impl Writer {
    /// An empty record.
    pub fn new() -> Self {
        Self::default()
    }

    /// A `u32`, little-endian.
    #[must_use]
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A `u64`, little-endian.
    #[must_use]
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A flag: one byte, 0 or 1.
    #[must_use]
    pub fn flag(mut self, v: bool) -> Self {
        self.0.push(u8::from(v));
        self
    }

    /// Bytes as they are (a fixed-size field, or the record's tail).
    #[must_use]
    pub fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }

    /// Bytes after their length (`u32`, little-endian); a record field
    /// is never 4 GiB long, but one that were would be cut there.
    #[must_use]
    pub fn prefixed(self, v: &[u8]) -> Self {
        let v = &v[..v.len().min(u32::MAX as usize)];
        self.u32(v.len() as u32).bytes(v)
    }

    /// The encoded record.
    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// Reads a record's fields (borrowed for `'a`; `'w` is its name's
/// lifetime) back in the order a [`Writer`] wrote them; every
/// read that runs past the end, and every flag that is neither 0 nor 1, is
/// a [`Malformed`] error naming the sender.
#[derive(Debug, Clone)]
pub struct Reader<'a, 'w> {
    rank: usize,
    what: &'w str,
    record: &'a [u8],
    at: usize,
    /// The length an error states as expected.
    expected: usize,
}

impl<'a, 'w> Reader<'a, 'w> {
    /// Reads `record`, sent by `rank`, which must be exactly `len` bytes
    /// long; `what` names it in errors (`"GPU window 3 record"`).
    pub fn exact(
        rank: usize,
        what: &'w str,
        record: &'a [u8],
        len: usize,
    ) -> Result<Self, Malformed> {
        let r = Self {
            rank,
            what,
            record,
            at: 0,
            expected: len,
        };
        if record.len() == len {
            Ok(r)
        } else {
            Err(r.malformed(None))
        }
    }

    /// Reads `record`, sent by `rank`, which must hold at least a fixed
    /// head of `head` bytes (a variable tail may follow).
    pub fn with_head(
        rank: usize,
        what: &'w str,
        record: &'a [u8],
        head: usize,
    ) -> Result<Self, Malformed> {
        let r = Self {
            rank,
            what,
            record,
            at: 0,
            expected: head,
        };
        if record.len() >= head {
            Ok(r)
        } else {
            Err(r.malformed(Some("too short")))
        }
    }

    /// The error for this record, with what is wrong with it beyond its
    /// length.
    pub fn malformed(&self, why: Option<&str>) -> Malformed {
        Malformed {
            rank: self.rank,
            what: match why {
                Some(why) => format!("{} ({why})", self.what),
                None => self.what.to_owned(),
            },
            got: self.record.len(),
            expected: self.expected,
        }
    }

    /// The next `N` bytes.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let end = self.at.checked_add(N);
        let b = end
            .and_then(|end| self.record.get(self.at..end))
            .ok_or_else(|| self.malformed(Some("too short")))?;
        self.at += N;
        Ok(std::array::from_fn(|i| b[i]))
    }

    /// The next `u32`.
    pub fn u32(&mut self) -> Result<u32, Malformed> {
        self.array().map(u32::from_le_bytes)
    }

    /// The next `u64`.
    pub fn u64(&mut self) -> Result<u64, Malformed> {
        self.array().map(u64::from_le_bytes)
    }

    /// The next flag; `name` says which in the error when its byte is
    /// neither 0 nor 1.
    pub fn flag(&mut self, name: &str) -> Result<bool, Malformed> {
        match self.array::<1>()? {
            [0] => Ok(false),
            [1] => Ok(true),
            _ => Err(self.malformed(Some(&format!("a {name} that is neither 0 nor 1")))),
        }
    }

    /// The next bytes after their length (what [`Writer::prefixed`] wrote).
    pub fn prefixed(&mut self) -> Result<&'a [u8], Malformed> {
        let len = self.u32()? as usize;
        let end = self.at.checked_add(len);
        let b = end
            .and_then(|end| self.record.get(self.at..end))
            .ok_or_else(|| self.malformed(Some("a length past its end")))?;
        self.at += len;
        Ok(b)
    }

    /// The rest of the record.
    pub fn rest(&mut self) -> &'a [u8] {
        let b = self.record.get(self.at..).unwrap_or_default();
        self.at = self.record.len();
        b
    }

    /// The rest of the record as UTF-8; `name` says what it is in the
    /// error when it is not.
    pub fn rest_str(&mut self, name: &str) -> Result<&'a str, Malformed> {
        let b = self.rest();
        std::str::from_utf8(b)
            .map_err(|_| self.malformed(Some(&format!("{name} that is not UTF-8"))))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn fields_round_trip_little_endian_in_order() {
        let b = Writer::new()
            .u64(0x0102_0304_0506_0708)
            .u32(0xdead_beef)
            .flag(true)
            .prefixed(b"node")
            .bytes(&[9; 3])
            .bytes(b"tail")
            .finish();
        assert_eq!(b[..8], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(b[8..12], 0xdead_beefu32.to_le_bytes());
        assert_eq!(b[12], 1);
        assert_eq!(b[13..17], 4u32.to_le_bytes());
        let mut r = Reader::with_head(2, "test record", &b, 13).unwrap();
        assert_eq!(r.u64().unwrap(), 0x0102_0304_0506_0708);
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert!(r.flag("flag").unwrap());
        assert_eq!(r.prefixed().unwrap(), b"node");
        assert_eq!(r.array::<3>().unwrap(), [9; 3]);
        assert_eq!(r.rest_str("a tail").unwrap(), "tail");
        assert_eq!(r.rest(), b"");
    }

    #[test]
    fn a_malformed_record_names_its_rank_and_what_is_wrong() {
        let e = Reader::exact(3, "GPU window 9 record", &[0; 80], 84).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 3 sent a malformed GPU window 9 record (80 bytes, expected 84)"
        );
        let e = Reader::with_head(1, "host record", &[0; 2], 4).unwrap_err();
        assert!(e.to_string().contains("host record (too short)"), "{e}");
        // A read past the end, a bad flag, a length past the end, bad UTF-8.
        let mut r = Reader::with_head(4, "r", &[2, 0, 0], 0).unwrap();
        assert_eq!(r.u32().unwrap_err().rank, 4);
        let mut r = Reader::exact(4, "r", &[2], 1).unwrap();
        assert!(
            r.flag("shared flag")
                .unwrap_err()
                .what
                .contains("shared flag")
        );
        let b = Writer::new().u32(u32::MAX).bytes(b"x").finish();
        assert!(Reader::exact(0, "r", &b, 5).unwrap().prefixed().is_err());
        let mut r = Reader::exact(0, "r", &[0xff, 0xfe], 2).unwrap();
        assert!(r.rest_str("a path").unwrap_err().what.contains("UTF-8"));
    }
}
