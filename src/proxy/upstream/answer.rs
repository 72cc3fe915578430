//! An upstream's answer body, read from its connection as it is polled.
//!
//! Owns the body's framing as the connection reads it (a length, chunks
//! with trailers, or until the upstream closes) and whether the
//! connection may carry another request once the body has ended: only
//! when it was read to its end, nothing said to close it and no stray
//! bytes were left behind.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::UPSTREAM_READ_BUFFER;
use super::conn::Conn;
use super::framing::{self, Chunked, Framing, Head, Piece};

/// How far an answer's body has been read.
enum Reading {
    /// This many bytes are left.
    Length(u64),
    /// Chunks are being decoded.
    Chunked(Chunked),
    /// Until the upstream closes.
    Close,
    /// To the end.
    Ended,
    /// It failed; the connection is gone.
    Failed,
}

/// An upstream's answer body, read from its connection as it is polled.
pub(in crate::proxy) struct UpstreamBody {
    /// The connection the body arrives on.
    conn: Conn,
    /// How far the body has been read.
    reading: Reading,
    /// Whether the connection may carry another request afterwards.
    keep_alive: bool,
}

impl UpstreamBody {
    /// The body `head` announced, read from `conn`.
    pub(super) fn new(conn: Conn, head: &Head) -> Self {
        let reading = match head.framing {
            Framing::Empty | Framing::Length(0) => Reading::Ended,
            Framing::Length(n) => Reading::Length(n),
            Framing::Chunked => Reading::Chunked(Chunked::new()),
            Framing::Close => Reading::Close,
        };
        Self {
            conn,
            reading,
            keep_alive: head.keep_alive,
        }
    }

    /// The connection, when the body has been read to its end and the
    /// connection may carry another request.
    pub(super) fn into_conn(self) -> Option<Conn> {
        (matches!(self.reading, Reading::Ended) && self.keep_alive && self.conn.buf.is_empty())
            .then_some(self.conn)
    }

    /// Ends the body with `error`.
    fn fail(&mut self, error: io::Error) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.reading = Reading::Failed;
        Poll::Ready(Some(Err(error)))
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        loop {
            let buf = &mut this.conn.buf;
            match &mut this.reading {
                Reading::Ended | Reading::Failed => return Poll::Ready(None),
                Reading::Length(left) if !buf.is_empty() => {
                    let take = (*left).min(buf.len() as u64);
                    *left -= take;
                    if *left == 0 {
                        this.reading = Reading::Ended;
                    }
                    // `take` is at most `buf.len()`, so it fits a usize.
                    let data = buf.split_to(take as usize).freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                // Polled even on an empty buffer: past the trailers, the
                // end needs no more bytes.
                Reading::Chunked(chunked) => match chunked.next(buf) {
                    Ok(Some(Piece::Data(data))) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Ok(Some(Piece::Trailers(trailers))) => {
                        return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                    }
                    Ok(Some(Piece::End)) => {
                        this.reading = Reading::Ended;
                        return Poll::Ready(None);
                    }
                    Ok(None) if buf.len() >= UPSTREAM_READ_BUFFER => {
                        return this.fail(io::Error::other(framing::FramingError::Chunk));
                    }
                    Ok(None) => {}
                    Err(e) => return this.fail(io::Error::other(e)),
                },
                Reading::Close if !buf.is_empty() => {
                    let data = buf.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Reading::Length(_) | Reading::Close => {}
            }
            match std::task::ready!(this.conn.poll_fill(cx)) {
                Ok(0) if matches!(this.reading, Reading::Close) => {
                    this.reading = Reading::Ended;
                    this.keep_alive = false;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    return this.fail(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "upstream closed the connection within a body",
                    ));
                }
                Ok(_) => {}
                Err(e) => return this.fail(e),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.reading, Reading::Ended)
    }

    fn size_hint(&self) -> SizeHint {
        match self.reading {
            Reading::Length(left) => SizeHint::with_exact(left),
            Reading::Ended => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}
