//! Script calls on connections of tollgate's own.
//!
//! Owns [`ScriptCall`], an `EVALSHA`'s arguments written straight into
//! one buffer as they go on the wire, [`Reply`], a script's reply read
//! from the bytes it arrived in, and `Lines`: for one primary and one
//! [`RedisConn`](super::RedisConn) (a proxy worker's), the connections
//! that carry its script calls. A line carries one call at a time: the
//! call writes its command, reads its one reply and hands it to the caller
//! as borrowed bytes, with no command object, channel, connection task or
//! general value in between (the multiplexed connection of the redis
//! crate spent about 700 instructions on them per coalesced decision).
//!
//! A call that finds no idle line takes the primary's shared connection
//! instead, and has a line opened in the background (one at a time, at
//! most [`MAX_LINES`] per primary): the first calls after a start, calls
//! beyond the lines, and every call while lines cannot be opened still go
//! out. A line is opened as the shared connection is: TLS with the same
//! trust and client certificate, the same user, password and database.
//!
//! Invariants: a line whose call failed on the wire (a reset, a malformed
//! reply) or was abandoned (timed out, its request gone) is closed, never
//! reused, so a late reply can never answer another call; a line goes
//! back to the idle ones only after every reply its call asked for was
//! read.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::{Buf as _, BytesMut};
use redis::{Cmd, RedisResult, RedisWrite, ToRedisArgs, Value};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use super::NodeAddr;

/// Most lines one primary has open for one worker's calls.
pub(crate) const MAX_LINES: usize = 16;

/// Longest reply a line accepts: far beyond any answer of the script (a
/// few bytes per decision); anything longer is not its reply.
const MAX_REPLY: usize = 1 << 20;

/// Deepest nesting of arrays a reply may have.
const MAX_DEPTH: u8 = 4;

/// Pause after a line failed to open before another is tried.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

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
    fn write_command(&self, hash: &str, out: &mut Vec<u8>) {
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
fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed reply from redis")
}

