//! The token bucket script's reply, read into its integers.
//!
//! Owns the two forms `lua/token_bucket.lua` answers in: a RESP array of
//! integers, or, for a call with a compact ask (every call the gateway
//! makes for plain decisions), one string packing the same integers as a
//! MessagePack array (`cmsgpack.pack`). The packed form is read here byte
//! by byte, with no intermediate values: a general reply parser spent
//! about 850 instructions on each integer of an array.
//!
//! Invariant: a reply that is neither form, or a packed string with
//! anything missing, malformed or left over, reads as `None`, never as
//! part of its integers.

use crate::redis_client::Reply;

/// The integers of a reply of the token bucket script, in order: a RESP
/// array of integers, or a string packing them (see the module comment).
/// `None` for anything else.
pub fn integers(reply: Reply<'_>) -> Option<Vec<i64>> {
    match reply {
        Reply::Bulk(bytes) => unpack(bytes),
        Reply::Integers(integers) => Some(integers),
        Reply::Integer(_) | Reply::Other => None,
    }
}

/// The integers of a MessagePack array of numbers, as `cmsgpack.pack`
/// writes a Lua array: integers in their shortest encoding, and numbers
/// with a fraction as floats, which are truncated toward zero (as Redis
/// truncates a Lua number it converts to an integer reply). `None` unless
/// `bytes` is exactly one such array.
pub fn unpack(bytes: &[u8]) -> Option<Vec<i64>> {
    let mut reader = Reader { bytes };
    let len = reader.array_len()?;
    // Every number takes at least a byte: a longer array is malformed, and
    // must not size the allocation.
    if len > reader.bytes.len() {
        return None;
    }
    let mut out = Vec::with_capacity(len);
    for _ in 0..len {
        out.push(reader.number()?);
    }
    reader.bytes.is_empty().then_some(out)
}

/// What is still to be read of a packed reply.
struct Reader<'a> {
    /// The bytes not read yet.
    bytes: &'a [u8],
}

impl Reader<'_> {
    /// The next `N` bytes.
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.bytes.split_first_chunk::<N>()?;
        self.bytes = rest;
        Some(*head)
    }

    /// The next byte.
    fn byte(&mut self) -> Option<u8> {
        self.take::<1>().map(|[b]| b)
    }

    /// An array's header: how many values follow.
    fn array_len(&mut self) -> Option<usize> {
        match self.byte()? {
            b @ 0x90..=0x9f => Some(usize::from(b & 0x0f)),
            0xdc => Some(usize::from(u16::from_be_bytes(self.take()?))),
            0xdd => usize::try_from(u32::from_be_bytes(self.take()?)).ok(),
            _ => None,
        }
    }

    /// One number, as an integer.
    fn number(&mut self) -> Option<i64> {
        Some(match self.byte()? {
            b @ 0x00..=0x7f => i64::from(b),
            b @ 0xe0..=0xff => i64::from(b as i8),
            0xcc => i64::from(self.byte()?),
            0xcd => i64::from(u16::from_be_bytes(self.take()?)),
            0xce => i64::from(u32::from_be_bytes(self.take()?)),
            0xcf => i64::try_from(u64::from_be_bytes(self.take()?)).ok()?,
            0xd0 => i64::from(i8::from_be_bytes(self.take()?)),
            0xd1 => i64::from(i16::from_be_bytes(self.take()?)),
            0xd2 => i64::from(i32::from_be_bytes(self.take()?)),
            0xd3 => i64::from_be_bytes(self.take()?),
            // `as` truncates toward zero, and saturates what is out of range.
            0xca => f32::from_be_bytes(self.take()?) as i64,
            0xcb => f64::from_be_bytes(self.take()?) as i64,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_encoding_cmsgpack_writes() {
        // `redis-cli EVAL "return cmsgpack.pack({1,-2,300,70000,5000000000,-1,-200,2.5})" 0`
        let packed = [
            0x98, 0x01, 0xfe, 0xcd, 0x01, 0x2c, 0xce, 0x00, 0x01, 0x11, 0x70, 0xcf, 0x00, 0x00,
            0x00, 0x01, 0x2a, 0x05, 0xf2, 0x00, 0xff, 0xd1, 0xff, 0x38, 0xca, 0x40, 0x20, 0x00,
            0x00,
        ];
        assert_eq!(
            unpack(&packed),
            Some(vec![1, -2, 300, 70_000, 5_000_000_000, -1, -200, 2])
        );
    }

    #[test]
    fn reads_the_wider_encodings_and_headers() {
        let mut packed = vec![0xdc, 0x00, 0x06];
        packed.extend([0xcc, 0xff, 0xd0, 0x80, 0xd2, 0x80, 0x00, 0x00, 0x00]);
        packed.push(0xd3);
        packed.extend(i64::MIN.to_be_bytes());
        packed.push(0xcb);
        packed.extend((-7.9f64).to_be_bytes());
        packed.push(0xcf);
        packed.extend((i64::MAX as u64).to_be_bytes());
        assert_eq!(
            unpack(&packed),
            Some(vec![255, -128, i64::from(i32::MIN), i64::MIN, -7, i64::MAX])
        );
        assert_eq!(unpack(&[0xdd, 0, 0, 0, 1, 0x07]), Some(vec![7]));
        assert_eq!(unpack(&[0x90]), Some(vec![]));
    }

    #[test]
    fn anything_missing_malformed_or_left_over_is_no_reply() {
        // Cut short, inside a number and between numbers.
        assert_eq!(unpack(&[0x92, 0x01, 0xcd, 0x01]), None);
        assert_eq!(unpack(&[0x92, 0x01]), None);
        assert_eq!(unpack(&[]), None);
        // Bytes after the array.
        assert_eq!(unpack(&[0x91, 0x01, 0x02]), None);
        // Not an array; a value that is not a number.
        assert_eq!(unpack(&[0x01]), None);
        assert_eq!(unpack(&[0x91, 0xc0]), None);
        assert_eq!(unpack(&[0x91, 0xa1, b'x']), None);
        // A header promising more values than there are bytes.
        assert_eq!(unpack(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]), None);
        // An unsigned value beyond i64.
        let mut big = vec![0x91, 0xcf];
        big.extend(u64::MAX.to_be_bytes());
        assert_eq!(unpack(&big), None);
    }

    #[test]
    fn a_resp_array_of_integers_is_read_as_it_is() {
        assert_eq!(integers(Reply::Integers(vec![1, -2])), Some(vec![1, -2]));
        assert_eq!(integers(Reply::Other), None);
        assert_eq!(integers(Reply::Bulk(&[0x91, 0x05])), Some(vec![5]));
        assert_eq!(integers(Reply::Integer(1)), None);
    }
}
