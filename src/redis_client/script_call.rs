//! A script call's bytes on the wire.
//!
//! Owns [`LuaScript`] (a script called by SHA, with its source for
//! `SCRIPT LOAD`), [`ScriptCall`] (an `EVALSHA`'s keys and arguments
//! written straight into one buffer as RESP, as they go on the wire) and
//! [`Reply`] (a script's reply, framed in the bytes it arrived in and read
//! from them without a general value in between).
//!
//! Invariant: a frame is complete only when every byte of it arrived, and
//! one longer or deeper than any reply of the script is refused as
//! malformed, never waited for.

use std::io;

use redis::{Cmd, RedisResult, RedisWrite, ToRedisArgs, Value};

/// Longest reply a line accepts: far beyond any answer of the script (a
/// few bytes per decision); anything longer is not its reply.
pub(super) const MAX_REPLY: usize = 1 << 20;

/// Deepest nesting of arrays a reply may have.
pub(super) const MAX_DEPTH: u8 = 4;

/// A Lua script called by SHA, with its source for `SCRIPT LOAD`.
pub struct LuaScript {
    /// The redis crate's form, for calls on the shared connection.
    script: redis::Script,
    /// The source.
    code: &'static str,
}

impl LuaScript {
    /// The script whose source is `code`.
    pub fn new(code: &'static str) -> Self {
        Self {
            script: redis::Script::new(code),
            code,
        }
    }

    /// The script's SHA1, in hex.
    pub fn hash(&self) -> &str {
        self.script.get_hash()
    }

    /// The source.
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// The redis crate's form.
    pub(super) fn script(&self) -> &redis::Script {
        &self.script
    }
}

/// The keys and arguments of one `EVALSHA`, each written as a RESP bulk
/// string into one buffer as it is added: the keys first, `keys` of them.
#[derive(Debug)]
pub struct ScriptCall {
    /// The keys and arguments on the wire, one after the other.
    wire: Vec<u8>,
    /// How many there are.
    count: usize,
    /// How many of them, from the first, are keys.
    keys: usize,
}

impl ScriptCall {
    /// A call with `keys` keys, with room for about `bytes` bytes of keys
    /// and arguments.
    pub fn new(keys: usize, bytes: usize) -> Self {
        Self {
            wire: Vec::with_capacity(bytes),
            count: 0,
            keys,
        }
    }

    /// Adds `value` (a key while fewer than `keys` were added), written as
    /// the redis crate writes it.
    pub fn arg(&mut self, value: impl ToRedisArgs) -> &mut Self {
        value.write_redis_args(self);
        self
    }

    /// Each key and argument, in order.
    pub fn args(&self) -> impl Iterator<Item = &[u8]> {
        let mut rest = self.wire.as_slice();
        std::iter::from_fn(move || {
            // Written by `write_arg` alone: `$<len>\r\n<bytes>\r\n`.
            let line_end = rest.iter().position(|&b| b == b'\r')?;
            let len: usize = std::str::from_utf8(&rest[1..line_end]).ok()?.parse().ok()?;
            let (arg, tail) = rest[line_end + 2..].split_at(len);
            rest = &tail[2..];
            Some(arg)
        })
    }

    /// The whole command, `EVALSHA` of `hash`, appended to `out`.
    pub(super) fn write_command(&self, hash: &str, out: &mut Vec<u8>) {
        let mut digits = itoa::Buffer::new();
        out.push(b'*');
        out.extend_from_slice(digits.format(self.count + 3).as_bytes());
        out.extend_from_slice(b"\r\n");
        bulk(out, b"EVALSHA");
        bulk(out, hash.as_bytes());
        bulk(out, digits.format(self.keys).as_bytes());
        out.extend_from_slice(&self.wire);
    }

    /// The same command for the redis crate.
    pub(super) fn to_cmd(&self, script: &LuaScript) -> Cmd {
        let mut cmd = Cmd::with_capacity(self.count + 3, self.wire.len() + 64);
        cmd.arg("EVALSHA").arg(script.hash()).arg(self.keys);
        for arg in self.args() {
            cmd.arg(arg);
        }
        cmd
    }
}

impl RedisWrite for ScriptCall {
    fn write_arg(&mut self, arg: &[u8]) {
        bulk(&mut self.wire, arg);
        self.count += 1;
    }

    fn writer_for_next_arg(&mut self) -> impl io::Write + '_ {
        NextArg {
            call: self,
            bytes: Vec::new(),
        }
    }
}

/// An argument written piece by piece, added whole when dropped (its
/// length goes before it on the wire).
struct NextArg<'a> {
    /// Where it goes.
    call: &'a mut ScriptCall,
    /// What was written so far.
    bytes: Vec<u8>,
}