/// The length of the complete RESP2 value at the front of `buf`; `None`
/// while more bytes are needed.
fn complete(buf: &[u8], depth: u8) -> io::Result<Option<usize>> {
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
fn reply(frame: &[u8]) -> RedisResult<Reply<'_>> {
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
fn error(frame: &[u8]) -> redis::RedisError {
    match redis::parse_redis_value(frame).and_then(Value::extract_error) {
        Err(e) => e,
        Ok(_) => malformed().into(),
    }
}

/// What a line runs over: TCP, or TLS over it.
trait Io: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// How lines to one primary are opened.
pub(crate) struct Connect {
    /// The primary.
    pub(crate) addr: NodeAddr,
    /// TLS, and the name the certificate must carry; `None` for TCP.
    pub(crate) tls: Option<(TlsConnector, ServerName<'static>)>,
    /// The user (when set) and password sent by `AUTH`.
    pub(crate) auth: Option<(Option<String>, String)>,
    /// The database selected, when not 0.
    pub(crate) db: i64,
    /// Bound on opening one, handshakes included.
    pub(crate) timeout: Duration,
}

/// Counts a line while it is open.
struct Alive(Arc<AtomicUsize>);

impl Alive {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count.clone())
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One connection carrying one call at a time.
struct Line {
    /// The socket.
    io: Box<dyn Io>,
    /// Bytes read and not yet consumed.
    input: BytesMut,
    /// The command being written, its buffer reused.
    output: Vec<u8>,
    /// Counted among the primary's lines while open.
    _alive: Alive,
}

impl Line {
    /// Opens a line as `connect` says, counted in `count`.
    async fn open(connect: &Connect, count: &Arc<AtomicUsize>) -> RedisResult<Self> {
        let opening = async {
            let tcp = TcpStream::connect((&*connect.addr.host, connect.addr.port)).await?;
            tcp.set_nodelay(true)?;
            let io: Box<dyn Io> = match &connect.tls {
                Some((tls, name)) => Box::new(tls.connect(name.clone(), tcp).await?),
                None => Box::new(tcp),
            };
            let mut line = Self {
                io,
                input: BytesMut::with_capacity(4096),
                output: Vec::with_capacity(4096),
                _alive: Alive::new(count),
            };
            let mut handshake = Vec::new();
            if let Some((user, password)) = &connect.auth {
                let mut auth = redis::cmd("AUTH");
                auth.arg(user.as_deref()).arg(password);
                handshake.push(auth);
            }
            if connect.db != 0 {
                let mut select = redis::cmd("SELECT");
                select.arg(connect.db);
                handshake.push(select);
            }
            for command in &handshake {
                command.write_packed_command(&mut line.output);
            }
            // A PING last: the line is used only once the server has
            // answered on it (a server at `maxclients` answers an error and
            // closes), whatever the user may run (`NOPERM` is an answer).
            redis::cmd("PING").write_packed_command(&mut line.output);
            line.io.write_all(&line.output).await?;
            for _ in &handshake {
                line.next_reply().await??;
            }
            match line.next_reply().await? {
                Err(e) if e.code() != Some("NOPERM") => return Err(e),
                _ => {}
            }
            Ok::<_, redis::RedisError>(line)
        };
        match tokio::time::timeout(connect.timeout, opening).await {
            Ok(result) => result,
            Err(_) => Err(io::Error::from(io::ErrorKind::TimedOut).into()),
        }
    }

    /// Reads until one whole reply is buffered; its length. Consumes
    /// nothing.
    async fn read_reply(&mut self) -> io::Result<usize> {
        loop {
            if !self.input.is_empty()
                && let Some(len) = complete(&self.input, MAX_DEPTH)?
            {
                return Ok(len);
            }
            // What one reply may hold in all, however it is nested.
            if self.input.len() > MAX_REPLY {
                return Err(malformed());
            }
            if self.io.read_buf(&mut self.input).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// Reads one reply and consumes it: `Ok(Err)` when it is an error
    /// reply, `Err` when the line failed.
    async fn next_reply(&mut self) -> io::Result<RedisResult<()>> {
        let len = self.read_reply().await?;
        let result = match self.input[0] {
            b'-' => Err(error(&self.input[..len])),
            _ => Ok(()),
        };
        self.input.advance(len);
        Ok(result)
    }

    /// Calls `script` with `call`'s keys and arguments and hands the reply
    /// to `read`; a `NOSCRIPT` reply loads the script and calls again,
    /// both in one write. `Err` with an I/O error leaves the line unusable.
    async fn call<T>(
        &mut self,
        script: &LuaScript,
        call: &ScriptCall,
        read: &impl Fn(Reply<'_>) -> Option<T>,
    ) -> RedisResult<Option<T>> {
        self.output.clear();
        call.write_command(script.hash(), &mut self.output);
        self.io.write_all(&self.output).await?;
        let mut len = self.read_reply().await?;
        if self.input.starts_with(b"-NOSCRIPT") {
            self.input.advance(len);
            self.output.clear();
            redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(script.code())
                .write_packed_command(&mut self.output);
            call.write_command(script.hash(), &mut self.output);
            self.io.write_all(&self.output).await?;
            let loaded = self.next_reply().await?;
            len = self.read_reply().await?;
            if let Err(e) = loaded {
                self.input.advance(len);
                return Err(e);
            }
        }
        let result = reply(&self.input[..len]).map(read);
        self.input.advance(len);
        result
    }
}

/// The lines to one primary for one worker: the idle ones, and what opens
/// more.
pub(crate) struct Lines {
    /// How they are opened; `None` when they cannot be (every call then
    /// takes the shared connection).
    connect: Option<Connect>,
    /// Open and not carrying a call.
    idle: Mutex<Vec<Line>>,
    /// Open, idle or not.
    count: Arc<AtomicUsize>,
    /// Whether one is being opened.
    opening: AtomicBool,
}

impl Lines {
    /// None open yet; opened as `connect` says.
    pub(crate) fn new(connect: Option<Connect>) -> Arc<Self> {
        Arc::new(Self {
            connect,
            idle: Mutex::new(Vec::new()),
            count: Arc::new(AtomicUsize::new(0)),
            opening: AtomicBool::new(false),
        })
    }

    /// Lines open now, idle or carrying a call.
    pub(crate) fn open(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Makes the call on an idle line; `None` when there is none, or when
    /// the line failed on the wire (the caller then makes the call on the
    /// shared connection). A line that failed on the wire is closed with
    /// every idle one (a restarted server or a dropped network leaves
    /// them all dead), and another is opened in the background, when
    /// allowed; a line whose call the caller abandons is dropped with it.
    /// A line that failed after its command was written may have run it:
    /// the call made again then takes its tokens twice (fewer admissions,
    /// never more).
    pub(crate) async fn call<T>(
        self: &Arc<Self>,
        script: &LuaScript,
        call: &ScriptCall,
        read: &impl Fn(Reply<'_>) -> Option<T>,
    ) -> Option<RedisResult<Option<T>>> {
        let idle = self.idle().pop();
        if let Some(mut line) = idle {
            match line.call(script, call, read).await {
                Err(e) if e.is_io_error() => {
                    tracing::debug!(error = %e, "A Redis line failed; the shared connection takes the call.");
                    self.idle().clear();
                }
                result => {
                    self.idle().push(line);
                    return Some(result);
                }
            }
        }
        self.grow();
        None
    }

    /// The idle lines.
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Line>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens one more line in the background, unless one is being opened
    /// or the primary has [`MAX_LINES`] already.
    fn grow(self: &Arc<Self>) {
        if self.connect.is_none()
            || self.open() >= MAX_LINES
            || self.opening.swap(true, Ordering::Relaxed)
        {
            return;
        }
        let lines = self.clone();
        tokio::spawn(async move {
            if let Some(connect) = &lines.connect {
                match Line::open(connect, &lines.count).await {
                    Ok(line) => lines.idle().push(line),
                    Err(e) => {
                        tracing::debug!(addr = %connect.addr, error = %e, "A Redis line did not open.");
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                }
            }
            lines.opening.store(false, Ordering::Relaxed);
        });
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
