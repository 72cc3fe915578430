//! Script calls on connections of tollgate's own.
//!
//! Owns `Lines`: for one primary and one
//! [`RedisConn`](super::RedisConn) (a proxy worker's), the connections
//! that carry its script calls. A line carries one call at a time: the
//! call writes its command (a [`ScriptCall`]), reads its one reply and
//! hands it to the caller as borrowed bytes (a [`Reply`]), with no
//! command object, channel, connection task or general value in between
//! (the multiplexed connection of the redis crate spent about 700
//! instructions on them per coalesced decision).
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
use redis::RedisResult;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use super::NodeAddr;
use super::script_call::{
    LuaScript, MAX_DEPTH, MAX_REPLY, Reply, ScriptCall, complete, error, malformed, reply,
};

/// Most lines one primary has open for one worker's calls.
pub(crate) const MAX_LINES: usize = 16;

/// Pause after a line failed to open before another is tried.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

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