impl io::Write for NextArg<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for NextArg<'_> {
    fn drop(&mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        self.call.write_arg(&bytes);
    }
}

/// Appends `bytes` to `out` as a RESP bulk string.
fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'$');
    out.extend_from_slice(itoa::Buffer::new().format(bytes.len()).as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// A script's reply as the caller reads it.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply<'a> {
    /// A string's bytes.
    Bulk(&'a [u8]),
    /// An array of integers.
    Integers(Vec<i64>),
    /// One integer.
    Integer(i64),
    /// Anything else (nil, a status, a mixed array).
    Other,
}

impl Reply<'_> {
    /// The same reply as the redis crate parsed it.
    pub fn of_value(value: &Value) -> Reply<'_> {
        match value {
            Value::BulkString(bytes) => Reply::Bulk(bytes),
            Value::Int(n) => Reply::Integer(*n),
            Value::Array(items) => items
                .iter()
                .map(|item| match item {
                    Value::Int(n) => Some(*n),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .map_or(Reply::Other, Reply::Integers),
            _ => Reply::Other,
        }
    }
}

/// A reply that is not RESP, or too long to be the script's.
pub(super) fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed reply from redis")
}

/// The length of the complete RESP2 value at the front of `buf`; `None`
/// while more bytes are needed.
pub(super) fn complete(buf: &[u8], depth: u8) -> io::Result<Option<usize>> {
    let Some(line_end) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let after = line_end + 2;
    match buf[0] {
        b'+' | b'-' | b':' => Ok(Some(after)),
        b'$' => match length(&buf[1..line_end])? {
            None => Ok(Some(after)),
            Some(len) if len > MAX_REPLY => Err(malformed()),
            Some(len) => {
                let end = after + len + 2;
                Ok((buf.len() >= end).then_some(end))
            }
        },
        b'*' => {
            let Some(items) = length(&buf[1..line_end])? else {
                return Ok(Some(after));
            };
            if depth == 0 || items > MAX_REPLY {
                return Err(malformed());
            }
            let mut at = after;
            for _ in 0..items {
                match complete(&buf[at..], depth - 1)? {
                    Some(len) => at += len,
                    None => return Ok(None),
                }
            }
            Ok(Some(at))
        }
        _ => Err(malformed()),
    }
}

/// A length in a RESP header: `None` for -1 (nil).
fn length(text: &[u8]) -> io::Result<Option<usize>> {
    if text == b"-1" {
        return Ok(None);
    }
    let text = std::str::from_utf8(text).map_err(|_| malformed())?;
    text.parse().map(Some).map_err(|_| malformed())
}

/// An integer's text.
fn integer(text: &[u8]) -> Option<i64> {
    std::str::from_utf8(text).ok()?.parse().ok()
}

/// The complete RESP value `frame` as a [`Reply`], or the error it holds.
pub(super) fn reply(frame: &[u8]) -> RedisResult<Reply<'_>> {
    let body = &frame[1..frame.len() - 2];
    Ok(match frame[0] {
        b'-' => return Err(error(frame)),
        b':' => integer(body).map_or(Reply::Other, Reply::Integer),
        b'$' => match body.iter().position(|&b| b == b'\n') {
            Some(at) if body[0] != b'-' => Reply::Bulk(&body[at + 1..]),
            _ => Reply::Other,
        },
        b'*' => {
            let mut out = Vec::new();
            for line in body.split(|&b| b == b'\n').skip(1) {
                match line.strip_prefix(b":") {
                    Some(text) => match integer(text.strip_suffix(b"\r").unwrap_or(text)) {
                        Some(n) => out.push(n),
                        None => return Ok(Reply::Other),
                    },
                    None => return Ok(Reply::Other),
                }
            }
            Reply::Integers(out)
        }
        _ => Reply::Other,
    })
}

/// The error an error reply `frame` holds, classified as the redis crate
/// classifies it.
pub(super) fn error(frame: &[u8]) -> redis::RedisError {
    match redis::parse_redis_value(frame).and_then(Value::extract_error) {
        Err(e) => e,
        Ok(_) => malformed().into(),
    }
}

#[cfg(test)]
mod tests {
    use redis::{ErrorKind, ServerErrorKind};

    use super::*;

