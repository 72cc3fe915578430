//! The demo's built-in upstream: an echo for every path, and an LLM-like
//! endpoint for `/v1/chat`.
//!
//! Owns a small hyper server with one task per connection. Every request
//! but a chat gets a JSON echo of what it was (method, path, query,
//! tenant, body size). `/v1/chat` streams server-sent events of a random
//! number of tokens (50 to 500, a chunk of 50 every 100 ms) and reports
//! what the answer used in an `X-Usage` trailer and in its last event, as
//! LLM APIs report usage at the end of a streamed answer; hyper sends the
//! trailer to a client that asks for trailers (`TE: trailers`), as
//! tollgate does on a route with `usage_header`. Not on the production
//! path.

use std::convert::Infallible;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderMap, HeaderValue, TRAILER};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;

/// Tokens in one chunk of a chat answer.
const CHUNK: u32 = 50;
/// Time between two chunks.
const CHUNK_EVERY: Duration = Duration::from_millis(100);

/// Serves the demo upstream on `listener` until the task is dropped.
pub async fn serve(listener: std::net::TcpListener) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(listener)?;
    loop {
        let (stream, _) = listener.accept().await?;
        actix_web::rt::spawn(async move {
            let service = service_fn(|req| async move { Ok::<_, Infallible>(answer(req).await) });
            // A client that leaves mid-answer is no error of the demo's.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The answer to `req`: a chat stream for `/v1/chat`, else an echo.
async fn answer(req: Request<Incoming>) -> Response<Answer> {
    if req.uri().path().starts_with("/v1/chat") {
        let mut response = Response::new(Answer::Chat(Chat::new(random_tokens())));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(TRAILER, HeaderValue::from_static("x-usage"));
        return response;
    }
    let (parts, mut body) = req.into_parts();
    let mut body_bytes = 0;
    while let Some(Ok(frame)) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
    {
        body_bytes += frame.data_ref().map_or(0, Bytes::len);
    }
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    let echo = json!({
        "upstream": "tollgate demo",
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query().unwrap_or(""),
        "tenant": header("x-api-key"),
        "forwarded_for": header("x-forwarded-for"),
        "body_bytes": body_bytes,
    });
    let mut response = Response::new(Answer::Whole(Some(Bytes::from(echo.to_string()))));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A chat answer's size: 50 to 500 tokens, in whole chunks.
fn random_tokens() -> u32 {
    static ASKED: AtomicU64 = AtomicU64::new(0);
    let n = ASKED.fetch_add(1, Ordering::Relaxed);
    let chunks = RandomState::new().hash_one(n) % 10;
    // At most 9 + 1 chunks of 50: the cast cannot truncate.
    (chunks as u32 + 1) * CHUNK
}

/// The body of a demo answer.
enum Answer {
    /// An echo, sent whole.
    Whole(Option<Bytes>),
    /// A chat stream.
    Chat(Chat),
}

/// A chat answer being streamed.
struct Chat {
    /// Tokens it uses in all.
    tokens: u32,
    /// Tokens sent so far.
    sent: u32,
    /// Whether the trailer has gone.
    done: bool,
    /// Until the next chunk.
    tick: Pin<Box<tokio::time::Sleep>>,
}

impl Chat {
    /// A stream of `tokens` tokens.
    fn new(tokens: u32) -> Self {
        Self {
            tokens,
            sent: 0,
            done: false,
            tick: Box::pin(tokio::time::sleep(CHUNK_EVERY)),
        }
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let chat = match self.get_mut() {
            Answer::Whole(body) => return Poll::Ready(body.take().map(|b| Ok(Frame::data(b)))),
            Answer::Chat(chat) => chat,
        };
        if chat.done {
            return Poll::Ready(None);
        }
        if chat.sent == chat.tokens {
            chat.done = true;
            let mut trailers = HeaderMap::new();
            trailers.insert("x-usage", HeaderValue::from(chat.tokens));
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        ready!(chat.tick.as_mut().poll(cx));
        chat.tick
            .as_mut()
            .reset(tokio::time::Instant::now() + CHUNK_EVERY);
        chat.sent += CHUNK;
        let event = if chat.sent == chat.tokens {
            format!(
                "data: {{\"usage\": {{\"total_tokens\": {}}}}}\n\n",
                chat.tokens
            )
        } else {
            format!(
                "data: {{\"delta\": \"{CHUNK} tokens\", \"sent\": {}}}\n\n",
                chat.sent
            )
        };
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Answer::Whole(body) => body.is_none(),
            Answer::Chat(chat) => chat.done,
        }
    }
}