    #[test]
    fn a_call_is_written_as_one_evalsha_with_its_keys_counted() {
        let mut call = ScriptCall::new(2, 64);
        call.arg("k1").arg("k2").arg(20_u32).arg(0.5_f64).arg("+1");
        let args: Vec<&[u8]> = call.args().collect();
        assert_eq!(args, [&b"k1"[..], b"k2", b"20", b"0.5", b"+1"]);
        let mut out = Vec::new();
        call.write_command("abc", &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "*8\r\n$7\r\nEVALSHA\r\n$3\r\nabc\r\n$1\r\n2\r\n$2\r\nk1\r\n$2\r\nk2\r\n\
             $2\r\n20\r\n$3\r\n0.5\r\n$2\r\n+1\r\n"
        );
        let script = LuaScript::new("return 1");
        let cmd = call.to_cmd(&script);
        let packed = cmd.get_packed_command();
        let mut ours = Vec::new();
        call.write_command(script.hash(), &mut ours);
        assert_eq!(packed, ours, "the shared connection sends the same bytes");
    }

    #[test]
    fn an_argument_written_in_pieces_goes_whole() {
        let mut call = ScriptCall::new(0, 8);
        {
            let mut w = call.writer_for_next_arg();
            io::Write::write_all(&mut w, b"ab").unwrap();
            io::Write::write_all(&mut w, b"\r\nc").unwrap();
        }
        call.arg("d");
        let args: Vec<&[u8]> = call.args().collect();
        assert_eq!(args, [&b"ab\r\nc"[..], b"d"]);
    }

    #[test]
    fn a_reply_is_complete_only_when_every_byte_arrived() {
        let replies: [&[u8]; 6] = [
            b"$5\r\nab\r\nc\r\n",
            b"*3\r\n:1\r\n:-20\r\n:3\r\n",
            b"-NOSCRIPT No matching script.\r\n",
            b":42\r\n",
            b"$-1\r\n",
            b"*2\r\n*1\r\n:1\r\n$2\r\nok\r\n",
        ];
        for wire in replies {
            for cut in 0..wire.len() {
                assert_eq!(
                    complete(&wire[..cut], MAX_DEPTH).unwrap(),
                    None,
                    "{wire:?} {cut}"
                );
            }
            let mut more = wire.to_vec();
            more.extend_from_slice(b"+next\r\n");
            assert_eq!(complete(&more, MAX_DEPTH).unwrap(), Some(wire.len()));
        }
        for bad in [&b"?x\r\n"[..], b"$x\r\n", b"*-5\r\n", b"$99999999999\r\n"] {
            assert!(complete(bad, MAX_DEPTH).is_err(), "{bad:?}");
        }
        assert!(complete(b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n", MAX_DEPTH).is_err());
    }

    #[test]
    fn replies_read_as_the_script_answers() {
        assert_eq!(
            reply(b"$5\r\nab\r\nc\r\n").unwrap(),
            Reply::Bulk(b"ab\r\nc")
        );
        assert_eq!(reply(b"$0\r\n\r\n").unwrap(), Reply::Bulk(b""));
        assert_eq!(
            reply(b"*3\r\n:1\r\n:-20\r\n:3\r\n").unwrap(),
            Reply::Integers(vec![1, -20, 3])
        );
        assert_eq!(reply(b"*0\r\n").unwrap(), Reply::Integers(vec![]));
        assert_eq!(reply(b":7\r\n").unwrap(), Reply::Integer(7));
        assert_eq!(reply(b"$-1\r\n").unwrap(), Reply::Other);
        assert_eq!(reply(b"*2\r\n:1\r\n$1\r\nx\r\n").unwrap(), Reply::Other);
        assert_eq!(reply(b"+OK\r\n").unwrap(), Reply::Other);
        let e = reply(b"-NOSCRIPT No matching script.\r\n").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Server(ServerErrorKind::NoScript));
        let e = reply(b"-MOVED 3999 127.0.0.1:6381\r\n").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Server(ServerErrorKind::Moved));
        assert_eq!(e.redirect_node(), Some(("127.0.0.1:6381", 3999)));
        let e = reply(b"-WRONGTYPE Operation against a key\r\n").unwrap_err();
        assert_eq!(e.code(), Some("WRONGTYPE"));
        let e = reply(b"-NOPERM User u has no permissions to run the 'ping' command\r\n");
        assert_eq!(e.unwrap_err().code(), Some("NOPERM"));
    }

    #[test]
    fn values_of_the_redis_crate_read_the_same() {
        assert_eq!(
            Reply::of_value(&Value::BulkString(b"xy".to_vec())),
            Reply::Bulk(b"xy")
        );
        assert_eq!(
            Reply::of_value(&Value::Array(vec![Value::Int(1), Value::Int(-2)])),
            Reply::Integers(vec![1, -2])
        );
        assert_eq!(
            Reply::of_value(&Value::Array(vec![Value::Int(1), Value::Nil])),
            Reply::Other
        );
        assert_eq!(Reply::of_value(&Value::Okay), Reply::Other);
    }
}
